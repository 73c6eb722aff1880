"""The engine: continuous batching of jobs over one llama.cpp context. Knows no HTTP.

- ``jobs``: the vocabulary (``Job``, ``Piece``, ``Usage``, ``PieceSink``, the errors);
- ``config``: ``EngineConfig``, ``EngineStats`` and ``EmbedderStats``;
- ``scheduler``: pure decisions (which sequence, what one step carries, stop strings, when a
  job finishes), unit-tested without a model;
- ``grammar``: grammars (llguidance) for constrained decoding, one matcher per sequence;
- ``choice``: one choice of a job in the engine (its state, its sequence) and the ``Pieces`` its caller reads;
- ``decode_thread``: the one thread that runs llama.cpp's long calls; ``step``: what it runs each
  step (fill the batch, decode, sample);
- ``driver``: the ``Engine`` task and ``open_engine``;
- ``slot_ops``: save, restore and erase of one idle sequence, between steps (llama-server's slots).
"""

from server.engine.choice import Pieces
from server.engine.config import EmbedderStats, EngineConfig, EngineStats
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
    SequenceView,
    ShuttingDown,
    TokenLogprob,
    Usage,
)
from server.engine.slot_ops import SlotBusy, SlotOp, SlotStateRejected

__all__ = [
    "ConstraintFailed",
    "ContextLengthExceeded",
    "DecodeThread",
    "EmbedderStats",
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
    "SequenceView",
    "ShuttingDown",
    "SlotBusy",
    "SlotOp",
    "SlotStateRejected",
    "TokenLogprob",
    "Usage",
    "open_engine",
]
