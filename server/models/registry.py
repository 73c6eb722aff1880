"""``ModelRegistry``: the models a server can serve, loaded on demand and unloaded when room is
needed or when idle, never from under a request.

A request holds its model with a ``Lease`` (``acquire``) from its preparation until its answer
ends (a stream's included): a model with a lease, or with jobs running or queued in its engine,
is busy, and a busy model is never unloaded. A request for a model that is not loaded starts
its load and waits, with every other request for it, bounded by ``--models-load-timeout``; when
the load needs room that busy models hold (``--models-max``, ``--models-max-mb``), it waits for
them, in a queue bounded by ``--max-queue``, and then gets ``ModelsBusy`` (a 503 with
``Retry-After``). ``--sleep-idle-seconds`` unloads a model idle that long. Each loaded model is
one ``ModelRuntime`` (its own engine, decode thread and prompt cache) in the registry's nursery.
At a shutdown's drain (``drain``) loads in progress are aborted and those waits end with
``server_shutting_down``; loaded models serve on for the requests that hold them.

Unloading drops the model's host prompt cache with it: the cache holds KV state that only that
model's context can use, and keeping it would keep the memory the unload is meant to free.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterator

import trio

from server.engine import Engine, EngineStats
from server.models.loading import EarlyLoads
from server.models.policy import Resident, idle_expired, make_room
from server.models.runtime import ModelInfo, ModelRuntime, read_template
from server.models.specs import ModelSpec, is_multi_model, model_specs
from server.settings import Settings

logger = logging.getLogger("llama_trio.models")

MIB = 1024 * 1024
IDLE_CHECK_SECONDS = 1.0  # how often idle models are looked for (with --sleep-idle-seconds)


class ModelNotFound(LookupError):
    """No model has that id or alias."""


class ModelUnavailable(Exception):
    """The model cannot serve now (its load failed, took too long, or cannot make room); a
    client may retry later."""

    def __init__(self, message: str, code: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.retry = retry  # False: asking again cannot help (the operator's settings must change)


class ModelBusy(Exception):
    """An unload asked for a model with requests in flight."""


class Lease:
    """One request's hold on a loaded model; ``release`` (idempotent) lets it go."""

    __slots__ = ("__weakref__", "_registry", "engine", "info", "runtime")

    def __init__(self, registry: ModelRegistry, runtime: ModelRuntime) -> None:
        assert runtime.engine is not None and runtime.info is not None
        self._registry: ModelRegistry | None = registry
        self.runtime = runtime
        self.engine: Engine = runtime.engine
        self.info: ModelInfo = runtime.info
        runtime.users += 1

    @property
    def spec(self) -> ModelSpec:
        return self.runtime.spec

    def release(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            self.runtime.users -= 1
            with contextlib.suppress(RuntimeError):  # outside trio (a finalizer): no timestamp
                self.runtime.last_used = trio.current_time()
            registry.changed()

    def release_with(self, owner: object) -> None:
        """Release when ``owner`` is garbage (a response whose body never ran), at the latest."""
        weakref.finalize(owner, self.release).atexit = False


class ModelRegistry:
    """``await nursery.start(registry.run)``; ``close()`` unloads everything and ends ``run``."""

    def __init__(self, settings: Settings, early: EarlyLoads | None = None) -> None:
        self.settings = settings
        # The start's early loads read the specs already: the same ones, not a second reading.
        self.specs = early.specs if early is not None else model_specs(settings)
        self._early = early  # loads begun as the process started, each taken by its first runtime
        self.single = not is_multi_model(settings)
        self.created = int(time.time())
        self._names = {name: spec for spec in self.specs for name in spec.names}
        # Read now: a template file that cannot be read stops the start (status 2), not a load.
        self._templates = {spec.id: _template_source(spec.settings) for spec in self.specs}
        self._runtimes: dict[str, ModelRuntime] = {}
        self._waiting: dict[str, int] = {spec.id: 0 for spec in self.specs}
        self._blocked = 0  # requests waiting for room
        self._changed = trio.Event()
        self._closed = trio.Event()
        self._draining = False  # the shutdown's drain: no loads, no new leases (``drain``)
        self._nursery: trio.Nursery | None = None
        self.retired = EngineStats()  # counters of engines since unloaded
        self.load_failed: BaseException | None = None  # a model loaded at start failed
        self.started = trio.Event()  # every model loaded at start is loaded, or one failed

    # -- reading ----------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelSpec:
        """The model a request names: by id or alias; a single model answers any name; no name
        is the first model."""
        if self.single or name is None:
            return self.specs[0]
        spec = self._names.get(name)
        if spec is None:
            raise ModelNotFound(f"the model {name!r} does not exist (GET /v1/models lists them)")
        return spec

    def runtime(self, model_id: str) -> ModelRuntime | None:
        return self._runtimes.get(model_id)

    def runtimes(self) -> list[ModelRuntime]:
        """The runtimes of the models loaded or loading."""
        return list(self._runtimes.values())

    def engines(self) -> Iterator[Engine]:
        """The engines of the loaded models."""
        for runtime in list(self._runtimes.values()):
            if runtime.engine is not None:
                yield runtime.engine

    def waiting(self, model_id: str) -> int:
        return self._waiting.get(model_id, 0)

    def changed(self) -> None:
        """Wake whatever waits for a load, an unload or a released lease."""
        self._changed.set()
        self._changed = trio.Event()

    # -- requests ---------------------------------------------------------------------------

    async def acquire(self, name: str | None) -> Lease:
        """A lease on the model ``name`` names, loading it first if it is not loaded.

        Raises ``ModelNotFound``, or ``ModelUnavailable`` when its load fails, takes longer
        than ``--models-load-timeout``, or must wait for room in a full queue; or, with the code
        ``server_shutting_down``, once the drain has begun (``drain``), a wait included.

        *Cancellation*: the wait ends (a load it started goes on, for others and later ones).
        """
        spec = self.resolve(name)
        runtime = self._runtimes.get(spec.id)
        too_large = self._too_large(spec) if runtime is None or runtime.failed is not None else None
        if too_large is not None:  # (one loaded at start regardless is served)
            raise ModelUnavailable(too_large, "model_too_large", retry=False)
        if runtime is not None and runtime.failed is not None:
            del self._runtimes[spec.id]  # a new request tries the load again
        deadline = trio.current_time() + self.settings.models_load_timeout
        self._waiting[spec.id] += 1
        blocked = False
        try:
            while True:
                if self._closed.is_set() or self._draining:
                    raise ModelUnavailable("server is shutting down", "server_shutting_down")
                runtime = self._runtimes.get(spec.id)
                if runtime is not None and runtime.engine is not None and not runtime.stopping:
                    return Lease(self, runtime)
                if runtime is not None and runtime.failed is not None:
                    message = f"the model {spec.id!r} failed to load: {runtime.failure}"
                    raise ModelUnavailable(message, "model_load_failed")
                if runtime is None and not self._start(spec):
                    if not blocked:
                        if self._blocked >= self.settings.max_queue:
                            raise ModelUnavailable(
                                f"no room to load {spec.id!r}: the loaded models are busy and the queue is full",
                                "models_busy",
                            )
                        blocked = True
                        self._blocked += 1
                changed = self._changed
                with trio.move_on_at(deadline):
                    await changed.wait()
                if trio.current_time() >= deadline:
                    what = "room to load it" if self._runtimes.get(spec.id) is None else "its load"
                    waited = self.settings.models_load_timeout
                    raise ModelUnavailable(
                        f"the model {spec.id!r} is not ready: waited {waited:g} s for {what}", "model_loading"
                    )
        finally:
            self._waiting[spec.id] -= 1
            if blocked:
                self._blocked -= 1

    async def load(self, name: str) -> ModelRuntime:
        """Load ``name`` (an operator's preload) and wait until it serves."""
        lease = await self.acquire(name)
        lease.release()
        return lease.runtime

    def unload(self, name: str) -> bool:
        """Unload ``name`` now; False if it was not loaded. Raises ``ModelBusy`` while requests
        hold it (running, queued or waiting): it is never unloaded from under them."""
        spec = self.resolve(name)
        runtime = self._runtimes.get(spec.id)
        if runtime is None or runtime.stopping or runtime.failed is not None:
            return False
        loading = runtime.engine is None  # no request holds a load (they wait for it: _waiting)
        if runtime.users or self._waiting[spec.id] or (runtime.busy and not loading):
            raise ModelBusy(f"the model {spec.id!r} has requests in flight; unload it when they are done")
        self._stop(runtime, "load aborted on request" if loading else "unloaded on request")
        return True

    # -- running ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the models marked to load at start, unload idle ones, until ``close``.

        *Cancellation*: loads in progress are aborted and engines stopped, as by ``close``.
        """
        async with trio.open_nursery() as models:
            self._nursery = models
            for spec in self.specs:
                too_large = self._too_large(spec)
                if too_large is not None:
                    logger.warning("%s", too_large)
            preload = [spec for spec in self.specs if spec.load_on_start]
            for spec in preload:
                self._start(spec, force=True)
            try:
                async with trio.open_nursery() as watchers:
                    watchers.start_soon(self._watch_start, preload)
                    if self.settings.sleep_idle_seconds is not None:
                        watchers.start_soon(self._watch_idle)
                    task_status.started()
                    await self._closed.wait()
                    watchers.cancel_scope.cancel()
            finally:
                self.started.set()
                for runtime in list(self._runtimes.values()):
                    runtime.stop()
            # The models' nursery now waits for every runtime to free its model.

    def drain(self) -> None:
        """The shutdown's drain begins: loads in progress are aborted (their results never
        served) and no more start; requests waiting for a model (its load, or room for it) end
        now with ``server_shutting_down``, and so does any later ``acquire``. Loaded models
        serve on for the requests that hold them, until ``close``."""
        if self._draining:
            return
        self._draining = True
        for runtime in list(self._runtimes.values()):
            if runtime.engine is None and runtime.failed is None and not runtime.stopping:
                self._stop(runtime, "load aborted: the server is shutting down")
        self.changed()

    def close(self) -> None:
        """Unload every model and let ``run`` end (loads in progress are aborted)."""
        self._closed.set()
        for runtime in list(self._runtimes.values()):
            runtime.stop()
        self.changed()

    def _start(self, spec: ModelSpec, *, force: bool = False) -> bool:
        """Start loading ``spec`` once there is room (unloading idle models first); False
        when busy models hold the room."""
        if self._nursery is None or self._closed.is_set() or self._draining:
            return False
        resident = [self._resident(r) for r in self._runtimes.values() if not r.done.is_set() and r.failed is None]
        max_bytes = self.settings.models_max_mb * MIB if self.settings.models_max_mb else None
        victims = make_room(resident, spec.file_bytes(), self.settings.models_max, max_bytes)
        if victims is None and not force:
            return False
        early = self._early.pop(spec) if self._early is not None else None
        runtime = ModelRuntime(spec, self._templates[spec.id], self.created, early)
        self._runtimes[spec.id] = runtime
        stopping = [self._runtimes[v] for v in victims or ()]
        for victim in stopping:
            self._stop(victim, f"unloaded to make room for {spec.id}")
        self._nursery.start_soon(self._run_runtime, runtime, stopping)
        return True

    def _too_large(self, spec: ModelSpec) -> str | None:
        """Why ``spec`` can never load under ``--models-max-mb`` (its file alone is larger);
        None when it can."""
        limit = self.settings.models_max_mb
        size = spec.file_bytes()
        if limit is None or size <= limit * MIB:
            return None
        return (
            f"the model {spec.id!r} ({size / MIB:.0f} MiB) is larger than --models-max-mb ({limit} MiB) "
            "allows for all the models loaded at once: it cannot be loaded"
        )

    def _resident(self, runtime: ModelRuntime) -> Resident:
        busy = runtime.busy or runtime.stopping or self._waiting.get(runtime.spec.id, 0) > 0
        return Resident(runtime.spec.id, busy, runtime.last_used, runtime.spec.file_bytes())

    def _stop(self, runtime: ModelRuntime, why: str) -> None:
        logger.info("model %s: %s", runtime.spec.id, why)
        runtime.stop()

    async def _run_runtime(self, runtime: ModelRuntime, after: list[ModelRuntime]) -> None:
        """Run ``runtime`` once the models unloaded for it have freed their memory."""
        for victim in after:
            await victim.done.wait()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(runtime.run)
                await runtime.loaded.wait()
                self.changed()
                engine = runtime.engine
                await runtime.done.wait()
                if engine is not None:
                    _add_counters(self.retired, engine.stats)
        finally:
            if self._runtimes.get(runtime.spec.id) is runtime and runtime.failed is None:
                del self._runtimes[runtime.spec.id]
            self.changed()

    async def _watch_start(self, preload: list[ModelSpec]) -> None:
        for spec in preload:
            runtime = self._runtimes.get(spec.id)
            if runtime is None:
                continue
            await runtime.loaded.wait()
            if runtime.failed is not None and self.load_failed is None:
                self.load_failed = runtime.failed
                break
        self.started.set()

    async def _watch_idle(self) -> None:
        sleep_after = self.settings.sleep_idle_seconds
        while True:
            await trio.sleep(min(IDLE_CHECK_SECONDS, (sleep_after or 1) / 4))
            live = [r for r in self._runtimes.values() if r.engine is not None and not r.stopping]
            now = trio.current_time()
            for model_id in idle_expired([self._resident(r) for r in live], now, sleep_after):
                self._stop(self._runtimes[model_id], f"idle for {sleep_after:g} s, unloaded")


def _add_counters(total: EngineStats, stats: EngineStats) -> None:
    """Add ``stats``' counters (not its gauges) into ``total``."""
    for name in COUNTERS:
        setattr(total, name, getattr(total, name) + getattr(stats, name))
    for phase, count in stats.cancellations.items():
        total.cancellations[phase] = total.cancellations.get(phase, 0) + count


# EngineStats fields that only grow (the rest are gauges of the moment).
COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "decode_steps",
    "decode_seconds",
    "constrained_tokens",
    "constraint_seconds",
    "requests_finished",
    "prompt_cache_hits",
    "prompt_cache_misses",
    "prompt_cache_tokens_restored",
    "prompt_cache_saves",
    "prompt_cache_evictions",
    "prompt_cache_save_seconds",
    "prompt_cache_restore_seconds",
)


def _template_source(settings: Settings) -> str | None:
    """A model's own chat template override: ``--chat-template`` (text or a built-in's name),
    else ``--chat-template-file``'s text; None: the model's own."""
    return settings.chat_template or read_template(settings.chat_template_file)
