"""Response header names in their canonical case (``Content-Type``, ``Process-Start-Time-Unix``).

HTTP header names are case-insensitive, but Quart hands Hypercorn lowercased names, and some
clients compare them as written: llama.cpp's own server tests read headers into a plain dict
and look up ``Access-Control-Allow-Origin`` and ``Process-Start-Time-Unix`` as llama-server
writes them. h11 writes a name in the case it was given, so an ASGI wrapper that gives each
name its canonical case (each dash-separated word capitalised) is all it takes.
"""

from __future__ import annotations

from typing import Any, cast

from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, ASGISendEvent, Scope


def canonical(name: bytes) -> bytes:
    """``content-type`` → ``Content-Type``."""
    return b"-".join(word[:1].upper() + word[1:].lower() for word in name.split(b"-"))


class CanonicalHeaders:
    """``app`` with the names of its response heads (and trailers) in canonical case."""

    def __init__(self, app: ASGIFramework) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_canonical(message: ASGISendEvent) -> None:
            if message["type"] in ("http.response.start", "http.response.trailers"):
                event = cast(dict[str, Any], message)
                headers = [(canonical(name), value) for name, value in event.get("headers", ())]
                message = cast(ASGISendEvent, {**event, "headers": headers})
            await send(message)

        await self.app(scope, receive, send_canonical)
