"""``Model``: a loaded GGUF file, its metadata and its vocabulary."""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ffi._lib import ProgressReporter, ffi, lib, log_lines
from ffi.backend import Placement
from ffi.errors import ClosedError, ModelLoadError
from ffi.vocab import Vocab

if TYPE_CHECKING:
    from ffi.context import Context

logger = logging.getLogger("llama_trio.ffi")

_GGUF_MAGIC = b"GGUF"

SPLIT_MODES = {
    "none": lib.LLAMA_SPLIT_MODE_NONE,
    "layer": lib.LLAMA_SPLIT_MODE_LAYER,
    "row": lib.LLAMA_SPLIT_MODE_ROW,
}


class Model:
    """A llama.cpp model loaded from a GGUF file, on the CPU unless ``n_gpu_layers`` says more.

    ``n_gpu_layers``: layers on the offload devices (GPUs, RPC servers; -1: all), as llama.cpp
    counts them (the output layer is one); ``split_mode`` ("none", "layer", "row"),
    ``main_gpu`` and ``tensor_split`` (a proportion per device) say how they share them. The
    ``llama_model_params`` given to llama.cpp stay readable as ``load_params``; where the
    layers went, as llama.cpp logged it while loading, is ``placement``.

    Loading blocks for as long as llama.cpp reads the file: call it from a worker thread in
    async code. ``progress`` receives load progress and can abort the load.

    ``close()`` frees the model, after closing every ``Context`` made from it; it is
    idempotent, and any later use raises ``ClosedError``. A model that is only dropped is freed
    by the garbage collector as a safety net.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = 0,
        split_mode: str = "layer",
        main_gpu: int = 0,
        tensor_split: Sequence[float] = (),
        vocab_only: bool = False,
        progress: ProgressReporter | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._content = _check_gguf_file(self.path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.split_mode = SPLIT_MODES[split_mode]
        params.main_gpu = main_gpu
        if tensor_split:
            if len(tensor_split) > lib.llama_max_devices():
                raise ValueError(
                    f"tensor_split has {len(tensor_split)} values; llama.cpp takes at most {lib.llama_max_devices()}"
                )
            self._tensor_split = ffi.new("float[]", lib.llama_max_devices())
            self._tensor_split[0 : len(tensor_split)] = list(tensor_split)
            params.tensor_split = self._tensor_split
        params.vocab_only = vocab_only
        if progress is None:
            progress = ProgressReporter(os.path.basename(self.path), logger)
        if progress.aborted:  # before llama.cpp opens the file (a slow disk, a pipe)
            raise ModelLoadError(f"loading {self.path} was aborted")
        params.progress_callback = progress.callback
        params.progress_callback_user_data = progress.state
        self.load_params: Any = params
        with log_lines() as lines:
            ptr = lib.llama_model_load_from_file(self.path.encode(), params)
        params.progress_callback = ffi.NULL  # the reporter is the caller's; no pointer to it is kept
        params.progress_callback_user_data = ffi.NULL
        self.placement = Placement.from_log([text for _, text in lines])
        if ptr == ffi.NULL:
            if progress.aborted:
                raise ModelLoadError(f"loading {self.path} was aborted")
            errors = [text for level, text in lines if level >= logging.ERROR]
            why = f": {errors[0]}" if errors else " (corrupt or unsupported GGUF)"
            raise ModelLoadError(f"llama.cpp could not load {self.path}{why}")
        self._ptr: Any = ffi.gc(ptr, lib.llama_model_free)
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self.vocab = Vocab(self, lib.llama_model_get_vocab(ptr))
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(ptr)
        self.n_layer: int = lib.llama_model_n_layer(ptr)
        self.n_embd: int = lib.llama_model_n_embd(ptr)
        # llama.cpp aborts the process on a head count of a model without layers (vocab only).
        layered = self.n_layer > 0
        self.n_head: int = lib.llama_model_n_head(ptr) if layered else 0
        self.n_head_kv: int = lib.llama_model_n_head_kv(ptr) if layered else 0
        self.n_swa: int = lib.llama_model_n_swa(ptr)  # 0: no sliding-window attention
        # A recurrent or hybrid model keeps a fixed state per sequence, not cells per token.
        self.recurrent: bool = bool(lib.llama_model_is_recurrent(ptr) or lib.llama_model_is_hybrid(ptr))
        self.name: str = self.meta("general.name") or os.path.splitext(os.path.basename(self.path))[0]
        tmpl = lib.llama_model_chat_template(ptr, ffi.NULL)
        self.chat_template: str | None = ffi.string(tmpl).decode("utf-8", "replace") if tmpl != ffi.NULL else None
        buf = ffi.new("char[256]")
        lib.llama_model_desc(ptr, buf, len(buf))
        self.description: str = ffi.string(buf).decode("utf-8", "replace")
        self.size_bytes: int = lib.llama_model_size(ptr)
        self.n_params: int = lib.llama_model_n_params(ptr)

    @property
    def ptr(self) -> Any:
        """The ``llama_model *``; raises ``ClosedError`` after ``close()``."""
        if self._ptr is None:
            raise ClosedError("model is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when the key is absent."""
        size = 256
        while True:
            buf = ffi.new("char[]", size)
            n = lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return ffi.string(buf).decode("utf-8", "replace")
            size = n + 1

    def _register(self, context: Context) -> None:
        self._contexts.add(context)

    def close(self) -> None:
        """Close the contexts made from this model, then free it. Idempotent."""
        if self._ptr is None:
            return
        for context in list(self._contexts):
            context.close()
        self.vocab._detach()
        ptr, self._ptr = self._ptr, None
        ffi.release(ptr)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fingerprint(self) -> str:
        """A short hash of this model's file (samples of its bytes, read when it was loaded) and
        the llama.cpp build running it (its compiled features), stable across restarts of the
        same pair; two files of one shape and type (a base and its fine-tune) differ."""
        system = ffi.string(lib.llama_print_system_info()).decode("utf-8", "replace")
        meta = f"{self.description}|{self.size_bytes}|{self.n_params}|{self._content}|{system}"
        return hashlib.sha256(meta.encode()).hexdigest()[:12]

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.description
        return f"<Model {self.name!r} {state}>"


_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def _check_gguf_file(path: str) -> str:
    """Refuse what is plainly not a GGUF file before llama.cpp sees it; a digest of its size
    and of ``_SAMPLES`` pieces of it spread from its first byte to its last (a megabyte read of
    however many: the weights differ between two models of one shape where the header does not)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.sha256(str(size).encode())
            span = max(0, size - _SAMPLE_BYTES)
            for i in range(_SAMPLES):
                digest.update(os.pread(f.fileno(), _SAMPLE_BYTES, span * i // (_SAMPLES - 1)))
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path}") from None
    except IsADirectoryError:
        raise ModelLoadError(f"model path is a directory: {path}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror}") from None
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file: {path}")
    return digest.hexdigest()
