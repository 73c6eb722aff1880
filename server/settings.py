"""Settings: every flag of the command line, each also read from ``LLAMA_TRIO_<FLAG>``.

Precedence: command-line flag, then environment variable, then default. ``settings_from_env``
gives the same settings without a command line (the ``hypercorn ... 'server.api.app:create_app()'``
launch).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from server.settings_checks import settings_error

ENV_PREFIX = "LLAMA_TRIO_"
# llama.cpp's KV cache types, as llama-server names them (ffi.context.CACHE_TYPES; not imported
# here so that --help loads no llama.cpp).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


@dataclass(frozen=True)
class Settings:
    model: tuple[str, ...] = ()  # PATH, or ID=PATH (repeatable); none: the embedded default model
    models_dir: str | None = None
    models_preset: str | None = None
    models_max: int | None = None  # models loaded at once; None: no bound
    models_max_mb: int | None = None  # MiB of model files loaded at once; None: no bound
    models_load_timeout: float = 300.0
    sleep_idle_seconds: float | None = None  # None: never unload an idle model
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4
    ctx_size: int = 8192
    batch_size: int = 512
    threads: int = field(default_factory=_default_threads)
    n_gpu_layers: str = "auto"  # "auto", "all" or a number
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    flash_attn: str = "auto"
    no_kv_offload: bool = False
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    rpc: tuple[str, ...] = ()  # host:port of llama.cpp's rpc-server processes
    alias: str | None = None
    tags: str | None = None
    chat_template_file: str | None = None  # None: the model's own template
    embeddings: bool = False
    pooling: str | None = None  # None: the model's own, or mean
    api_key: tuple[str, ...] = ()
    api_key_file: str | None = None
    admin_key: tuple[str, ...] = ()  # keys that may also load and unload models
    max_queue: int = 64
    cache_ram: int = 2048  # MiB
    no_fast_forward: bool = False
    responses_db: str | None = None  # None: stored responses in memory
    responses_max_mb: float = 64.0
    max_tokens: int | None = None  # ceiling on any request's max_tokens
    drain_timeout: float = 30.0
    max_body: int = 4 * 1024 * 1024
    keep_alive_timeout: float = 5.0
    read_timeout: float = 60.0
    write_timeout: float = 30.0
    ping_interval: float = 15.0
    max_header_size: int = 16 * 1024
    max_connections: int = 512
    cors_origin: tuple[str, ...] = ()
    reuse_port: bool = False
    no_webui: bool = False
    fd: int | None = None  # None: open our own listener (or take systemd's)
    restart_timeout: float = 120.0
    verbose: bool = False
    temp: float | None = None  # None: each API's own default
    seed: int | None = None  # None: a fresh seed per request
    no_slots: bool = False
    slot_save_path: str | None = None
    chat_template: str | None = None  # a template's text or a llama.cpp built-in's name

    def api_keys(self) -> frozenset[str]:
        """Every key a request may give: --api-key's, the file's and --admin-key's."""
        return frozenset(self.api_key) | frozenset(self.admin_key) | self.file_keys()

    def file_keys(self) -> frozenset[str]:
        """The keys of --api-key-file: one a line, blank lines and # comments left out."""
        if not self.api_key_file:
            return frozenset()
        lines = pathlib.Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
        return frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))


