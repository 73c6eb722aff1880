"""A small HTTP/1.1 + SSE load client on trio's raw sockets, light enough to load a server from
the same machine.

One TCP connection per request, which the client closes after the body's end (so TIME_WAIT
sockets land on the client's ports, not the server's); chunked or Content-Length bodies; an SSE
splitter that records what a streamed chat completion delivered (``StreamResult``). Nothing here
raises for what the server does: a failure is recorded in the result.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio


class _Reader:
    """Buffered reads from a trio stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.eof = False

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def until(self, marker: bytes) -> bytes | None:
        """Bytes up to and including ``marker``; None at EOF first."""
        while True:
            i = self.buf.find(marker)
            if i >= 0:
                out = bytes(self.buf[: i + len(marker)])
                del self.buf[: i + len(marker)]
                return out
            if not await self._fill():
                return None

    async def exactly(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self._fill():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def some(self) -> bytes:
        if not self.buf and not await self._fill():
            return b""
        out = bytes(self.buf)
        self.buf.clear()
        return out


async def _head(reader: _Reader) -> tuple[int, dict[str, str]]:
    raw = await reader.until(b"\r\n\r\n")
    if raw is None:
        raise ConnectionError("connection closed before a response")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return status, headers


async def _body_parts(
    reader: _Reader, headers: dict[str, str], result: StreamResult | None = None
) -> AsyncGenerator[bytes, None]:
    """The body's bytes as they arrive. Sets ``result.clean_end`` when the body ended as
    framed (the last chunk of a chunked body, or all of Content-Length)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.until(b"\r\n")
            if line is None:
                return
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.until(b"\r\n")  # (no trailers from either server)
                if result is not None:
                    result.clean_end = True
                return
            data = await reader.exactly(size + 2)
            if data is None:
                return
            yield data[:-2]
    elif "content-length" in headers:
        data = await reader.exactly(int(headers["content-length"]))
        if data is None:
            return
        if result is not None:
            result.clean_end = True
        yield data
    else:
        while chunk := await reader.some():
            yield chunk


@dataclass
class StreamResult:
    """What one streamed chat completion delivered; times from ``time.perf_counter``."""

    sent: float = 0.0
    first_content: float | None = None
    end: float | None = None
    status: int | None = None
    pieces: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: Any = None
    done: bool = False  # saw data: [DONE]
    clean_end: bool = False  # the body ended as framed
    events_after_done: int = 0
    usage: dict[str, Any] | None = None
    failure: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.sent

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens", 0))

    @property
    def well_formed(self) -> bool:
        """Ended by itself in the protocol's terms: a finish_reason or an error event, then
        [DONE] and nothing after it, then the body's proper end."""
        return (
            (self.finish_reason is not None or self.error is not None)
            and self.done
            and self.events_after_done == 0
            and self.clean_end
        )


def chat_body(
    messages: list[dict[str, str]], max_tokens: int, banned: Sequence[int], response_format: Any = None
) -> bytes:
    """A streamed chat completion at temperature 0 with usage in its last chunk; the ``banned``
    tokens (end of generation) get a bias of -100, so the answer runs to ``max_tokens``."""
    payload: dict[str, Any] = {
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(t): -100 for t in banned},
    }
    if response_format is not None:
        payload["response_format"] = response_format
    return json.dumps(payload).encode()


def _handle_event(result: StreamResult, data: str, now: float) -> None:
    if result.done:
        result.events_after_done += 1
        return
    if data == "[DONE]":
        result.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        result.error = obj["error"]
        return
    if obj.get("usage"):
        result.usage = obj["usage"]
    for choice in obj.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            if result.first_content is None:
                result.first_content = now
            result.pieces += 1
            result.text += content
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


async def stream_chat(
    port: int,
    body: bytes,
    *,
    stop_after_pieces: int | None = None,
    on_pieces: Callable[[StreamResult], None] | None = None,
) -> StreamResult:
    """POST a streamed chat completion and read it to its end (or, with ``stop_after_pieces``,
    close the connection abruptly after that many content pieces). ``on_pieces`` is called
    after each content piece. Never raises for what the server does."""
    result = StreamResult(sent=time.perf_counter())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        result.failure = f"connect: {exc}"
        return result
    async with stream:
        try:
            await stream.send_all(head + body)
            reader = _Reader(stream)
            result.status, headers = await _head(reader)
            pending = b""
            async with contextlib.aclosing(_body_parts(reader, headers, result)) as parts:
                async for part in parts:
                    now = time.perf_counter()
                    pending += part
                    *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                    for event in events:
                        for line in event.split(b"\n"):
                            if line.startswith(b"data:"):
                                before = result.pieces
                                _handle_event(result, line[5:].strip().decode(), now)
                                if result.pieces != before and on_pieces is not None:
                                    on_pieces(result)
                    if stop_after_pieces is not None and result.pieces >= stop_after_pieces:
                        break  # leaving the block closes the socket mid-stream
        except (OSError, ConnectionError, trio.BrokenResourceError, ValueError) as exc:
            result.failure = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def get_status(port: int, path: str) -> int | None:
    """Status of ``GET path``, or None when nothing answers."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return None
    async with stream:
        try:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            reader = _Reader(stream)
            status, headers = await _head(reader)
            async for _ in _body_parts(reader, headers):
                pass
            return status
        except (OSError, ConnectionError, trio.BrokenResourceError, ValueError):
            return None


async def get_body(port: int, path: str) -> bytes:
    """The body of ``GET path`` (raises when nothing answers). The client closes first, as
    everywhere here, so that no TIME_WAIT lands on the server's port."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        reader = _Reader(stream)
        _status, headers = await _head(reader)
        return b"".join([part async for part in _body_parts(reader, headers)])
