"""Streamed responses: the one SSE body loop every API family's stream runs, and its fast path.

A stream's wire format is its dialect's (``StreamDialect``: OpenAI's chunks in
``openai_stream``, and each other API family's own); what every stream shares is here, once:
submitting the job and leaving it on any exit, pings while silent, probing a client that
half-closed, the direct path, errors and the drain's cut as the dialect's terminal events.

The SSE body is an async generator that Quart sends chunk by chunk; on top of that, while
the socket takes them, the engine task writes a stream's text pieces straight to the socket
(``_direct_sink``) instead of waking this body's task, and Quart, Hypercorn and h11 never see
those bytes. Per token this skips a task switch, Quart's and Hypercorn's body path and h11's
framing; on 2 cores every microsecond the main thread spends between two decode steps delays
the next one (measured in ``bench/results/README.md``).

The transport is reached only through ``server.net.transport`` (``current_transport``): it
hands out a chunk writer for the body being sent and says when it is safe (its own invariants
are in ``Connection.body_writer``). What this module holds up on its side:

1. **Quart finishes each ``send`` before it pulls the next chunk** from the body generator.
   So while the generator runs, no write of this response is in flight, and arming the sink
   from the generator (``Pieces.deliver_directly``, which arms only when every piece taken
   from the channel has been yielded) cannot let a direct piece overtake a queued one.
2. **The writer is asked for after the head is out**: Hypercorn sends the head with the first
   chunk, so only then is the body being sent.
3. **The body ends itself**: the last piece (with ``finish_reason``) always goes through the
   body generator, which writes the finish and ends the body.

A piece the sink refuses, and every one after it, goes through the channel until the body
re-arms the sink, so backpressure (the sequence pauses) and the write timeout work unchanged.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import trio
from quart import Response

from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.api.trace import Trace, merged_usage
from server.engine import EngineError, Piece, Pieces, PieceSink, Usage
from server.net.transport import ChunkWriter, current_transport

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamDialect(Protocol):
    """How one API family writes a streamed answer. The body loop calls, in order:
    ``opening`` (before the job is submitted), ``feed`` for each piece and ``finish`` at each
    choice's last piece, then ``closing`` once every choice has finished, or ``failed`` instead
    when the job ends with an error (a refusal, an engine failure, the drain's cut): the stream
    then ends well-formed in the dialect's own terms. Renders bytes; does no IO."""

    ping: bytes  # written while silent; harmless between any two events

    def opening(self) -> Sequence[bytes]: ...

    def feed(self, piece: Piece) -> Sequence[bytes]: ...

    def finish(self, piece: Piece) -> Sequence[bytes]: ...

    def closing(self, usage: Usage | None) -> Sequence[bytes]: ...

    def failed(self, error: ApiError) -> Sequence[bytes]: ...

    def direct_text(self) -> Callable[[str], bytes] | None:
        """How a piece of plain text is framed when the engine task writes it directly (it
        must be exactly what ``feed`` would give for it); None when pieces need translating
        (tool calls, logprobs, several choices), and then every piece goes through ``feed``.
        The function only renders: a piece it framed may yet be refused by the socket and go
        through ``feed`` instead; ``direct_written`` says when it went out."""
        ...

    def direct_written(self) -> None:
        """The engine task wrote the piece ``direct_text`` framed last: a dialect whose events
        are numbered (``sequence_number``) counts it here."""
        ...


def streamed_response(
    prepared: Prepared,
    dialect: StreamDialect,
    trace: Trace,
    ping_interval: float,
    *,
    before_closing: Callable[[], Awaitable[Sequence[bytes] | None]] | None = None,
    on_end: Callable[[], None] | None = None,
) -> Response:
    """The ``text/event-stream`` response for ``prepared`` in ``dialect``; its job is submitted
    when Quart starts sending the body. ``before_closing`` is awaited once the job has ended
    well, after the dialect rendered its ``closing`` and before that is written: what a client
    may do as soon as it reads the end (continue a stored response) is possible by then; what
    it returns, when not None, is written instead of ``closing``.
    ``on_end`` is called as the body is left, for whatever reason, with the job released."""
    body = _sse_body(prepared, dialect, trace, ping_interval, before_closing, on_end)
    return Response(body, content_type="text/event-stream", headers=SSE_HEADERS)


# A stream whose client has ended its input (half-close, or gone) is probed with a ping this
# often while nothing else is written: a client that is gone answers the write with a reset,
# and the next write fails, which ends the stream and frees its sequence.
PROBE_INTERVAL = 0.1


class _Probe:
    """Probing a client that ended its input: a ping written at once (the connection then
    looks for a reset), later ones from the body's wait, which ``start`` cuts short."""

    __slots__ = ("active", "ping", "scope", "write")

    def __init__(self, ping: bytes) -> None:
        self.active = False
        self.ping = ping
        self.scope: trio.CancelScope | None = None
        self.write: ChunkWriter | None = None  # once the body is being sent

    def start(self) -> None:
        self.active = True
        if self.write is not None:
            self.write(self.ping)
        if self.scope is not None:
            self.scope.deadline = -math.inf


async def _sse_body(
    prepared: Prepared,
    dialect: StreamDialect,
    trace: Trace,
    ping_interval: float,
    before_closing: Callable[[], Awaitable[Sequence[bytes] | None]] | None,
    on_end: Callable[[], None] | None,
) -> AsyncIterator[bytes]:
    """The SSE body. Leaving it for any reason (done, error, the client gone) releases the
    job; when it ends by itself it ends with the dialect's ``closing`` or ``failed``. After
    ``ping_interval`` seconds without a write (queued, a long prompt) the dialect's ping goes
    out, which keeps proxies and clients from timing the stream out; every ``PROBE_INTERVAL``
    once the client has ended its input.

    Text pieces are written by the engine task straight to the socket while that is possible;
    this generator wakes for the rest: the end, errors, pings, and pieces the socket could not
    take at once (a slow reader), which then pause the sequence as usual.

    *Cancellation*: Quart-Trio cancels the task iterating this body when the client goes
    away; the ``submit`` block is left and the engine frees the sequence before its next step.
    """
    transport = current_transport.get()
    probe = _Probe(dialect.ping)
    if transport is not None:
        transport.on_peer_closed(probe.start)
    try:
        for event in dialect.opening():
            yield event
        try:
            usages: list[Usage] = []
            async with prepared.engine.submit(prepared.job) as pieces:
                # Hypercorn sends the head with the first chunk: only from here on is the body
                # being sent (when the dialect's opening wrote one; else there is no writer).
                probe.write = write = transport.body_writer() if transport is not None else None
                frame = dialect.direct_text()
                sink = None
                if write is not None and frame is not None:
                    sink = _direct_sink(write, frame, dialect.direct_written, trace)
                trace.written = trio.current_time()
                async for events, piece in _events(pieces, dialect, sink, probe, trace, ping_interval):
                    for event in events:
                        yield event
                    if piece is not None and piece.usage is not None:
                        usages.append(piece.usage)
            closing = dialect.closing(merged_usage(usages) if usages else None)
            if before_closing is not None:
                closing = await before_closing() or closing
        except EngineError as exc:
            trace.ending = exc.code
            closing = dialect.failed(ApiError.from_engine(exc, param=prepared.prompt_param))
        for event in closing:
            yield event
    finally:
        prepared.lease.release()
        if transport is not None:
            transport.on_peer_closed(None)
        if on_end is not None:
            on_end()
        trace.log()


async def _events(
    pieces: Pieces, dialect: StreamDialect, sink: PieceSink | None, probe: _Probe, trace: Trace, ping_interval: float
) -> AsyncIterator[tuple[Sequence[bytes], Piece | None]]:
    """The events to write as the job's pieces come (with the piece, None for a ping), until
    its last; a ping after each silence of ``ping_interval`` (``PROBE_INTERVAL`` once probing)."""
    while True:
        if sink is not None:
            pieces.deliver_directly(sink)  # everything taken so far is written
        interval = PROBE_INTERVAL if probe.active else ping_interval
        with trio.move_on_at(trace.written + interval) as waited:
            probe.scope = waited
            try:
                piece = await pieces.__anext__()
            except StopAsyncIteration:
                return
            finally:
                probe.scope = None
        if waited.cancelled_caught:
            if trio.current_time() >= trace.written + interval:  # silent that long
                trace.written = trio.current_time()
                yield (dialect.ping,), None
            continue
        trace.piece(piece)
        events = list(dialect.feed(piece))
        if piece.finish_reason:
            events.extend(dialect.finish(piece))
        if events:
            trace.written = trio.current_time()
        yield events, piece


def _direct_sink(
    write: ChunkWriter, frame: Callable[[str], bytes], written: Callable[[], None], trace: Trace
) -> PieceSink:
    """The sink the engine task calls with each piece of this stream: frame it and write it
    without waiting (True; ``written`` is told), or refuse (False: the socket would block or is
    gone, or it is the last piece, which the body sends with the dialect's finish and closing
    events)."""

    def sink(piece: Piece) -> bool:
        if piece.finish_reason is not None or not write(frame(piece.text)):
            return False
        written()
        trace.piece(piece)
        trace.written = trio.current_time()
        return True

    return sink
