"""``ModelRuntime``: one load of one model, from its load to its unload. It loads the model and
its engine's context (``loading.load``, in a worker thread, abortable through llama.cpp's
progress callback; or takes over a load begun as the process started, ``loading.EarlyLoad``),
runs its engine (and its embedder, with ``--embeddings``) until ``stop``, then frees both. A model that is unloaded and
loaded again gets a new runtime. What is fixed for the load is one frozen ``ModelInfo``.
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
from server.engine import Engine, EngineConfig, open_engine
from server.engine.compiler import CompileStats, GrammarCompiler
from server.engine.embedder import Embedder, open_embedder
from server.engine.grammar import GrammarCache, build_tokenizer
from server.engine.grammar_limits import COMPILE_EXIT_WAIT
from server.models.loading import EarlyLoad, Loaded, load
from server.models.memory import available_memory, check_kv_fits
from server.models.specs import ModelSpec
from server.offload import DeviceUse, attention
from server.settings import Settings

logger = logging.getLogger("llama_trio.models")

# A load's failures that are the model's, its file's or its settings' (one line in the log); any
# other is a bug (logged with its traceback). Either fails the model, never the server.
LOAD_ERRORS = (ffi.ModelLoadError, ffi.BackendError, ffi.ContextError, ffi.TemplateError)


class TemplateFileError(OSError):
    """``--chat-template-file`` cannot be read; the message names the file."""

    def __str__(self) -> str:
        return str(self.strerror)


def read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateFileError(0, f"cannot read the chat template file {path}: {exc}") from None


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model is, fixed from its load to its unload."""

    id: str  # what clients call it (its id; ``--alias`` or the file's name for a single model)
    created: int  # the process's start (OpenAI's ``created``)
    name: str | None  # the GGUF's general.name
    fingerprint: str  # changes when the model or the llama.cpp build does (``system_fingerprint``)
    template: ffi.ChatTemplate
    devices: tuple[DeviceUse, ...] = ()  # what llama.cpp found, with the layers each holds


