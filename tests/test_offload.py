"""Offload and backend flags: parsed like llama-server's, carried into llama.cpp's model and
context parameters (read back through the binding), the devices and layers reported; layers on
llama.cpp's rpc-server processes give the same greedy answers as the local run."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import httpx
import pytest

import ffi
from ffi._lib import ffi as ffi_c
from ffi._lib import lib
from server import offload
from server.settings import CACHE_TYPES, parse_settings
from tests.support.ports import free_port
from tests.support.process import ServerProcess, serving
from tests.support.rpc import rpc_servers

pytestmark = pytest.mark.server

LAYERS = 31  # SmolLM2-135M: 30 repeating layers and the output layer, as llama.cpp counts them
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
SMALL = ["--threads", "1", "--parallel", "2", "--ctx-size", "1024"]
NO_GPU_LINE = "llama.cpp found no GPU"


# -- the flags --------------------------------------------------------------------------------


def test_flags_and_llama_server_names() -> None:
    s = parse_settings(
        ["-ngl", "12", "-sm", "row", "-mg", "1", "-ts", "3,1", "-fa", "on", "-nkvo", "-ctk", "q8_0", "-ctv", "q4_0"],
        env={},
    )
    assert (s.n_gpu_layers, s.split_mode, s.main_gpu, s.tensor_split) == ("12", "row", 1, (3.0, 1.0))
    assert (s.flash_attn, s.no_kv_offload, s.cache_type_k, s.cache_type_v) == ("on", True, "q8_0", "q4_0")
    assert parse_settings(["--n-gpu-layers", "ALL", "--rpc", "a:1,10.0.0.2:50052"], env={}).rpc == (
        "a:1",
        "10.0.0.2:50052",
    )
    defaults = parse_settings([], env={})
    assert (defaults.n_gpu_layers, defaults.split_mode, defaults.flash_attn, defaults.rpc) == (
        "auto",
        "layer",
        "auto",
        (),
    )


def test_flags_from_the_environment() -> None:
    env = {
        "LLAMA_TRIO_N_GPU_LAYERS": "all",
        "LLAMA_TRIO_TENSOR_SPLIT": "1/2",
        "LLAMA_TRIO_RPC": "h:5,k:6",
        "LLAMA_TRIO_NO_KV_OFFLOAD": "1",
        "LLAMA_TRIO_CACHE_TYPE_K": "q4_0",
    }
    s = parse_settings([], env=env)
    assert (s.n_gpu_layers, s.tensor_split, s.rpc, s.no_kv_offload, s.cache_type_k) == (
        "all",
        (1.0, 2.0),
        ("h:5", "k:6"),
        True,
        "q4_0",
    )
    assert parse_settings(["-ngl", "0"], env=env).n_gpu_layers == "0"  # the flag wins


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["-ngl", "-1"], {}, "not a number of layers"),
        (["-ngl", "some"], {}, "not a number of layers"),
        (["-sm", "tensor"], {}, "not one of none, layer, row"),
        (["-fa", "yes"], {}, "not one of on, off, auto"),
        (["-ctk", "q3_k"], {}, "not one of f32"),
        (["-ts", "1,x"], {}, "list of numbers"),
        (["-ts", "0,0"], {}, "not all 0"),
        (["--rpc", "localhost"], {}, "not host:port"),
        (["--rpc", "[::1]:50052"], {}, "not host:port"),
        (["--rpc", "h:70000"], {}, "not host:port"),
        (["-fa", "off", "-ctv", "q8_0"], {}, "needs flash attention"),
        ([], {"LLAMA_TRIO_SPLIT_MODE": "rows"}, "LLAMA_TRIO_SPLIT_MODE"),
        (["--responses-max-mb", "inf"], {}, "--responses-max-mb must be a positive, finite number"),
        ([], {"LLAMA_TRIO_RESPONSES_MAX_MB": "nan"}, "--responses-max-mb must be"),
    ],
)
def test_bad_values_are_refused(
    argv: list[str], env: dict[str, str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv, env=env)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_cache_types_are_the_bindings() -> None:
    assert set(CACHE_TYPES) == set(ffi.context.CACHE_TYPES)


def test_gpu_layers_resolution() -> None:
    assert offload.gpu_layers("auto", has_offload_device=False) == 0
    assert offload.gpu_layers("auto", has_offload_device=True) == -1
    assert offload.gpu_layers("all", has_offload_device=False) == -1
    assert offload.gpu_layers("7", has_offload_device=True) == 7


def test_placement_from_the_load_log() -> None:
    lines = [
        "load_tensors: layer   0 assigned to device RPC0, is_swa = 0",
        "load_tensors: layer   1 assigned to device RPC1, is_swa = 0",
        "load_tensors: layer   2 assigned to device CPU, is_swa = 0",
        "load_tensors: offloaded 2/3 layers to GPU",
    ]
    placement = ffi.Placement.from_log(lines)
    assert placement.layers == {"RPC0": 1, "RPC1": 1, "CPU": 1}
    assert (placement.total, placement.offloaded) == (3, 2)


# -- into llama.cpp's parameters, read back ---------------------------------------------------


def test_model_flags_reach_llama_model_params(model_path: pathlib.Path) -> None:
    settings = parse_settings(["-ngl", "7", "-sm", "row", "-mg", "1", "-ts", "3,1"], env={})
    with offload.load_model(settings, str(model_path), ffi.ProgressReporter("test", offload.logger)) as model:
        params = model.load_params
        assert params.n_gpu_layers == 7
        assert params.split_mode == lib.LLAMA_SPLIT_MODE_ROW
        assert params.main_gpu == 1
        assert [params.tensor_split[i] for i in range(3)] == [3.0, 1.0, 0.0]
        # No GPU here: every layer stayed on the CPU, whatever was asked.
        assert model.placement.layers == {"CPU": LAYERS}
    auto = parse_settings([], env={})
    with offload.load_model(auto, str(model_path), ffi.ProgressReporter("test", offload.logger)) as model:
        assert model.load_params.n_gpu_layers == 0  # auto, with nothing to offload to
        assert model.load_params.tensor_split == ffi_c.NULL


def test_context_flags_reach_llama_context_params(model: ffi.Model) -> None:
    settings = parse_settings(["-fa", "on", "-ctk", "q8_0", "-ctv", "q4_0", "-nkvo"], env={})
    with ffi.Context(model, n_ctx=256, n_batch=64, attention=offload.attention(settings)) as ctx:
        assert ctx.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        assert ctx.params.type_k == lib.GGML_TYPE_Q8_0
        assert ctx.params.type_v == lib.GGML_TYPE_Q4_0
        assert not ctx.params.offload_kqv
    with ffi.Context(model, n_ctx=256, n_batch=64) as ctx:  # the defaults: llama.cpp's own
        assert ctx.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_AUTO
        assert (ctx.params.type_k, ctx.params.type_v) == (lib.GGML_TYPE_F16, lib.GGML_TYPE_F16)
        assert ctx.params.offload_kqv


def test_quantized_kv_cache_is_smaller(model: ffi.Model) -> None:
    """The cache type takes effect: the same prompt's cells take fewer bytes in q8_0."""
    tokens = model.vocab.tokenize("The three primary colors are red, yellow and blue.", add_special=True)
    sizes = {}
    for kind in ("f16", "q8_0"):
        attention = ffi.Attention(type_k=kind, type_v=kind)
        with ffi.Context(model, n_ctx=256, n_batch=64, attention=attention) as ctx, ffi.Batch(64) as batch:
            batch.add_run(tokens, 0, 0, logits_last=True)
            ctx.decode(batch)
            sizes[kind] = ctx.seq_state_size(0)
    assert sizes["q8_0"] < sizes["f16"] * 0.75, sizes


