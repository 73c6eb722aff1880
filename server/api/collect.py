"""A whole (non-streamed) answer: run a prepared job to its end and collect each choice's text,
log-probabilities, finish reason and usage, for any dialect to render."""

from __future__ import annotations

from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.api.trace import Trace
from server.engine import EngineError, Piece, TokenLogprob, Usage


class Collected:
    """One choice of a whole answer, as its pieces come."""

    def __init__(self, echo: str = "") -> None:
        self.texts: list[str] = [echo] if echo else []
        self.logprobs: list[TokenLogprob] = []
        self.tokens: list[int] = []  # generated (an end-of-generation token is not among them)
        self.finish = "cancelled"
        self.stop_sequence: str | None = None  # the stop string that ended it
        self.usage: Usage | None = None

    def add(self, piece: Piece) -> None:
        self.texts.append(piece.text)
        self.logprobs += piece.logprobs
        self.tokens.extend(piece.tokens)
        if piece.finish_reason:
            self.finish, self.usage, self.stop_sequence = piece.finish_reason, piece.usage, piece.stop_sequence

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(prepared: Prepared, trace: Trace) -> list[Collected]:
    """Run the job to its end and collect each choice's pieces.

    *Cancellation*: leaving (the client went away) releases the job.
    """
    n = prepared.job.n
    choices = [Collected(prepared.echo[i // n] if prepared.echo else "") for i in range(prepared.job.n_choices)]
    try:
        async with prepared.engine.submit(prepared.job) as pieces:
            async for piece in pieces:
                trace.piece(piece)
                choices[piece.index].add(piece)
    except EngineError as exc:
        trace.status, trace.ending = exc.status, exc.code
        trace.log()
        raise ApiError.from_engine(exc, param=prepared.prompt_param) from None
    except BaseException:
        trace.log()  # cancelled: the client went away
        raise
    finally:
        prepared.lease.release()
    trace.log()
    return choices
