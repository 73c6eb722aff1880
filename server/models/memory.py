"""How much memory a model's load may still take, and the check that a context's KV cache fits.

llama.cpp allocates a context's KV cache on the CPU with one ``malloc`` and clears it, which
touches every page: a cache larger than the memory left gets the process killed by the kernel's
OOM killer (or, in a container, the cgroup's) with no word of why, and a Kubernetes pod restarts
into the same death. So before a context is made, the cache it will need is compared with what
is left: the host's ``MemAvailable`` and free swap, and the memory limit of every cgroup (v1 or
v2) above this process less what that cgroup uses (its inactive file pages count as free: the
kernel reclaims them first, as the kubelet's working set does).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

import ffi
from server.settings import Settings

logger = logging.getLogger("llama_trio.models")

_MIB = 1024 * 1024
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
WARN_SHARE = 0.8  # a cache that takes more than this share of what is left is logged


@dataclass(frozen=True)
class Available:
    """Bytes this process may still take, and what sets that bound (for the operator)."""

    bytes: int
    source: str


def available_memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Available | None:
    """The memory left to this process: the least of the host's and each enclosing cgroup's.
    None where the host's cannot be read (not Linux)."""
    host = _host_available(proc)
    if host is None:
        return None
    best = host
    for room in _cgroup_rooms(proc, cgroup_root, swap_free=_meminfo(proc).get("SwapFree", 0)):
        if room.bytes < best.bytes:
            best = room
    return best


def _meminfo(proc: str) -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[name] = int(fields[0]) * 1024  # kB
    except OSError:
        pass
    return values