_HELP = {
    "model": (
        "GGUF model file (default: the embedded SmolLM2-135M-Instruct); repeat as ID=PATH to serve several, "
        "picked per request by `model`"
    ),
    "models_dir": "serve every *.gguf in this folder (id: the file name without .gguf; split GGUFs once)",
    "models_preset": (
        "TOML or INI file with a [model-id] section per model: model = PATH, aliases, tags, load_on_start, and "
        "ctx_size, parallel, batch_size, threads, chat_template_file, embeddings, pooling, max_queue for it"
    ),
    "models_max": "models loaded at once; loading one more unloads the least recently used idle one",
    "models_max_mb": "MiB of model files loaded at once (as --models-max)",
    "models_load_timeout": "seconds a request waits for its model to load (or for room to load it) before 503",
    "sleep_idle_seconds": "unload a model that no request has used for this long (loaded again on demand)",
    "host": "address to listen on (:: for IPv6 and IPv4)",
    "port": "TCP port",
    "parallel": "sequences decoded together (concurrent requests)",
    "ctx_size": "KV cache cells in all; each sequence gets ctx-size / parallel (0: the model's own context length)",
    "batch_size": "tokens per decode step (prompt chunks plus one per running sequence)",
    "threads": (
        "CPU threads for llama.cpp; leave a core free when other work shares the machine "
        "(threads that wait on each other stall when one is preempted)"
    ),
    "n_gpu_layers": (
        "layers on the GPUs or RPC servers: a number, all, or auto (all when the build has a GPU backend "
        "that found a device, or --rpc is given; else none)"
    ),
    "split_mode": "how several GPUs share the model: none (--main-gpu only), layer or row",
    "main_gpu": "the GPU that holds the whole model with --split-mode none",
    "tensor_split": "proportion of the offloaded layers per GPU, in device order, e.g. 3,1",
    "flash_attn": "flash attention: on, off or auto (where the device supports it)",
    "no_kv_offload": "keep the KV cache in host memory even when the layers are offloaded",
    "cache_type_k": "KV cache type for K: " + ", ".join(CACHE_TYPES),
    "cache_type_v": "KV cache type for V (a quantized one needs flash attention): " + ", ".join(CACHE_TYPES),
    "rpc": "llama.cpp rpc-server processes to offload layers to, host:port[,host:port...]",
    "alias": (
        "model id reported by the API (default: the model file's name); a comma-separated list makes them all "
        "names of the model, the first in alphabetical order its id (as llama-server)"
    ),
    "tags": "comma-separated labels listed with the model in /v1/models (as llama-server's --tags)",
    "chat_template_file": "Jinja chat template to use instead of the model's own (e.g. one that knows tools)",
    "embeddings": "serve /v1/embeddings (a second llama.cpp context on the same model)",
    "pooling": "how embeddings pool their tokens: mean, cls or last (default: the model's own, else mean)",
    "api_key": "accepted API key (repeatable; env: comma-separated)",
    "api_key_file": "file with one API key per line",
    "admin_key": (
        "API key that may also load and unload models (POST /models/load, /models/unload); once one is given, "
        "no other key may (repeatable; env: comma-separated)"
    ),
    "max_queue": "requests waiting for a free sequence or a grammar compile before 503",
    "cache_ram": (
        "MiB of host RAM for prompt prefixes evicted from the sequences, restored when a prompt extends one (0: off; "
        "the process's, in equal shares for as many models as may be loaded at once; each at most half of the "
        "memory left once its KV cache is made, less the other loaded models' shares)"
    ),
    "no_fast_forward": (
        "sample every token a grammar forces one decode step at a time, instead of decoding the forced run at once"
    ),
    "responses_db": (
        "SQLite file for stored responses (/v1/responses), kept across restarts and shared with a hot "
        "restart's new process (default: in memory)"
    ),
    "responses_max_mb": "MiB of stored responses kept per tenant (API key; its oldest out)",
    "max_tokens": "ceiling on any request's max_tokens (also the default when a request sets none)",
    "drain_timeout": "seconds in-flight requests may run after SIGTERM",
    "max_body": "largest request body in bytes (413 above)",
    "keep_alive_timeout": "seconds a connection may stay idle, or take to send a request head, before it is closed",
    "read_timeout": "seconds a request body may take to arrive (408 after)",
    "write_timeout": "seconds a client may stop reading before its connection is cut",
    "ping_interval": "seconds of silence in a stream (queued, or a long prompt) before a ': ping' comment is sent",
    "max_header_size": "largest request head in bytes (431 above)",
    "max_connections": (
        "open connections at once; past it a new client replaces the longest idle (or slowest body) or waits"
    ),
    "cors_origin": "allowed CORS origin (repeatable; * for any; localhost for any on this machine)",
    "reuse_port": "also set SO_REUSEPORT (lets other processes share the port)",
    "no_webui": "do not serve the chat page at / (the API is unchanged)",
    "fd": (
        "serve the listening TCP socket at this inherited descriptor instead of opening one "
        "(--host and --port are then unused; systemd socket activation needs no flag)"
    ),
    "restart_timeout": "seconds a hot restart (SIGHUP) waits for the new process to be ready before giving up on it",
    "verbose": "debug logging, including llama.cpp's own log",
    "temp": "temperature of requests that set none (default: 1.0 on the OpenAI routes, 0.8 on llama.cpp's native ones)",
    "seed": "sampling seed of requests that set none (default: a fresh one each)",
    "no_slots": "do not serve GET /slots (llama.cpp's view of the sequences)",
    "chat_template": (
        "chat template to use instead of the model's own: Jinja text, or the name of one llama.cpp knows "
        "(chatml, llama3, command-r, ...)"
    ),
    "slot_save_path": "folder where POST /slots/ID saves and restores sequences (default: saving and restoring off)",
}


