"""``ServerState``: the models behind the app and the serving phase they are in.

One instance per app. ``run_models`` runs the ``ModelRegistry`` (which loads the models marked
to load at start, and others on demand) until ``stop_models``; the lifecycle (or, under the
hypercorn CLI, the app's lifespan) runs it in a nursery. ``ready`` is set once the models loaded
at start serve (or one failed: ``load_failed``).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import trio

from server.engine import EmbedderStats, Engine, EngineStats
from server.engine.compiler import CompileStats
from server.engine.embedder import Embedder
from server.metrics import Metrics, ModelRow
from server.models.loading import EarlyLoads
from server.models.registry import ModelRegistry
from server.models.runtime import ModelInfo, TemplateFileError
from server.settings import Settings
from server.store import MIB, ResponseStore

__all__ = ["ModelInfo", "ServerState", "TemplateFileError"]


class ServerState:
    def __init__(self, settings: Settings, early: EarlyLoads | None = None) -> None:
        self.settings = settings
        self.models = ModelRegistry(settings, early)
        self.draining = False
        self.metrics = Metrics(
            self.engine_stats, lambda: self.draining, self.model_rows, self.compile_stats, self.embedder_stats
        )
        if settings.responses_db is not None:
            ResponseStore.check(settings.responses_db)  # a file it cannot use fails the start
        self.responses = ResponseStore(settings.responses_db, int(settings.responses_max_mb * MIB))
        self._store_closing = trio.Event()

    @property
    def ready(self) -> trio.Event:
        return self.models.started

    @property
    def load_failed(self) -> BaseException | None:
        return self.models.load_failed

    def engines(self) -> list[Engine]:
        return list(self.models.engines())

    async def run_store(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the responses store (in a worker thread), keep it open until ``stop_models``,
        then close it.

        *Cancellation*: the store is closed (shielded) once no call on it is running.
        """
        try:
            await trio.to_thread.run_sync(self.responses.open)
            task_status.started()
            await self._store_closing.wait()
        finally:
            await self.responses.aclose()

    def embedders(self) -> list[Embedder]:
        return [r.embedder for r in self.models.runtimes() if r.embedder is not None]

    def embedder_stats(self) -> EmbedderStats | None:
        """The embedders' statistics together (the loaded models'); None when none runs."""
        return _summed(EmbedderStats, [e.stats for e in self.embedders()])

    def engine_stats(self) -> EngineStats | None:
        """Every model's engine statistics together (counters include unloaded engines'); None
        before any engine ran."""
        engines = self.engines()
        if not engines and self.models.retired.decode_steps == 0:
            return None
        total = dataclasses.replace(self.models.retired, cancellations=dict(self.models.retired.cancellations))
        for engine in engines:
            stats = engine.stats
            for field in dataclasses.fields(EngineStats):
                name = field.name
                if name == "cancellations":
                    for phase, count in stats.cancellations.items():
                        total.cancellations[phase] = total.cancellations.get(phase, 0) + count
                elif name == "last_step_seconds":
                    total.last_step_seconds = max(total.last_step_seconds, stats.last_step_seconds)
                else:  # counters and gauges both add up over the models
                    setattr(total, name, getattr(total, name) + getattr(stats, name))
        return total

    def model_rows(self) -> list[ModelRow]:
        """Each model's load and load-balancing gauges, for /metrics."""
        rows = []
        for spec in self.models.specs:
            runtime = self.models.runtime(spec.id)
            engine = runtime.engine if runtime is not None else None
            stats = engine.stats if engine is not None else None
            rows.append(
                ModelRow(
                    spec.id,
                    loaded=engine is not None,
                    waiting=self.models.waiting(spec.id) + (stats.queued if stats else 0),
                    running=stats.active if stats else 0,
                    kv_usage=stats.kv_cells_used / engine.config.n_ctx if engine is not None and stats else 0.0,
                )
            )
        return rows

    def compile_stats(self) -> CompileStats | None:
        """Every model's grammar compiler's statistics together; None before any compiled."""
        return _summed(CompileStats, [r.compile_stats for r in self.models.runtimes() if r.compile_stats is not None])

    def stop_compiles(self) -> None:
        """A shutdown's drain: every model's waiting grammar compiles end with a 503."""
        for runtime in self.models.runtimes():
            runtime.stop_compiles()

    def drain_models(self) -> None:
        """A shutdown's drain: loads in progress are aborted and requests waiting for a model
        end with a 503 (``ModelRegistry.drain``); loaded models serve on."""
        self.models.drain()

    def stop_models(self) -> None:
        """Let ``run_models`` and ``run_store`` finish (aborting loads in progress)."""
        self.models.close()
        self._store_closing.set()

    async def run_models(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the models until ``stop_models``, then free everything.

        *Cancellation*: loads in progress are aborted (their threads waited for, never
        abandoned); running engines are stopped as by ``open_engine``.
        """
        await self.models.run(task_status=task_status)


S = TypeVar("S", EmbedderStats, CompileStats)


def _summed(kind: type[S], found: list[S]) -> S | None:
    """Statistics of several models added up field by field; None when there are none."""
    if not found:
        return None
    total = kind()
    for stats in found:
        for field in dataclasses.fields(kind):
            setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
    return total
