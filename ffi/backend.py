"""ggml's compute devices: the ones llama.cpp found, RPC servers added to them, and where a
model's layers went.

Devices are process-wide in llama.cpp (its backend registry): what ``add_rpc_server`` registers
stays for the life of the process, and every model loaded afterwards may use it.
"""

from __future__ import annotations

import collections
import re
import socket
from dataclasses import dataclass

from ffi._lib import ffi, lib
from ffi.errors import LlamaError

_KINDS = {
    lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
}
# Kinds that hold layers (llama.cpp offloads to GPUs, integrated GPUs and RPC servers, which
# report themselves as GPUs).
_OFFLOAD_KINDS = frozenset({"gpu", "igpu"})
# How long reaching an RPC server may take before we say it cannot be reached.
RPC_CONNECT_TIMEOUT = 5.0
# llama.cpp's RPC client speaks IPv4 only (a name resolved with gethostbyname, or an address).
_ENDPOINT = re.compile(r"^(?P<host>[^\s:/]+):(?P<port>\d{1,5})$")
# llama.cpp's load log (debug level), one line per layer, the output layer last: where it went.
_LAYER_LINE = re.compile(r"\blayer\s+(\d+) assigned to device (\S+?),")


class BackendError(LlamaError):
    """A device cannot be used (an RPC server cannot be reached, the build lacks a backend)."""


@dataclass(frozen=True)
class Device:
    """One compute device, as ggml reports it."""

    name: str  # "CPU", "CUDA0", "RPC0", ...
    description: str  # the CPU or GPU model; an RPC device's endpoint
    kind: str  # "cpu", "gpu", "igpu", "accel" (an RPC server is a "gpu")
    memory_total: int  # bytes
    memory_free: int  # bytes, when asked


def _device(dev: object) -> Device:
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    lib.ggml_backend_dev_memory(dev, free, total)
    return Device(
        name=ffi.string(lib.ggml_backend_dev_name(dev)).decode("utf-8", "replace"),
        description=ffi.string(lib.ggml_backend_dev_description(dev)).decode("utf-8", "replace"),
        kind=_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
        memory_total=int(total[0]),
        memory_free=int(free[0]),
    )


def devices() -> list[Device]:
    """Every device llama.cpp can compute on now, in its registry's order (RPC devices ask
    their server for their memory: a round trip each)."""
    return [_device(lib.ggml_backend_dev_get(i)) for i in range(lib.ggml_backend_dev_count())]


def has_offload_device() -> bool:
    """Whether any device can hold layers: a GPU (or integrated GPU) backend in this build that
    found a device, or an RPC server added with ``add_rpc_server``."""
    for i in range(lib.ggml_backend_dev_count()):
        if _KINDS.get(lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i))) in _OFFLOAD_KINDS:
            return True
    return False


def supports_rpc() -> bool:
    """Whether this llama.cpp build has the RPC backend (``-DGGML_RPC=ON``)."""
    return bool(lib.llama_supports_rpc())


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (a name or an IPv4 address: llama.cpp's RPC client knows no IPv6) as a
    pair; ``ValueError`` when malformed."""
    match = _ENDPOINT.match(endpoint.strip())
    if match is None:
        raise ValueError(f"not host:port: {endpoint!r}")
    port = int(match.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {endpoint!r}")
    return match.group("host"), port


def add_rpc_server(endpoint: str, timeout: float = RPC_CONNECT_TIMEOUT) -> list[Device]:
    """Register the devices of llama.cpp's ``rpc-server`` at ``endpoint`` (``host:port``); the
    devices it added. Adding the same endpoint again adds nothing and returns the same devices.

    Blocking (network round trips): call it from a worker thread in async code. Raises
    ``BackendError`` when the build has no RPC backend or the server cannot be reached within
    ``timeout`` (llama.cpp itself would abort the process), ``ValueError`` for a malformed
    endpoint. A server lost later aborts the process: that is llama.cpp's RPC backend.
    """
    host, port = parse_endpoint(endpoint)
    if not supports_rpc():
        raise BackendError(f"--rpc {endpoint}: this llama.cpp build has no RPC backend (build it with -DGGML_RPC=ON)")
    try:  # as llama.cpp will connect: IPv4, the name's first address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(timeout)
            probe.connect((socket.gethostbyname(host), port))
    except OSError as exc:
        raise BackendError(f"RPC server {endpoint} cannot be reached: {exc}") from None
    reg = lib.llama_trio_rpc_add_server(f"{host}:{port}".encode())
    if reg == ffi.NULL:
        raise BackendError(f"RPC server {endpoint} offers no device")
    return [_device(lib.ggml_backend_reg_dev_get(reg, i)) for i in range(lib.ggml_backend_reg_dev_count(reg))]


@dataclass(frozen=True)
class Placement:
    """Where a model's layers went: layers per device name, counted as llama.cpp counts them
    (the repeating layers and the output layer; the input embeddings stay on the CPU)."""

    layers: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.layers.values())

    @property
    def offloaded(self) -> int:
        """Layers on devices other than the CPU."""
        return sum(n for name, n in self.layers.items() if name != "CPU")

    @classmethod
    def from_log(cls, lines: list[str]) -> Placement:
        """From llama.cpp's load log: its debug line for each layer's device."""
        where: dict[int, str] = {}
        for line in lines:
            match = _LAYER_LINE.search(line)
            if match:
                where[int(match.group(1))] = match.group(2)
        return cls(dict(collections.Counter(where[i] for i in sorted(where))))
