"""The engine: continuous batching of jobs over one llama.cpp context. Knows no HTTP.

- ``jobs``: the vocabulary (``Job``, ``Piece``, ``Usage``, ``PieceSink``, the errors);
- ``config``: ``EngineConfig`` and ``EngineStats``;
- ``scheduler``: pure decisions (which sequence, what one step carries, stop strings, when a
  job finishes), unit-tested without a model;
- ``constraint``: grammars (llguidance) for constrained decoding, one matcher per sequence;
- ``request``: one job's state in the engine and the ``Pieces`` its caller reads;
- ``decode_thread``: the one thread that runs llama.cpp's long calls; ``step``: what it runs each
  step (fill the batch, decode, sample);
- ``driver``: the ``Engine`` task and ``open_engine``.
"""

from server.engine.config import EngineConfig, EngineStats
from server.engine.decode_thread import DecodeThread
from server.engine.driver import Engine, open_engine
from server.engine.jobs import (
    ConstraintFailed,
    ContextLengthExceeded,
    EngineError,
    EngineFailure,
    Job,
    Overloaded,
    Phase,
    Piece,
    PieceSink,
    ShuttingDown,
    TokenLogprob,
    Usage,
)
from server.engine.request import Pieces

__all__ = [
    "ConstraintFailed",
    "ContextLengthExceeded",
    "DecodeThread",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineFailure",
    "EngineStats",
    "Job",
    "Overloaded",
    "Phase",
    "Piece",
    "PieceSink",
    "Pieces",
    "ShuttingDown",
    "TokenLogprob",
    "Usage",
    "open_engine",
]