# llama-server's other names for our flags.
_ALIASES = {
    "n_gpu_layers": ("-ngl", "--gpu-layers"),
    "split_mode": ("-sm",),
    "main_gpu": ("-mg",),
    "tensor_split": ("-ts",),
    "flash_attn": ("-fa",),
    "no_kv_offload": ("-nkvo",),
    "cache_type_k": ("-ctk",),
    "cache_type_v": ("-ctv",),
}


def _gpu_layers(raw: str) -> str:
    value = raw.strip().lower()
    if value in {"auto", "all"}:
        return value
    if not value.isdigit():
        raise ValueError(f"{raw!r} is not a number of layers, all or auto")
    return str(int(value))


def _one_of(*choices: str) -> Callable[[str], str]:
    def convert(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"{raw!r} is not one of {', '.join(choices)}")
        return value

    return convert


def _proportions(raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in re.split(r"[,/]", raw) if part.strip())
    except ValueError:
        raise ValueError(f"{raw!r} is not a list of numbers like 3,1") from None
    if not values or any(not v >= 0 for v in values) or not sum(values) > 0:
        raise ValueError(f"{raw!r}: proportions must be numbers >= 0, not all 0")
    return values


_ENDPOINT = re.compile(r"^[^\s:/,]+:\d{1,5}$")


def _endpoints(raw: str) -> tuple[str, ...]:
    servers = tuple(part.strip() for part in raw.split(",") if part.strip())
    for server in servers:
        if not _ENDPOINT.match(server) or not 0 < int(server.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"{server!r} is not host:port (IPv4 or a name)")
    if not servers:
        raise ValueError("no host:port given")
    return servers


# Flags whose values are parsed (and checked) by a function of their text.
_CONVERT: dict[str, Callable[[str], object]] = {
    "n_gpu_layers": _gpu_layers,
    "split_mode": _one_of("none", "layer", "row"),
    "tensor_split": _proportions,
    "flash_attn": _one_of("on", "off", "auto"),
    "cache_type_k": _one_of(*CACHE_TYPES),
    "cache_type_v": _one_of(*CACHE_TYPES),
    "rpc": _endpoints,
}


def read_bool(raw: str) -> bool:
    """A yes or no as a variable or a preset writes it; ``ValueError`` for another word."""
    word = raw.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError(f"{raw!r} is not 1/0, true/false, yes/no or on/off")
    return word in _TRUE


def _env_value(name: str, kind: type, env: Mapping[str, str]) -> object | None:
    raw = env.get(ENV_PREFIX + name.upper())
    if raw is None or raw == "":
        return None
    if name in _CONVERT:
        return _CONVERT[name](raw)
    if kind is bool:
        return read_bool(raw)
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return kind(raw)


