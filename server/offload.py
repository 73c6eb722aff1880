"""Where the model runs: the offload settings as the binding's model and context options, the
RPC servers registered, and the devices with the layers each holds, logged and reported.

``load_model`` blocks (RPC round trips, the model's load): call it in a worker thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ffi
from server.settings import Settings

logger = logging.getLogger("llama_trio.offload")

_MIB = 1024 * 1024


@dataclass(frozen=True)
class DeviceUse:
    """One device llama.cpp found, and how many of the model's layers it holds."""

    name: str
    description: str
    type: str  # "cpu", "gpu", "igpu", "accel" (an RPC server is a "gpu")
    memory_mib: int  # total, as the device reports it
    layers: int


def gpu_layers(setting: str, has_offload_device: bool) -> int:
    """``--n-gpu-layers`` as llama.cpp's ``n_gpu_layers`` (-1: all). ``auto``: all where there
    is a device to offload to, else none (llama-server's auto also fits the layers to the
    devices' free memory; ours does not)."""
    if setting == "all" or (setting == "auto" and has_offload_device):
        return -1
    if setting == "auto":
        return 0
    return int(setting)


def attention(settings: Settings) -> ffi.Attention:
    return ffi.Attention(
        flash_attn=settings.flash_attn,
        type_k=settings.cache_type_k,
        type_v=settings.cache_type_v,
        offload_kv=not settings.no_kv_offload,
    )


def load_model(settings: Settings, path: str, progress: ffi.ProgressReporter) -> ffi.Model:
    """Register ``--rpc``'s servers, load the model with the offload settings, and log where
    its layers went. Raises ``ffi.BackendError`` (an RPC server cannot be used) or
    ``ffi.ModelLoadError``."""
    for endpoint in settings.rpc:
        added = ffi.backend.add_rpc_server(endpoint)
        logger.info("RPC server %s: %s", endpoint, ", ".join(f"{d.name} ({d.memory_total // _MIB} MiB)" for d in added))
    has_device = ffi.backend.has_offload_device()
    n_gpu_layers = gpu_layers(settings.n_gpu_layers, has_device)
    if not has_device and n_gpu_layers != 0:
        logger.warning(
            "--n-gpu-layers %s: llama.cpp found no GPU (this build has no GPU backend, or it found no device) "
            "and no --rpc server is given; every layer runs on the CPU",
            settings.n_gpu_layers,
        )
    return ffi.Model(
        path,
        n_gpu_layers=n_gpu_layers,
        split_mode=settings.split_mode,
        main_gpu=settings.main_gpu,
        tensor_split=settings.tensor_split,
        progress=progress,
    )


def device_uses(model: ffi.Model) -> tuple[DeviceUse, ...]:
    """Every device llama.cpp found, with the layers of ``model`` it holds (blocking: an RPC
    device's memory is a round trip)."""
    layers = model.placement.layers
    return tuple(
        DeviceUse(d.name, d.description, d.kind, d.memory_total // _MIB, layers.get(d.name, 0))
        for d in ffi.backend.devices()
    )


def describe(model: ffi.Model, uses: tuple[DeviceUse, ...]) -> str:
    """One log line: the devices and the layers on each."""
    placement = model.placement
    parts = [f"{u.name} ({u.description}, {u.memory_mib} MiB): {u.layers} layers" for u in uses]
    return (
        f"{os.path.basename(model.path)}: {placement.offloaded}/{placement.total} layers offloaded; "
        f"devices: {'; '.join(parts)}"
    )
