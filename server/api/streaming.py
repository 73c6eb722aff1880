"""Streamed responses: the SSE body of a completion, and its fast path.

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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import trio
from quart import Response

from server.api import logprobs, sse, tools
from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.api.trace import Trace, merged_usage, usage_payload
from server.engine import EngineError, Piece, PieceSink, Usage
from server.net.transport import ChunkWriter, current_transport

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def streamed_response(prepared: Prepared, framer: sse.ChunkFramer, trace: Trace, ping_interval: float) -> Response:
    """The ``text/event-stream`` response for ``prepared``; its job is submitted when Quart
    starts sending the body."""
    body = _sse_body(prepared, framer, trace, ping_interval)
    return Response(body, content_type="text/event-stream", headers=SSE_HEADERS)


# A stream whose client has ended its input (half-close, or gone) is probed with a ping this
# often while nothing else is written: a client that is gone answers the write with a reset,
# and the next write fails, which ends the stream and frees its sequence.
PROBE_INTERVAL = 0.1


class _Probe:
    """Probing a client that ended its input: a ping written at once (the connection then
    looks for a reset), later ones from the body's wait, which ``start`` cuts short."""

    __slots__ = ("active", "scope", "write")

    def __init__(self) -> None:
        self.active = False
        self.scope: trio.CancelScope | None = None
        self.write: Callable[[bytes], bool] | None = None  # once the body is being sent

    def start(self) -> None:
        self.active = True
        if self.write is not None:
            self.write(sse.PING)  # a comment: harmless between any two events
        if self.scope is not None:
            self.scope.deadline = -math.inf