def _kind(name: str) -> type:
    defaults = Settings()
    value = getattr(defaults, name)
    if name == "model":
        return tuple
    if name in {
        "alias",
        "tags",
        "api_key_file",
        "chat_template_file",
        "chat_template",
        "pooling",
        "models_dir",
        "models_preset",
        "responses_db",
        "slot_save_path",
    }:
        return str
    if name in {"max_tokens", "fd", "models_max", "models_max_mb", "seed"}:
        return int
    if name in {"sleep_idle_seconds", "temp"}:
        return float
    return type(value)


def package_version() -> str:
    """The installed distribution's version (editable installs have one too)."""
    import importlib.metadata  # ~17 ms: only for --version and the places that show it

    try:
        return importlib.metadata.version("llama-trio")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``: argparse's, except that the version is read only when it is asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def _argument_type(convert: Callable[[str], object]) -> Callable[[str], object]:
    def argument(raw: str) -> object:
        try:
            return convert(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-trio",
        description="OpenAI-compatible LLM server on llama.cpp. Every flag is also read from "
        f"{ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT).",
    )
    parser.add_argument("--version", action=_Version)
    for f in fields(Settings):
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
        kind = _kind(f.name)
        if f.name in _CONVERT:
            parser.add_argument(*flags, type=_argument_type(_CONVERT[f.name]), default=None, help=_HELP[f.name])
        elif kind is bool:
            parser.add_argument(*flags, action="store_true", default=None, help=_HELP[f.name])
        elif kind is tuple:
            parser.add_argument(*flags, action="append", default=None, help=_HELP[f.name])
        else:
            parser.add_argument(*flags, type=kind, default=None, help=_HELP[f.name])
    return parser


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from a command line and the environment."""
    env = os.environ if env is None else env
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, object] = {}
    for f in fields(Settings):
        value = args.get(f.name)
        if isinstance(value, list):
            value = tuple(value)
        if value is None:
            try:
                value = _env_value(f.name, _kind(f.name), env)
            except ValueError as exc:
                parser.error(f"{ENV_PREFIX}{f.name.upper()}: {exc}")
        if value is not None:
            values[f.name] = value
    settings = Settings(**values)  # type: ignore[arg-type]
    wrong = model_settings_error(settings)
    if wrong is not None:
        parser.error(f"--{wrong[0].replace('_', '-')} {wrong[1]}")
    problem = settings_error(settings)
    if problem is not None:
        parser.error(problem)
    return settings


# llama.cpp's bound on the sequences of one context (LLAMA_MAX_SEQ; the binding's
# llama_max_parallel_sequences, which a test compares).
MAX_PARALLEL = 256
# ggml's bound on a computation's threads (GGML_MAX_N_THREADS); past it OpenMP's thread
# creation fails and the process ends at the model's first step.
MAX_THREADS = 512
# llama.cpp reads a batch's size as an int32.
MAX_BATCH = 2**31 - 1


def model_settings_error(s: Settings) -> tuple[str, str] | None:
    """The first of the settings a model is loaded with (the command line's, or a preset's over
    them) that cannot be, as (name, what it must be); None when all can."""
    if not 1 <= s.parallel <= MAX_PARALLEL:
        return "parallel", f"must be between 1 and {MAX_PARALLEL}"
    if s.ctx_size < 0 or 0 < s.ctx_size < s.parallel:
        return "ctx_size", f"must be 0 (the model's own) or at least parallel ({s.parallel}): a cell per sequence"
    if not 1 <= s.batch_size <= MAX_BATCH:
        return "batch_size", f"must be between 1 and {MAX_BATCH}"
    if not 1 <= s.threads <= MAX_THREADS:
        return "threads", f"must be between 1 and {MAX_THREADS} (llama.cpp's most)"
    if s.max_queue < 1:
        return "max_queue", "must be at least 1 (a request waits in the queue before its first step)"
    if s.pooling not in {None, "mean", "cls", "last"}:
        return "pooling", "must be mean, cls or last"
    return None


def settings_from_env(env: Mapping[str, str] | None = None) -> Settings:
    return parse_settings([], env)
