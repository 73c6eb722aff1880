"""Our cffi binding to llama.cpp: one owner per C resource, explicit ``close()`` everywhere.

Importing this package loads the compiled module ``ffi._llama`` (built by ``build_ffi.py``) and
initialises llama.cpp's backend once per process.
"""

from ffi import backend
from ffi._lib import ProgressReporter, log_lines
from ffi.backend import BackendError, Device, Placement
from ffi.chat import ChatTemplate
from ffi.context import Attention, Batch, Context, kv_cache_bytes, padded_cells
from ffi.errors import (
    ClosedError,
    ContextError,
    DecodeAbortedError,
    DecodeError,
    FatalDecodeError,
    InvalidBatchError,
    LlamaError,
    ModelLoadError,
    NoKvSlotError,
    TemplateError,
    TokenizeError,
    check_decode,
)
from ffi.model import Model
from ffi.sampler import Sampler, SamplingParams, TokenMask
from ffi.vocab import Detokenizer, Vocab

__all__ = [
    "Attention",
    "BackendError",
    "Batch",
    "ChatTemplate",
    "ClosedError",
    "Context",
    "ContextError",
    "DecodeAbortedError",
    "DecodeError",
    "Detokenizer",
    "Device",
    "FatalDecodeError",
    "InvalidBatchError",
    "LlamaError",
    "Model",
    "ModelLoadError",
    "NoKvSlotError",
    "Placement",
    "ProgressReporter",
    "Sampler",
    "SamplingParams",
    "TemplateError",
    "TokenMask",
    "TokenizeError",
    "Vocab",
    "backend",
    "check_decode",
    "kv_cache_bytes",
    "padded_cells",
    "log_lines",
]
