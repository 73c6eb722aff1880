"""The KV cache's fit in the memory left (``server/models/memory.py``): what the host and its
cgroups leave (read from fake /proc and /sys trees), the cache's size from the model's shape
against what llama.cpp allocates, and a server whose cache cannot fit refusing to start with
one clear line rather than being killed by the OOM killer."""

from __future__ import annotations

import logging
import pathlib

import pytest

import ffi
from server.models.memory import Available, available_memory, check_kv_fits, make_context, prompt_cache_bound
from server.settings import parse_settings
from tests.support.process import ServerProcess

MIB = 1024 * 1024
GUARD = 120


def _tree(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = "MemTotal:       8000000 kB\nMemAvailable:   6000000 kB\nSwapTotal: 0 kB\nSwapFree:  0 kB\n"


def test_the_host_alone(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/\n"})
    got = available_memory(str(tmp_path / "proc"), str(tmp_path / "sys"))
    assert got == Available(6000000 * 1024, "the host's available memory")


def test_free_swap_counts_with_the_host(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO.replace("SwapFree:  0", "SwapFree:  1000"), "self/cgroup": ""})
    got = available_memory(str(tmp_path / "proc"), str(tmp_path / "sys"))
    assert got is not None and got.bytes == 6001000 * 1024 and "swap" in got.source


def test_no_meminfo_means_unknown(tmp_path: pathlib.Path) -> None:
    assert available_memory(str(tmp_path / "proc"), str(tmp_path / "sys")) is None


def test_a_v2_limit_on_an_enclosing_cgroup_counts_and_inactive_files_are_free(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/kubepods/pod1/box\n"})
    sys = tmp_path / "sys"
    _tree(
        sys,
        {
            "cgroup.controllers": "cpu memory\n",
            # the pod: 2 GiB, 1.5 GiB used of which 256 MiB are inactive file pages
            "kubepods/pod1/memory.max": str(2048 * MIB),
            "kubepods/pod1/memory.current": str(1536 * MIB),
            "kubepods/pod1/memory.stat": f"anon 1\ninactive_file {256 * MIB}\nactive_file 5\n",
            # the container itself has no limit of its own
            "kubepods/pod1/box/memory.max": "max",
            "kubepods/pod1/box/memory.current": str(1024 * MIB),
            "kubepods/memory.max": "max",
            "kubepods/memory.current": str(4096 * MIB),
        },
    )
    got = available_memory(str(tmp_path / "proc"), str(sys))
    assert got == Available(768 * MIB, "the memory limit of cgroup /kubepods/pod1")


def test_a_v2_container_with_its_own_namespace_reads_its_root(tmp_path: pathlib.Path) -> None:
    # Inside a cgroup namespace /proc/self/cgroup says "/" and the mount is the container's own.
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/\n"})
    sys = tmp_path / "sys"
    _tree(
        sys,
        {
            "cgroup.controllers": "memory\n",
            "memory.max": str(512 * MIB),
            "memory.current": str(100 * MIB),
            "memory.stat": "inactive_file 0\n",
            "memory.swap.max": str(64 * MIB),
            "memory.swap.current": "0",
        },
    )
    got = available_memory(str(tmp_path / "proc"), str(sys))
    # free swap on the host is 0, so the cgroup's own swap allowance gives nothing
    assert got == Available(412 * MIB, "the memory limit of cgroup /")


def test_a_v1_hierarchical_limit(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "4:memory:/docker/abc\n0::/\n"})
    sys = tmp_path / "sys"
    _tree(
        sys,
        {
            "memory/docker/abc/memory.stat": (
                f"cache 1\nhierarchical_memory_limit {1024 * MIB}\ntotal_inactive_file {100 * MIB}\n"
            ),
            "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712",
            "memory/docker/abc/memory.usage_in_bytes": str(600 * MIB),
        },
    )
    got = available_memory(str(tmp_path / "proc"), str(sys))
    assert got == Available(524 * MIB, "the cgroup's memory limit")


def test_a_v1_cgroup_without_a_limit_leaves_the_host(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "4:memory:/x\n"})
    sys = tmp_path / "sys"
    _tree(
        sys,
        {
            "memory/x/memory.stat": "hierarchical_memory_limit 9223372036854771712\n",
            "memory/x/memory.usage_in_bytes": str(600 * MIB),
        },
    )
    got = available_memory(str(tmp_path / "proc"), str(sys))
    assert got is not None and got.source == "the host's available memory"


def test_a_cgroup_path_cannot_climb_out_of_its_mount(tmp_path: pathlib.Path) -> None:
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "4:memory:/../../elsewhere\n"})
    _tree(tmp_path / "sys/fs/elsewhere", {"memory.stat": "hierarchical_memory_limit 1\n", "memory.usage_in_bytes": "0"})
    got = available_memory(str(tmp_path / "proc"), str(tmp_path / "sys" / "fs" / "cgroup"))
    assert got is not None and got.source == "the host's available memory"


