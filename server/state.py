"""``ServerState``: the model and engine behind the app, and the serving phase they are in.

One instance per app. ``run_engine`` loads the model, runs the engine until ``stop_engine`` is
called, then frees both; the lifecycle (or, under the hypercorn CLI, the app's lifespan) runs it
in a nursery. What is fixed once the model is loaded is one frozen ``ModelInfo`` (as llama.cpp's
server keeps its context metadata); what changes (the serving phase, the engine while it runs)
is on the state itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import time
from dataclasses import dataclass

import trio

import ffi
from server.engine import Engine, EngineConfig, EngineStats, open_engine
from server.engine.embedder import Embedder, open_embedder
from server.engine.grammar import GrammarCache, build_tokenizer
from server.metrics import Metrics
from server.model_files import default_model_path
from server.settings import Settings

logger = logging.getLogger("llama_trio.state")


class TemplateFileError(OSError):
    """``--chat-template-file`` cannot be read; the message names the file."""

    def __str__(self) -> str:
        return str(self.strerror)


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateFileError(0, f"cannot read the chat template file {path}: {exc}") from None


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is, fixed from its load to its unload."""

    id: str  # what clients call it (``--alias``, else the file's name)
    created: int  # the process's start (OpenAI's ``created``)
    name: str | None  # the GGUF's general.name
    fingerprint: str  # changes when the model or the llama.cpp build does (``system_fingerprint``)
    template: ffi.ChatTemplate


class ServerState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model_path = settings.model or str(default_model_path())
        self.model_id = settings.alias or os.path.basename(self.model_path)
        self.created = int(time.time())
        self.engine: Engine | None = None
        self.info: ModelInfo | None = None  # once loaded
        self.embedder: Embedder | None = None
        self._template_source = settings.chat_template or _read_template(settings.chat_template_file)
        self.draining = False
        self.load_failed: BaseException | None = None
        self.ready = trio.Event()
        self._stop = trio.Event()
        self._progress = ffi.ProgressReporter(os.path.basename(self.model_path), logger)
        self.metrics = Metrics(lambda: self.engine.stats if self.engine else None, lambda: self.draining)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = trio.Lock()

    async def grammars(self) -> GrammarCache:
        """The grammar compiler for the loaded model, made on first use (llguidance's view of
        the vocabulary: about 0.3 s, in a worker thread). Call only while the engine runs.

        *Cancellation*: a build in progress is waited for (never abandoned), then kept.
        """
        async with self._grammars_lock:
            if self._grammars is None:
                engine = self.engine
                assert engine is not None
                vocab = engine.vocab
                tokenizer = await trio.to_thread.run_sync(build_tokenizer, vocab, vocab.eog_tokens)
                self._grammars = GrammarCache(tokenizer)
            return self._grammars

    @property
    def stats(self) -> EngineStats | None:
        return self.engine.stats if self.engine else None

    def stop_engine(self) -> None:
        """Let ``run_engine`` finish (aborting a model load in progress)."""
        self._progress.abort()
        self._stop.set()

    async def run_engine(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, serve with the engine until ``stop_engine``, then free everything.

        *Cancellation*: a load in progress is aborted through llama.cpp's progress callback (the
        loading thread is waited for, never abandoned); a running engine is stopped as by
        ``open_engine``.
        """
        task_status.started()
        s = self.settings
        started = time.monotonic()
        try:
            model = await trio.to_thread.run_sync(self._load_model)
        except ffi.ModelLoadError as exc:
            if not self._stop.is_set():
                logger.error("%s", exc)
                self.load_failed = exc
            self.ready.set()
            return
        try:
            template = ffi.ChatTemplate(
                self._template_source or model.chat_template,
                bos_token=model.vocab.text(model.vocab.bos) if model.vocab.bos >= 0 else "",
            )
            self.info = ModelInfo(self.model_id, self.created, model.name, f"fp_{model.fingerprint()}", template)
            config = EngineConfig(
                n_parallel=s.parallel,
                n_ctx=s.ctx_size,
                n_batch=s.batch_size,
                n_threads=s.threads,
                max_queue=s.max_queue,
                cache_bytes=s.cache_ram * 1024 * 1024,
            )
            async with contextlib.AsyncExitStack() as stack:
                engine = await stack.enter_async_context(open_engine(model, config))
                if s.embeddings:
                    self.embedder = await stack.enter_async_context(
                        open_embedder(
                            model,
                            n_ctx=s.batch_size * s.parallel,
                            n_batch=s.batch_size,
                            n_seq_max=s.parallel,
                            n_threads=s.threads,
                            pooling=s.pooling,
                        )
                    )
                self.engine = engine
                logger.info(
                    "model %s ready in %.1f s: %s, %d sequences x %d tokens, %d threads",
                    self.model_id,
                    time.monotonic() - started,
                    model.description,
                    s.parallel,
                    engine.n_ctx_seq,
                    s.threads,
                )
                self.ready.set()
                await self._stop.wait()
        finally:
            self.engine = None
            self.embedder = None
            self.info = None
            model.close()

    def _load_model(self) -> ffi.Model:
        model = ffi.Model(self.model_path, progress=self._progress)
        try:
            # One pass over the vocabulary each, here in the loading thread rather than on the
            # event loop at the first request that needs them.
            model.vocab.control_pattern  # noqa: B018
            model.vocab.eog_tokens  # noqa: B018
        except BaseException:
            model.close()
            raise
        return model
