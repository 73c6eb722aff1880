"""HTTP/1.1 over a plain socket, for tests that need the bytes themselves: requests built by hand
(a wrong Content-Length, a body cut short), response heads, chunked bodies, closed connections.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any


def request_bytes(
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    content_length: int | None = None,
    host: str | None = "test",
    version: str = "HTTP/1.1",
) -> bytes:
    """The bytes of one request: the request line, ``Host`` (unless ``host`` is None), then for
    a body ``Content-Type: application/json`` and ``Content-Length``, then ``headers``, the
    blank line and the body.

    ``body`` is sent as it is when it is bytes, else as its JSON; None sends no body and no
    body headers. ``content_length`` overrides the length announced (to promise more than is
    sent); the body itself is never changed.
    """
    lines = [f"{method} {path} {version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    data = b""
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        length = len(data) if content_length is None else content_length
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    elif content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status and headers (names in lower case) of a response head, without its blank
    line; fails on a header line without a colon."""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        assert sep, f"not a header line: {line!r}"
        headers[name.strip().lower()] = value.strip()
    return status, headers


def final_response(raw: bytes) -> bytes:
    """``raw`` (what a server sent on a connection) from its final response on: the interim
    1xx responses before it (``HTTP/1.1 100 Continue``, each a head without a body) skipped, as
    every HTTP/1.1 client does (RFC 9110 15.2). Fails on a truncated interim head."""
    while raw.startswith(b"HTTP/1.1 1"):
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep, f"truncated interim response: {head!r}"
    return raw


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read a response head from ``sock``: its status, its headers (names in lower case) and
    the bytes already read past it. Fails when the connection closes first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return (*parse_head(head), rest)


def http_get(sock: socket.socket, path: str) -> tuple[int, bytes]:
    """One keep-alive ``GET path`` on an open connection; the response's status and body (a
    ``Content-Length`` body: the answers this is for have one)."""
    sock.sendall(request_bytes("GET", path))
    status, headers, body = read_head(sock)
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return status, body


def dechunk(body: bytes) -> bytes:
    """The payload of a complete chunked HTTP/1.1 body; fails on any framing error (a truncated
    size line, a chunk not followed by CRLF, bytes after the last chunk)."""
    out = bytearray()
    while True:
        size_line, sep, body = body.partition(b"\r\n")
        assert sep, "truncated chunk size line"
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", "bytes after the last chunk"
            return bytes(out)
        assert body[size : size + 2] == b"\r\n", "chunk not followed by CRLF"
        out += body[:size]
        body = body[size + 2 :]


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), reading what is left. Leaves
    ``sock`` non-blocking."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