def _host_available(proc: str) -> Available | None:
    info = _meminfo(proc)
    if "MemAvailable" not in info:
        return None
    swap = info.get("SwapFree", 0)
    source = "the host's available memory" + (" and free swap" if swap else "")
    return Available(info["MemAvailable"] + swap, source)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _stat(path: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if value.isdigit():
            values[name] = int(value)
    return values


def _cgroup_rooms(proc: str, root: str, swap_free: int) -> list[Available]:
    """The room left under each memory limit of the cgroups this process is in."""
    rooms: list[Available] = []
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path and os.path.exists(os.path.join(root, "cgroup.controllers")):
            rooms.extend(_v2_rooms(root, path, swap_free))
        elif "memory" in controllers.split(","):
            room = _v1_room(os.path.join(root, "memory"), path)
            if room is not None:
                rooms.append(room)
    return rooms


def _own_dir(base: str, path: str) -> str:
    """This process's cgroup directory under the mount ``base``: the mount itself where the
    path is not there (a container with its own cgroup namespace sees its cgroup as /)."""
    candidate = os.path.normpath(os.path.join(base, path.lstrip("/")))
    inside = candidate == base or candidate.startswith(base.rstrip("/") + "/")
    return candidate if inside and os.path.isdir(candidate) else base


def _v2_rooms(root: str, path: str, swap_free: int) -> list[Available]:
    rooms: list[Available] = []
    directory = _own_dir(root, path)
    while True:
        limit = _int(_read(os.path.join(directory, "memory.max")))
        current = _int(_read(os.path.join(directory, "memory.current")))
        if limit is not None and current is not None:
            free = limit - current + _stat(os.path.join(directory, "memory.stat")).get("inactive_file", 0)
            swap_limit = _read(os.path.join(directory, "memory.swap.max"))
            swap_used = _int(_read(os.path.join(directory, "memory.swap.current"))) or 0
            swap = swap_free if swap_limit == "max" else max(0, min(swap_free, (_int(swap_limit) or 0) - swap_used))
            name = "/" + os.path.relpath(directory, root) if directory != root else "/"
            rooms.append(Available(max(0, free) + swap, f"the memory limit of cgroup {name}"))
        if os.path.normpath(directory) == os.path.normpath(root):
            return rooms
        directory = os.path.dirname(directory)


def _v1_room(base: str, path: str) -> Available | None:
    directory = _own_dir(base, path)
    stat = _stat(os.path.join(directory, "memory.stat"))
    limit = stat.get("hierarchical_memory_limit") or _int(_read(os.path.join(directory, "memory.limit_in_bytes")))
    usage = _int(_read(os.path.join(directory, "memory.usage_in_bytes")))
    if limit is None or usage is None or limit >= _NO_LIMIT:
        return None
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return Available(max(0, limit - usage + inactive), "the cgroup's memory limit")


# One context made at a time: each check sees what the contexts made before it took.
_CONTEXTS = threading.Lock()
# The prompt-cache bounds given to the contexts still open (under ``_CONTEXTS``): what each
# model's saved prefixes may still grow into, which the memory left does not show yet.
# Weak: the ledger owns no context (its runtime does).
_PROMISED: list[tuple[weakref.ref[ffi.Context], int]] = []


def _promised() -> int:
    _PROMISED[:] = [(ref, bound) for ref, bound in _PROMISED if (c := ref()) is not None and not c.closed]
    return sum(bound for _, bound in _PROMISED)


def make_context(model: ffi.Model, settings: Settings, attention: ffi.Attention) -> tuple[ffi.Context, int]:
    """The engine's context for ``model``, once its KV cache is known to fit in the memory left,
    and the bound in bytes of its prompt cache in host RAM (``prompt_cache_bound``) (blocking).
    Raises ``ffi.ContextError`` when the cache does not fit, or when llama.cpp fails."""
    with _CONTEXTS:
        check_kv_fits(model, settings.ctx_size, settings.parallel, attention, available_memory())
        context = ffi.Context(
            model,
            n_ctx=settings.ctx_size,
            n_batch=settings.batch_size,
            n_seq_max=settings.parallel,
            n_threads=settings.threads,
            kv_unified=False,
            attention=attention,
        )
        try:
            bound = prompt_cache_bound(model, settings, available_memory(), _promised())
        except BaseException:
            context.close()
            raise
        _PROMISED.append((weakref.ref(context), bound))
        return context, bound


def prompt_cache_bound(model: ffi.Model, settings: Settings, left: Available | None, promised: int = 0) -> int:
    """``--cache-ram`` in bytes, but at most half of the memory ``left`` once the context is made,
    less what the other open models' prompt caches were ``promised``: the saved prefixes grow
    into their bounds as conversations come, long after the load, and bounds that add up to
    more than the memory there is would end in the OOM killer. Logged when lowered."""
    asked = settings.cache_ram * _MIB
    if left is None:
        return asked
    room = max(0, left.bytes - promised)
    if asked <= room // 2:
        return asked
    bound = room // 2
    others = f" and the other models' prompt caches ({promised // _MIB} MiB)" if promised else ""
    logger.warning(
        "%s: --cache-ram %d MiB is more than half of the %d MiB that %s%s leave: its prompt cache keeps at most %d MiB",
        os.path.basename(model.path),
        settings.cache_ram,
        room // _MIB,
        left.source,
        others,
        bound // _MIB,
    )
    return bound


def check_kv_fits(
    model: ffi.Model,
    n_ctx: int,
    n_seq_max: int,
    attention: ffi.Attention,
    available: Available | None,
    purpose: str = "",
    *,
    unified: bool = False,
) -> None:
    """Raise ``ffi.ContextError`` when the part of a context's KV cache (``n_ctx`` cells for
    ``n_seq_max`` sequences) that llama.cpp will put in this machine's memory is larger than
    ``available``; log a warning when it takes most of it. ``purpose``: which context, when
    not the engine's (its settings are named in the error)."""
    layers = model.n_layer
    placement = model.placement
    if attention.offload_kv and placement.offloaded:
        # Layers on a GPU or an RPC server keep their cache there; the CPU's count may include
        # the output layer, so one fewer is the least that stays here.
        layers = max(0, placement.layers.get("CPU", 0) - 1)
    need = ffi.kv_cache_bytes(model, n_ctx, n_seq_max, attention, layers, unified=unified)
    if need is None or need == 0 or available is None:
        return
    what = f"the KV cache of {os.path.basename(model.path)}" + (f" for {purpose}" if purpose else "")
    cells = ffi.padded_cells(n_ctx, n_seq_max, unified=unified)
    shape = f"{cells} cells x {layers} layers, K {attention.type_k} / V {attention.type_v}"
    if need > available.bytes:
        lower = "--batch-size or --parallel" if purpose else "the context size (--ctx-size, or ctx_size in a preset)"
        raise ffi.ContextError(
            f"{what} needs {need // _MIB} MiB ({shape}) but {available.source} leaves "
            f"{available.bytes // _MIB} MiB: lower {lower}, or quantize the cache "
            "(--cache-type-k q8_0 --cache-type-v q8_0)"
        )
    if need > WARN_SHARE * available.bytes:
        logger.warning(
            "%s takes %d MiB (%s) of the %d MiB that %s leaves",
            what,
            need // _MIB,
            shape,
            available.bytes // _MIB,
            available.source,
        )