class ModelRuntime:
    """One load of ``spec``: ``await nursery.start(runtime.run)``, later ``stop()``.

    ``loaded`` is set once the engine serves or the load failed (``failed``); ``done`` once
    everything is freed. ``users`` counts the requests that hold it (``registry.Lease``).
    """

    def __init__(
        self, spec: ModelSpec, template_source: str | None, created: int, early: EarlyLoad | None = None
    ) -> None:
        self.spec = spec
        self.created = created
        self.engine: Engine | None = None
        self.info: ModelInfo | None = None
        self.embedder: Embedder | None = None
        self.failed: BaseException | None = None
        self.loaded = trio.Event()
        self.done = trio.Event()
        self.users = 0
        self.last_used = trio.current_time()
        self.stopping = False
        self._template_source = template_source
        self._stop = trio.Event()
        self._early = early  # a load of spec begun as the process started; this runtime owns it
        self._progress = early.progress if early is not None else ffi.ProgressReporter(spec.id, logger)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = trio.Lock()
        self._compiles_stopped = False

    @property
    def failure(self) -> str | None:
        """Why its load failed, as a client may read it: the model file named without the
        folders it is in (the operator's; the log has them)."""
        if self.failed is None:
            return None
        text = str(self.failed)
        for folder in sorted(
            {os.path.dirname(os.path.abspath(self.spec.path)), os.path.dirname(self.spec.path)}, key=len
        )[::-1]:
            if folder:
                text = text.replace(folder + os.sep, "")
        return text

    @property
    def status(self) -> str:
        """``loading``, ``loaded``, ``unloading`` or ``failed``."""
        if self.failed is not None:
            return "failed"
        if self.stopping:
            return "unloading"
        return "loaded" if self.engine is not None else "loading"

    @property
    def progress(self) -> float:
        """How far the load is, 0 to 1."""
        return 1.0 if self.engine is not None else self._progress.progress

    @property
    def busy(self) -> bool:
        """Whether anything holds it: requests (running, queued or waiting for it) or a load."""
        if self.users or self.engine is None:
            return True
        stats = self.engine.stats
        return bool(stats.active or stats.queued)

    async def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model, made on first use (llguidance's view of the
        vocabulary: about 0.3 s, in a worker thread). Call only while the engine runs.

        *Cancellation*: a build in progress is waited for (never abandoned), then kept.
        """
        async with self._grammars_lock:
            if self._grammars is None:
                engine = self.engine
                assert engine is not None
                vocab = engine.vocab
                tokenizer = await trio.to_thread.run_sync(build_tokenizer, vocab, vocab.eog_tokens)
                self._grammars = GrammarCompiler(
                    GrammarCache(tokenizer), queued=lambda: engine.stats.queued, max_queue=self.spec.settings.max_queue
                )
                if self._compiles_stopped:
                    self._grammars.stop()
            return self._grammars

    @property
    def compile_stats(self) -> CompileStats | None:
        return self._grammars.stats if self._grammars is not None else None

    def stop_compiles(self) -> None:
        """A shutdown's drain: grammar compiles waiting end with a 503, and no more start."""
        self._compiles_stopped = True
        if self._grammars is not None:
            self._grammars.stop()

    async def _close_compiles(self) -> bool:
        """Stop compiles and wait (bounded) for those still running, which read the model's
        vocabulary; whether none is left.

        *Cancellation*: shielded, bounded by ``COMPILE_EXIT_WAIT``.
        """
        compiler, self._grammars = self._grammars, None
        if compiler is None:
            return True
        compiler.stop()
        if await compiler.wait_idle(COMPILE_EXIT_WAIT):
            return True
        logger.error(
            "a grammar compile still runs after %.0f s: the model is left to the process's exit", COMPILE_EXIT_WAIT
        )
        return False

    def stop(self) -> None:
        """Let ``run`` finish (aborting a load in progress)."""
        self.stopping = True
        self._progress.abort()
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, serve with the engine until ``stop``, then free everything.

        *Cancellation*: a load in progress is aborted through llama.cpp's progress callback (the
        loading thread is waited for, never abandoned); a running engine is stopped as by
        ``open_engine``.
        """
        task_status.started()
        try:
            await self._run()
        finally:
            if self._early is not None:  # never taken: abort it, wait for its thread, free it
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._early.close)
            self.engine = None
            self.embedder = None
            self.loaded.set()
            self.done.set()

    async def _run(self) -> None:
        if self._stop.is_set():  # stopped before its load began (it waited for room)
            return
        started = self._early.started if self._early is not None else time.monotonic()
        try:
            loaded = await trio.to_thread.run_sync(self._load)
        except Exception as exc:
            self._fail(exc)
            return
        if self._stop.is_set():  # stopped too late for llama.cpp to see the abort: never served
            loaded.close()
            return
        model, devices, s = loaded.model, loaded.devices, loaded.settings
        serving = False
        try:
            template = await trio.to_thread.run_sync(self._template, model)
            fingerprint = f"fp_{model.fingerprint()}"
            self.info = ModelInfo(self.spec.id, self.created, model.name, fingerprint, template, devices)
            if s.embeddings:
                check_kv_fits(
                    model,
                    s.batch_size * s.parallel,
                    s.parallel,
                    attention(s),
                    available_memory(),
                    "its embeddings",
                    unified=True,
                )
            async with contextlib.AsyncExitStack() as stack:
                engine = await stack.enter_async_context(
                    open_engine(model, self._engine_config(s, loaded.cache_bytes), context=loaded.context)
                )
                if s.embeddings:
                    self.embedder = await stack.enter_async_context(
                        open_embedder(
                            model,
                            n_ctx=s.batch_size * s.parallel,
                            n_batch=s.batch_size,
                            n_seq_max=s.parallel,
                            n_threads=s.threads,
                            pooling=s.pooling,
                            attention=attention(s),
                        )
                    )
                self.engine = engine
                self.last_used = trio.current_time()
                logger.info(
                    "model %s ready in %.1f s: %s, %d sequences x %d tokens, %d threads",
                    self.spec.id,
                    time.monotonic() - started,
                    model.description,
                    s.parallel,
                    engine.n_ctx_seq,
                    s.threads,
                )
                serving = True
                self.loaded.set()
                await self._stop.wait()
        except Exception as exc:
            if serving:
                raise
            self._fail(exc)  # its engine or embedder could not start: this model fails, not the server
        finally:
            if await self._close_compiles():
                model.close()

    def _template(self, model: ffi.Model) -> ffi.ChatTemplate:
        """The model's chat template (blocking: jinja2 compiles it). One the operator gave that
        can render nothing fails the load: every chat would be a 400 blaming its client."""
        template = ffi.ChatTemplate(
            self._template_source or model.chat_template,
            bos_token=model.vocab.text(model.vocab.bos) if model.vocab.bos >= 0 else "",
        )
        if self._template_source is not None:
            try:
                template.check()
            except ffi.TemplateError as exc:
                raise ffi.TemplateError(
                    f"{self.spec.id}: {exc} (--chat-template, --chat-template-file, a preset)"
                ) from None
        return template

    def _fail(self, exc: Exception) -> None:
        """The load failed: requests for this model get ``failed`` (a 503) and the next one
        tries again (a load stopped on purpose did not fail: it ends as unloaded). An error of
        llama.cpp's or of the model's settings is one line; anything else is a bug, logged with
        its traceback."""
        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:  # from the engine's nursery
            exc = exc.exceptions[0]
        if isinstance(exc, LOAD_ERRORS):
            if self._stop.is_set():  # stopped while it loaded (an unload, the shutdown): not a failure
                return
            logger.error("%s", exc)
        else:
            logger.exception("the model %s could not start", self.spec.id, exc_info=exc)
        self.failed = exc

    def _engine_config(self, s: Settings, cache_bytes: int) -> EngineConfig:
        return EngineConfig(
            n_parallel=s.parallel,
            n_ctx=s.ctx_size,
            n_batch=s.batch_size,
            n_threads=s.threads,
            max_queue=s.max_queue,
            cache_bytes=cache_bytes,
            attention=attention(s),
            fast_forward=not s.no_fast_forward,
        )

    def _load(self) -> Loaded:
        early, self._early = self._early, None
        if early is not None:
            return early.take()
        return load(self.spec, self._progress)
