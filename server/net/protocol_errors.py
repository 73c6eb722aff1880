"""What a client gets for a request h11 cannot take: a malformed request line or header, a head
over ``--max-header-size`` that arrived in pieces (one that comes at once is the app's 431), a
Transfer-Encoding other than chunked. Hypercorn answers those with the status h11 suggests and
an empty body; here the same status carries a JSON body in the server's error shape that says
what was wrong. The connection then closes, as before.

And one error h11 raises that is none: bytes after a request that ends the connection (an
HTTP/1.0 request, ``Connection: close``) that came in the same packet as it, as a stray CRLF
after an HTTP/1.0 body does. Hypercorn answered them with a 400 in place of the request's own
answer; they are left unread now (``Connection._parseable`` drops those that come later).
"""

from __future__ import annotations

import json
from itertools import chain
from typing import Any

import h11
from hypercorn.protocol.h11 import H11Protocol

# The error's code for each status h11 suggests (anything else: "malformed_request").
_CODES = {431: "request_header_too_large", 501: "not_implemented"}


def body(status: int, detail: str, max_header_size: int) -> bytes:
    """The JSON body of the answer to a request h11 refused with ``status`` and ``detail``
    (h11's message: its raw-bytes tail is left out)."""
    detail = detail.split(": bytearray(", 1)[0]
    if status == 431:
        message = f"the request head is larger than this server accepts ({max_header_size} bytes)"
    elif status == 501:
        message = f"not implemented: {detail}"
    else:
        message = f"malformed HTTP/1.1 request: {detail}"
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": _CODES.get(status, "malformed_request"),
    }
    return json.dumps({"error": error}).encode()


def install(protocol: H11Protocol) -> None:
    """Make ``protocol`` (one connection's) answer h11's protocol errors with a body, and
    leave bytes after a last request unread."""
    connection: Any = protocol.connection
    next_event = connection.next_event
    detail = ["bad request"]

    def noting_errors() -> Any:
        if connection.their_state is h11.MUST_CLOSE and connection.trailing_data[0]:
            return h11.NEED_DATA  # bytes past the client's last request: not ours to read
        try:
            return next_event()
        except h11.RemoteProtocolError as exc:
            detail[0] = str(exc)
            raise

    async def send_error_response(status_code: int) -> None:
        data = body(status_code, detail[0], protocol.config.h11_max_incomplete_size)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(
            status_code=status_code, headers=list(chain(headers, protocol.config.response_headers("h11")))
        )
        await protocol._send_h11_event(response)
        await protocol._send_h11_event(h11.Data(data=data))
        await protocol._send_h11_event(h11.EndOfMessage())

    connection.next_event = noting_errors
    protocol._send_error_response = send_error_response  # type: ignore[method-assign]
