"""OpenAI's streamed chunks (chat completions and completions) as a ``StreamDialect``: the
role chunk (or the echoed prompt) first, content deltas (with logprobs, or translated into
tool-call deltas), a finish chunk per choice, the usage chunk when asked for, ``[DONE]``; an
error as an ``{"error": …}`` event, then ``[DONE]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from server.api import logprobs, sse, tools
from server.api.errors import ApiError
from server.api.prepare import Prepared
from server.api.trace import usage_payload
from server.engine import Piece, Usage


class OpenAIStream:
    """The chunks of one OpenAI stream for ``prepared``."""

    ping = sse.PING

    def __init__(self, prepared: Prepared, framer: sse.ChunkFramer) -> None:
        self._prepared = prepared
        self._framer = framer
        self._answer: _Answer
        if prepared.tools:
            self._answer = _ToolAnswer(framer, prepared.tools)
        elif prepared.logprobs:
            self._answer = _LogprobAnswer(framer, prepared.engine.vocab)
        else:
            self._answer = _TextAnswer(framer)

    def opening(self) -> Sequence[bytes]:
        prepared, framer = self._prepared, self._framer
        if prepared.chat:
            return [framer.role(index) for index in range(prepared.job.n_choices)]
        if prepared.echo:  # each answer starts with its prompt
            n = prepared.job.n
            return [framer.text(prepared.echo[i // n], index=i) for i in range(prepared.job.n_choices)]
        return ()

    def feed(self, piece: Piece) -> Sequence[bytes]:
        return self._answer.feed(piece)

    def finish(self, piece: Piece) -> Sequence[bytes]:
        assert piece.finish_reason is not None
        return (self._framer.finish(self._answer.finish_reason(piece.finish_reason), piece.index),)

    def closing(self, usage: Usage | None) -> Sequence[bytes]:
        if self._prepared.include_usage and usage is not None:
            return (self._framer.usage(usage_payload(usage)), sse.DONE)
        return (sse.DONE,)

    def failed(self, error: ApiError) -> Sequence[bytes]:
        return (sse.error_event(error.message, error.type, error.code, error.param), sse.DONE)

    def direct_text(self) -> Callable[[str], bytes] | None:
        if self._prepared.tools or self._prepared.logprobs:
            return None
        return self._framer.text

    def direct_written(self) -> None:
        pass  # OpenAI's chunks are not numbered


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

    def __init__(self, framer: sse.ChunkFramer, vocab: logprobs.Vocabulary) -> None:
        super().__init__(framer)
        self._vocab = vocab
        self._completions: dict[int, logprobs.CompletionLogprobs] = {}  # text offsets, per choice

    def feed(self, piece: Piece) -> Sequence[bytes]:
        if not piece.text and not piece.logprobs:
            return ()
        if self._framer.chat:
            payload = {"content": logprobs.chat_content(piece.logprobs, self._vocab), "refusal": None}
        else:
            reader = self._completions.setdefault(piece.index, logprobs.CompletionLogprobs(self._vocab))
            payload = reader.payload(piece.logprobs)
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
