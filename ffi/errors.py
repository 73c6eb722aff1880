"""Exceptions raised at the binding's boundary, and the mapping of llama.h return codes."""

from __future__ import annotations


class LlamaError(Exception):
    """Base class of every error the binding raises."""


class ModelLoadError(LlamaError):
    """The model file is missing, unreadable or not a GGUF that llama.cpp can load."""


class ContextError(LlamaError):
    """llama.cpp could not create a context with the requested parameters."""


class ClosedError(LlamaError):
    """A resource was used after its ``close()``."""


class DecodeError(LlamaError):
    """``llama_decode`` failed; ``code`` is its return value."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"llama_decode returned {code}: {message}")
        self.code = code


class NoKvSlotError(DecodeError):
    """Return code 1: no room in the KV cache for the batch. The memory state is unchanged."""


class DecodeAbortedError(DecodeError):
    """Return code 2: the abort callback stopped the decode; processed ubatches stay in memory."""


class InvalidBatchError(DecodeError):
    """Return code -1: the batch was rejected before anything ran."""


class FatalDecodeError(DecodeError):
    """Return code < -1: llama.cpp failed; processed ubatches stay in memory."""


class TokenizeError(LlamaError):
    """Text could not be tokenized (for example, more tokens than fit in an int32)."""


class TemplateError(LlamaError):
    """A chat template could not be rendered for these messages."""


def check_decode(rc: int) -> None:
    """Raise the exception that matches ``llama_decode``'s return code; return on 0."""
    if rc == 0:
        return
    if rc == 1:
        raise NoKvSlotError(rc, "no KV slot for the batch")
    if rc == 2:
        raise DecodeAbortedError(rc, "aborted")
    if rc == -1:
        raise InvalidBatchError(rc, "invalid input batch")
    if rc < -1:
        raise FatalDecodeError(rc, "fatal error")
    # Other positive values are warnings per llama.h; nothing failed.
