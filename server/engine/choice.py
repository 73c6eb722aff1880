"""One choice of a job inside the engine: its state (``Choice``; a job with ``n`` choices or
several prompts is several), the sequence it runs in (``Slot``), and the reader its caller
iterates (``Pieces``).

``Choice`` and ``Slot`` are the driver's bookkeeping; only the engine task and, while the task
waits for it, the decode thread touch them. ``Pieces`` is what ``Engine.submit`` hands out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import trio

import ffi
from server.engine.grammar import Matcher
from server.engine.jobs import EngineError, Job, Phase, Piece, PieceSink
from server.engine.scheduler import StopMatcher


class Choice:
    """The engine's state for one choice of a submitted job, from queue to finish or release."""

    __slots__ = (
        "job",
        "lead",
        "index",
        "members",
        "unfinished",
        "prompt",
        "source",
        "copies",
        "send",
        "receive",
        "phase",
        "released",
        "slot",
        "sampler",
        "detok",
        "stops",
        "n_past",
        "n_prompt_done",
        "n_generated",
        "cached_tokens",
        "restored_tokens",
        "pending",
        "held",
        "unjudged",
        "paused",
        "sent",
        "taken",
        "sink",
        "matcher",
        "failure",
    )

    def __init__(
        self,
        job: Job,
        channel_size: int,
        *,
        lead: Choice | None = None,
        prompt: Sequence[int] | None = None,
        source: Choice | None = None,
    ) -> None:
        self.job = job
        # A job with several choices is one ``Choice`` each, one sequence each. The lead
        # (index 0) owns the channel they share and the list of members. Each prompt's first
        # choice (its source) computes it; the others get copies of the source's cells.
        self.lead = lead or self
        self.index = len(lead.members) if lead is not None else 0
        self.members: list[Choice] = [self] if lead is None else []
        self.unfinished = job.n_choices  # (the lead's) choices not finished: the channel closes at 0
        self.prompt = job.prompt if prompt is None else prompt
        self.source = source or self
        self.copies: list[Choice] = []
        if source is not None:
            source.copies.append(self)
        if lead is None:
            self.send, self.receive = trio.open_memory_channel[Piece | EngineError](channel_size * job.n_choices)
        else:
            self.send, self.receive = lead.send, lead.receive
            lead.members.append(self)
        self.phase: Phase | None = Phase.QUEUED  # None once finished or counted as cancelled
        self.released = False  # the caller left ``submit``'s block, or the job ended with an error
        self.slot: Slot | None = None
        self.sampler: ffi.Sampler | None = None
        self.detok: ffi.Detokenizer | None = None
        self.stops = StopMatcher(job.stop)
        self.n_past = 0  # tokens of this sequence in KV
        self.n_prompt_done = 0
        self.n_generated = 0
        self.cached_tokens = 0  # prompt tokens whose cells were kept or restored
        self.restored_tokens = 0  # of those, restored from the host cache
        # To decode next step: the token sampled last and the tokens its grammar forced after it.
        self.pending: list[int] = []
        # Tokens generated whose text is not out yet (a character's first bytes): their ids go
        # with the next piece, so that a piece's tokens add up to every token generated.
        self.held: tuple[int, ...] = ()
        self.unjudged = 0  # of those forced tokens, how many are judged after that decode (logprobs)
        self.paused = False
        # Items put into / taken out of the channel; their difference is what it buffers (cheaper
        # than asking the channel for its statistics every step). Pieces queued for the next
        # hand-out count as put in: they hold their room.
        self.sent = 0
        self.taken = 0
        # Set by ``Pieces.deliver_directly``: takes pieces in place of the channel while armed.
        self.sink: PieceSink | None = None
        self.matcher: Matcher | None = None  # the job's place in its grammar, once admitted
        self.failure: EngineError | None = None  # set in the decode thread: end the job with it

    @classmethod
    def for_job(cls, job: Job, channel_size: int) -> Choice:
        """The ``Choice``s of ``job``, one per choice (each prompt's choices after its source);
        returns the lead, whose ``members`` holds them all."""
        lead: Choice | None = None
        for prompt in job.prompts:
            source = None
            for _ in range(job.n):
                member = cls(job, channel_size, lead=lead, prompt=prompt, source=source)
                lead = lead or member
                source = source or member
        assert lead is not None
        return lead

    def start(self, slot: Slot, sampler: ffi.Sampler, vocab: ffi.Vocab, tick: int) -> None:
        """Take ``slot`` (admitted): from here the choice prefills, then generates."""
        slot.last_used = tick
        slot.scope = self.job.cache_scope
        slot.choice = self
        self.slot = slot
        self.phase = Phase.PREFILL
        self.sampler = sampler
        self.matcher = self.job.grammar.matcher() if self.job.grammar is not None else None
        self.detok = ffi.Detokenizer(vocab)

    def finish_choice(self) -> None:
        """This choice has sent its last piece: the channel closes with the job's last one."""
        self.lead.unfinished -= 1
        if self.lead.unfinished == 0:
            self.send.close()

    def end_with(self, error: EngineError) -> None:
        """End the whole job with ``error`` (the reader gets it next, before any text it has not
        taken yet); every choice is released."""
        if self.send.statistics().current_buffer_used >= self.send.statistics().max_buffer_size:
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                self.receive.receive_nowait()  # make room: the error matters more
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.send.send_nowait(error)
        self.send.close()
        for member in self.lead.members:
            member.released = True


class Slot:
    """One sequence of the context: what its KV cells hold, and the choice using it."""

    __slots__ = ("seq_id", "cached", "scope", "choice", "last_used")

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.cached: list[int] = []  # tokens whose KV cells this sequence holds, in order
        self.scope = ""  # the cache scope of the job that computed them
        self.choice: Choice | None = None
        self.last_used = 0


class Pieces:
    """The pieces of one job, in order (of each choice; choices interleave). Iterating raises
    the ``EngineError`` the job ended with.

    *Cancellation*: cancelling a task blocked in iteration is safe; the job keeps its sequence
    until ``submit``'s block is left, which releases it.
    """

    def __init__(self, choice: Choice, wake_engine: Callable[[], None]) -> None:
        self._choice = choice
        self._members = choice.members
        self._wake_engine = wake_engine

    def __aiter__(self) -> Pieces:
        return self

    def deliver_directly(self, sink: PieceSink) -> None:
        """Arm ``sink`` (see ``PieceSink`` for its contract) for the pieces that come next, when
        the channel is empty; otherwise do nothing (iterate first).

        Arm only with nothing of this job's in flight (every piece taken from the channel
        already written), so that a piece the sink takes can never overtake one taken by
        iteration. Cancellation does not apply (synchronous).
        """
        choice = self._choice
        if choice.sent == choice.taken and len(self._members) == 1:
            choice.sink = sink

    async def __anext__(self) -> Piece:
        try:
            item = await self._choice.receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        choice = self._members[item.index] if isinstance(item, Piece) else self._choice
        choice.taken += 1
        if choice.paused:
            self._wake_engine()
        if isinstance(item, EngineError):
            raise item
        return item
