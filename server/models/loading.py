"""Loading one model for serving, blocking (call it in a worker thread): the model with its
offload settings, a pass over its vocabulary, where its layers went, and the engine's context.

``EarlyLoads`` begins that for the models loaded at start, each in a thread of its own, as the
process starts: before the server's modules (Quart, Hypercorn, trio, pydantic: about 0.3 s of
Python on a small machine) are imported, so the two overlap; llama.cpp's load runs without the
GIL. The model's runtime takes the result over (``ModelRuntime``). This module imports only the
binding, the settings, the model specs and ``memory`` (the KV cache's fit): nothing here may
pull in the server's framework.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import ffi
from server.models.memory import make_context
from server.models.specs import ModelSpec, model_specs
from server.offload import DeviceUse, attention, describe, device_uses, load_model
from server.settings import Settings

logger = logging.getLogger("llama_trio.models")


@dataclass
class Loaded:
    """A model ready for its engine: ``close()`` (idempotent) frees the context and the model."""

    model: ffi.Model
    context: ffi.Context
    devices: tuple[DeviceUse, ...]
    cache_bytes: int  # the bound of its prompt cache in host RAM (``memory.prompt_cache_bound``)
    settings: Settings  # the model's, with a context size of 0 (the model's own) made a number

    def close(self) -> None:
        self.context.close()
        self.model.close()


def load(spec: ModelSpec, progress: ffi.ProgressReporter) -> Loaded:
    """Load ``spec``'s model and make its engine's context (blocking). Raises
    ``ffi.ModelLoadError`` (also when ``progress`` was aborted), ``ffi.BackendError`` or
    ``ffi.ContextError``."""
    s = spec.settings
    model = load_model(s, spec.path, progress)
    try:
        if progress.aborted:
            raise ffi.ModelLoadError(f"loading {spec.path} was aborted")
        if s.ctx_size == 0:  # the model's own context length, shared by the sequences (llama-server's -c 0)
            s = dataclasses.replace(s, ctx_size=max(model.n_ctx_train, s.parallel))
        # The engine's context (``EngineConfig.context_options``, which the engine checks), for
        # the config ``ModelRuntime`` makes from the same settings; refused when its KV cache
        # would not fit in the memory left.
        context, cache_bytes = make_context(model, s, attention(s))
        # The Python work last, so that the C work above overlaps the start's imports: one pass
        # over the vocabulary each, here rather than on the event loop at the first request
        # that needs them.
        model.vocab.control_pattern  # noqa: B018
        model.vocab.eog_tokens  # noqa: B018
        devices = device_uses(model)
        logger.info("%s", describe(model, devices))
    except BaseException:
        model.close()
        raise
    return Loaded(model, context, devices, cache_bytes, s)


class EarlyLoad:
    """``load(spec)`` begun now in a thread of its own. ``take()`` (blocking) waits for it and
    hands the result over, or raises its error; ``progress`` reports it and aborts it."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.progress = ffi.ProgressReporter(spec.id, logger)
        self.started = time.monotonic()
        self._result: Loaded | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"load {spec.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = load(self.spec, self.progress)
        except BaseException as exc:  # handed to take()
            self._error = exc

    def take(self) -> Loaded:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        result, self._result = self._result, None
        if result is None:
            raise ffi.ModelLoadError(f"the early load of {self.spec.path} was already taken")
        return result

    def close(self) -> None:
        """Abort the load, wait for its thread, and free what was not taken (idempotent)."""
        self.progress.abort()
        self._thread.join()
        if self._result is not None:
            self._result.close()
            self._result = None


class EarlyLoads:
    """The models loaded at start, their loads begun (``begin``); ``pop`` hands one to its
    runtime, ``close()`` (idempotent) aborts and frees the ones never taken. ``specs``: every
    model's spec, read once for the loads and the registry alike."""

    def __init__(self, specs: list[ModelSpec], loads: list[EarlyLoad]) -> None:
        self.specs = specs
        self._loads = {load.spec.id: load for load in loads}

    @classmethod
    def begin(cls, settings: Settings) -> EarlyLoads:
        """Raises ``ModelSpecError`` or ``DefaultModelMissing`` as ``model_specs`` does."""
        specs = model_specs(settings)
        loads: list[EarlyLoad] = []
        try:
            for spec in specs:
                if spec.load_on_start:
                    loads.append(EarlyLoad(spec))
        except BaseException:  # a thread that cannot start: stop the ones that did
            cls(specs, loads).close()
            raise
        return cls(specs, loads)

    def pop(self, spec: ModelSpec) -> EarlyLoad | None:
        """The early load of ``spec`` (one of ``specs``), once; None when there is none."""
        return self._loads.pop(spec.id, None)

    def close(self) -> None:
        loads, self._loads = list(self._loads.values()), {}
        for early in loads:
            early.progress.abort()
        for early in loads:
            early.close()