# -- the cache's size -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "n_ctx", "n_seq", "unified"),
    [
        ("f16", 4096, 4, False),
        ("q8_0", 4096, 4, False),
        ("q4_0", 4096, 4, False),
        ("q8_0", 1000, 3, False),  # each sequence's 333 cells padded to 512: 1.5 times the cells asked
        ("f32", 777, 7, False),
        ("f16", 1000, 3, True),  # one stream: the whole padded to 1024
    ],
)
def test_the_estimate_is_what_llama_cpp_allocates(
    model: ffi.Model, kind: str, n_ctx: int, n_seq: int, unified: bool
) -> None:
    attention = ffi.Attention(type_k=kind, type_v=kind, flash_attn="on")
    estimate = ffi.kv_cache_bytes(model, n_ctx, n_seq, attention, unified=unified)
    with ffi.Context(model, n_ctx=n_ctx, n_batch=64, n_seq_max=n_seq, kv_unified=unified, attention=attention) as ctx:
        allocated = ctx.kv_buffers["CPU"]
        assert ffi.padded_cells(n_ctx, n_seq, unified=unified) == ctx.n_ctx
    assert estimate is not None and abs(estimate - allocated) < 0.01 * MIB, (estimate, allocated)


def _settings(*extra: str):
    return parse_settings(["--parallel", "4", "--ctx-size", "4096", *extra], env={})


def test_a_cache_larger_than_what_is_left_is_refused(model: ffi.Model, caplog: pytest.LogCaptureFixture) -> None:
    attention = ffi.Attention()
    need = ffi.kv_cache_bytes(model, 4096, 4, attention)
    assert need is not None
    with pytest.raises(ffi.ContextError) as exc:
        check_kv_fits(model, 4096, 4, attention, Available(need - 1, "the test's bound"))
    message = str(exc.value)
    assert f"needs {need // MIB} MiB (4096 cells x {model.n_layer} layers, K f16 / V f16)" in message
    assert "the test's bound leaves" in message and "lower the context size (--ctx-size" in message
    with caplog.at_level(logging.WARNING, "llama_trio.models"):
        check_kv_fits(model, 4096, 4, attention, Available(need + 1, "the test's bound"))
        assert "takes" in caplog.text  # fits, but takes nearly all that is left
        caplog.clear()
        check_kv_fits(model, 4096, 4, attention, Available(need * 2, "the test's bound"))
        assert caplog.text == ""


def test_layers_offloaded_with_their_cache_need_no_memory_here(
    model: ffi.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As an RPC or GPU load places them: every repeating layer elsewhere, the output layer here.
    monkeypatch.setattr(model, "placement", ffi.Placement({"CPU": 1, "RPC[127.0.0.1:1]": model.n_layer}))
    check_kv_fits(model, 4096, 4, ffi.Attention(), Available(0, "nothing"))
    with pytest.raises(ffi.ContextError):  # with --no-kv-offload the whole cache stays here
        check_kv_fits(model, 4096, 4, ffi.Attention(offload_kv=False), Available(0, "nothing"))


def test_the_prompt_cache_keeps_to_half_of_what_is_left(model: ffi.Model, caplog: pytest.LogCaptureFixture) -> None:
    settings = _settings("--cache-ram", "2048")
    assert prompt_cache_bound(model, settings, Available(8192 * MIB, "x")) == 2048 * MIB
    assert prompt_cache_bound(model, settings, None) == 2048 * MIB
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, "llama_trio.models"):
        assert prompt_cache_bound(model, settings, Available(1000 * MIB, "the pod's limit")) == 500 * MIB
    assert "--cache-ram 2048 MiB is more than half of the 1000 MiB that the pod's limit leave" in caplog.text
    assert prompt_cache_bound(model, _settings("--cache-ram", "0"), Available(0, "x")) == 0
    # Several models: what the others' caches may still grow into is not there to take.
    assert prompt_cache_bound(model, settings, Available(5000 * MIB, "x"), promised=2048 * MIB) == 1476 * MIB
    assert prompt_cache_bound(model, settings, Available(1000 * MIB, "x"), promised=2048 * MIB) == 0
    assert "and the other models' prompt caches (2048 MiB)" in caplog.text


def test_prompt_cache_bounds_of_open_contexts_add_up(model: ffi.Model) -> None:
    # The second context's cache is bounded by what is left less the first one's bound, and a
    # closed context's bound is given back.
    left = available_memory()
    assert left is not None
    half = left.bytes // 2 // MIB + 1  # a first bound of about half of what is left
    first, first_bound = make_context(model, _settings("--cache-ram", str(half), "--ctx-size", "256"), ffi.Attention())
    try:
        second, second_bound = make_context(
            model, _settings("--ctx-size", "256", "--cache-ram", str(half)), ffi.Attention()
        )
        second.close()
        assert first_bound > 0 and first_bound + second_bound < available_memory().bytes  # type: ignore[union-attr]
        assert second_bound < first_bound
    finally:
        first.close()
    third, third_bound = make_context(model, _settings("--ctx-size", "256", "--cache-ram", "1"), ffi.Attention())
    third.close()
    assert third_bound == MIB


@pytest.mark.server
def test_a_server_whose_cache_cannot_fit_says_so_and_exits() -> None:
    available = available_memory()
    assert available is not None
    # The default model's cache takes 23040 bytes a cell (f16); ask for twice what is left.
    cells = (2 * available.bytes // 23040 + 255) // 256 * 256
    with ServerProcess(["--parallel", "1", "--ctx-size", str(cells), "--threads", "1"]) as proc:
        assert proc.wait(GUARD) == 1
    assert "the KV cache of SmolLM2-135M-Instruct.Q4_1.gguf needs" in proc.log, proc.log
    assert "lower the context size (--ctx-size, or ctx_size in a preset)" in proc.log
    assert "Traceback" not in proc.log and "insufficient memory" not in proc.log