# -- the server ---------------------------------------------------------------------------------


def greedy(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def local() -> Iterator[ServerProcess]:
    """A CPU-only build asked for 99 GPU layers: it starts, and says once that it has no GPU."""
    with serving(["-ngl", "99", *SMALL]) as proc:
        yield proc


def test_no_gpu_is_one_clear_line_and_health_shows_the_devices(local: ServerProcess) -> None:
    assert local.log.count(NO_GPU_LINE) == 1, local.log
    line = next(li for li in local.log.splitlines() if NO_GPU_LINE in li)
    assert "WARNING" in line and "--n-gpu-layers 99" in line
    health = httpx.get(local.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["devices"] == [
        {
            "name": "CPU",
            "description": health["devices"][0]["description"],
            "type": "cpu",
            "memory_mib": health["devices"][0]["memory_mib"],
            "layers": LAYERS,
        }
    ]
    assert f"0/{LAYERS} layers offloaded" in local.log


def test_layers_on_two_rpc_servers_answer_as_the_local_run(local: ServerProcess, tmp_path: pathlib.Path) -> None:
    with rpc_servers(2, tmp_path) as endpoints, serving(["--rpc", ",".join(endpoints), *SMALL]) as remote:
        devices = httpx.get(remote.url + "/health", timeout=10).json()["devices"]
        layers = {d["name"]: d["layers"] for d in devices}
        assert layers["CPU"] == 0 and layers["RPC0"] > 0 and layers["RPC1"] > 0, devices
        assert sum(layers.values()) == LAYERS
        assert sorted(d["description"] for d in devices if d["name"].startswith("RPC")) == sorted(endpoints)
        assert NO_GPU_LINE not in remote.log
        for prompt in PROMPTS:
            assert greedy(remote.url, prompt) == greedy(local.url, prompt), prompt
    for i in range(2):
        assert "Accepted client connection" in (tmp_path / f"rpc-{i}.log").read_text()


def test_an_unreachable_rpc_server_fails_the_load_cleanly() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with ServerProcess(["--rpc", endpoint, *SMALL]) as proc:
        assert proc.wait(60) == 1
    assert f"RPC server {endpoint} cannot be reached" in proc.log
    assert "Traceback" not in proc.log


def test_a_failed_load_says_llama_cpps_reason(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(40))  # a header, no architecture
    with pytest.raises(ffi.ModelLoadError) as exc:
        ffi.Model(bad)
    assert "error loading model" in str(exc.value)