async def _sse_body(
    prepared: Prepared, framer: sse.ChunkFramer, trace: Trace, ping_interval: float
) -> AsyncIterator[bytes]:
    """The SSE body. Leaving it for any reason (done, error, the client gone) releases the
    job; it always ends with ``[DONE]`` when it ends by itself. After ``ping_interval`` seconds
    without a write (queued, a long prompt) a comment line goes out, which keeps proxies and
    clients from timing the stream out; every ``PROBE_INTERVAL`` once the client has ended its
    input.

    Text pieces are written by the engine task straight to the socket while that is possible;
    this generator wakes for the rest: the end, errors, pings, and pieces the socket could not
    take at once (a slow reader), which then pause the sequence as usual.

    *Cancellation*: Quart-Trio cancels the task iterating this body when the client goes
    away; the ``submit`` block is left and the engine frees the sequence before its next step.
    """
    transport = current_transport.get()
    probe = _Probe()
    if transport is not None:
        transport.on_peer_closed(probe.start)
    try:
        for index in range(prepared.job.n_choices):
            if prepared.chat:
                yield framer.role(index)
            elif prepared.echo:  # each answer starts with its prompt
                yield framer.text(prepared.echo[index // prepared.job.n], index=index)
        try:
            usages: list[Usage] = []
            async with prepared.engine.submit(prepared.job) as pieces:
                # A tool-using answer is translated piece by piece here; others may go directly.
                # Hypercorn sends the head with the first chunk: only from here on is the body
                # being sent (for chat; a completion stream has no first chunk yet, so no writer).
                probe.write = write = transport.body_writer() if transport is not None else None
                direct = write is not None and not prepared.tools and not prepared.logprobs
                sink = _direct_sink(write, framer, trace) if direct and write is not None else None
                answer: _Answer
                if prepared.tools:
                    answer = _ToolAnswer(framer, prepared.tools)
                elif prepared.logprobs:
                    answer = _LogprobAnswer(framer, prepared.engine.vocab.piece)
                else:
                    answer = _TextAnswer(framer)
                trace.written = trio.current_time()
                while True:
                    if sink is not None:
                        pieces.deliver_directly(sink)  # everything taken so far is written
                    interval = PROBE_INTERVAL if probe.active else ping_interval
                    with trio.move_on_at(trace.written + interval) as waited:
                        probe.scope = waited
                        try:
                            piece = await pieces.__anext__()
                        except StopAsyncIteration:
                            break
                        finally:
                            probe.scope = None
                    if waited.cancelled_caught:
                        if trio.current_time() >= trace.written + interval:  # silent that long
                            trace.written = trio.current_time()
                            yield sse.PING
                        continue
                    trace.piece(piece)
                    chunks = answer.feed(piece)
                    for chunk in chunks:
                        yield chunk
                    if chunks:
                        trace.written = trio.current_time()
                    if piece.finish_reason:
                        yield framer.finish(answer.finish_reason(piece.finish_reason), piece.index)
                        if piece.usage is not None:
                            usages.append(piece.usage)
            if prepared.include_usage and usages:
                yield framer.usage(usage_payload(merged_usage(usages)))
        except EngineError as exc:
            trace.ending = exc.code
            error = ApiError.from_engine(exc, param=prepared.prompt_param)
            yield sse.error_event(error.message, error.type, error.code, error.param)
        yield sse.DONE
    finally:
        if transport is not None:
            transport.on_peer_closed(None)
        trace.log()


class _Answer(Protocol):
    """How an answer's pieces become chunks, and what its finish reason is called."""

    def feed(self, piece: Piece) -> Sequence[bytes]: ...

    def finish_reason(self, reason: str) -> str: ...


class _TextAnswer:
    """An answer streamed as it is: each piece with text one content delta."""

    def __init__(self, framer: sse.ChunkFramer) -> None:
        self._framer = framer

    def feed(self, piece: Piece) -> Sequence[bytes]:
        return (self._framer.text(piece.text, index=piece.index),) if piece.text else ()

    def finish_reason(self, reason: str) -> str:
        return reason


class _LogprobAnswer(_TextAnswer):
    """Each piece one chunk with its text and its tokens' log-probabilities."""

    def __init__(self, framer: sse.ChunkFramer, token_bytes: logprobs.TokenBytes) -> None:
        super().__init__(framer)
        self._token_bytes = token_bytes
        self._completions: dict[int, logprobs.CompletionLogprobs] = {}  # text offsets, per choice

    def feed(self, piece: Piece) -> Sequence[bytes]:
        if not piece.text and not piece.logprobs:
            return ()
        if self._framer.chat:
            payload = {"content": logprobs.chat_content(piece.logprobs, self._token_bytes), "refusal": None}
        else:
            reader = self._completions.setdefault(piece.index, logprobs.CompletionLogprobs(self._token_bytes))
            payload = reader.payload(piece.logprobs, piece.text)
        return (self._framer.text(piece.text, logprobs=payload, index=piece.index),)


class _ToolAnswer:
    """A tool-using answer (``api/tools.py``) as OpenAI streams it: response text as content
    deltas, each call as a first delta with its index, id, type and name (arguments "") and
    then its arguments' JSON text in fragments."""

    def __init__(self, framer: sse.ChunkFramer, scheme: str) -> None:
        self._framer = framer
        self._parser = tools.NativeAnswerParser() if scheme == "native" else tools.AnswerParser()

    def feed(self, piece: Piece) -> Sequence[bytes]:
        chunks: list[bytes] = []
        for event in self._parser.feed(piece.text):
            if isinstance(event, tools.Content):
                chunks.append(self._framer.text(event.text))
            elif isinstance(event, tools.CallStart):
                start = {"index": event.index, "id": tools.call_id(), "type": "function"}
                start["function"] = {"name": event.name, "arguments": ""}
                chunks.append(self._framer.delta({"tool_calls": [start]}))
            else:
                fragment = {"index": event.index, "function": {"arguments": event.fragment}}
                chunks.append(self._framer.delta({"tool_calls": [fragment]}))
        return chunks

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self._parser.calls and reason == "stop" else reason


def _direct_sink(write: ChunkWriter, framer: sse.ChunkFramer, trace: Trace) -> PieceSink:
    """The sink the engine task calls with each piece of this stream: frame it as an SSE event
    in an HTTP/1.1 chunk and write it without waiting (True), or refuse (False: the socket
    would block or is gone, or it is the last piece, which the body sends with the finish and
    usage events)."""

    def sink(piece: Piece) -> bool:
        if piece.finish_reason is not None or not write(framer.text(piece.text)):
            return False
        trace.piece(piece)
        trace.written = trio.current_time()
        return True

    return sink
