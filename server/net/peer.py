"""Is a client that ended its input gone, or only half-closed?

A client that closes its sending side after its request (a half-close: ``nc -N``, some
proxies) still reads the answer; one that closed the connection (what HTTP clients do on a
timeout) does not, and its request should stop. Both look the same to us: the end of input
(FIN). Only a write tells them apart: a client that is gone answers it with a reset (RST).

So at the end of input, with a request in progress, the connection writes a probe at once:

- when the answer has not begun (its status is not yet known; a whole JSON answer is written
  at its end): an interim ``100 Continue`` (``interim_continue``). RFC 9110 15.2 lets a server
  send 1xx responses before the final one and makes every HTTP/1.1 client read past them
  (Python's http.client, httpx, aiohttp, curl, browsers, Go do); 100 says exactly what is true
  here (the request was received and the final response will follow), and the final status,
  a late error included, is decided as before. HTTP/1.0 clients get no 1xx (RFC 9110 15.2),
  so their half-close cannot be probed: their requests run to their end;
- when the answer has begun (a stream): the stream's own ping (``Transport.on_peer_closed``).

Then it watches the socket (``reset``) until the request is answered: the reset ends the
request as any disconnect does, within a poll of ``RESET_POLL_MAX``.
"""

from __future__ import annotations

import socket

import h11
import trio
from hypercorn.protocol.h11 import H11Protocol

# The first look for a reset comes this soon after the probe (a loopback round trip is
# microseconds), then each look waits twice as long, up to RESET_POLL_MAX.
RESET_POLL_FIRST = 0.0005
RESET_POLL_MAX = 0.05
_TCP_CLOSE = 7  # Linux's TCP_CLOSE state (include/net/tcp_states.h): a reset leaves a socket in it


def interim_continue(protocol: object) -> bytes | None:
    """The bytes of an interim ``100 Continue`` for the request in progress on ``protocol``
    (Hypercorn's HTTP/1.1 protocol), or None when none may be sent: not HTTP/1.1 (an HTTP/1.0
    client, HTTP/2), or the response has begun. h11 allows 1xx before the response head and
    keeps its state as it was, so the answer that follows is framed as before."""
    if not isinstance(protocol, H11Protocol):
        return None
    connection = protocol.connection
    if not isinstance(connection, h11.Connection) or connection.their_http_version != b"1.1":
        return None
    if connection.our_state is not h11.SEND_RESPONSE:
        return None
    return connection.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))


def reset(sock: trio.socket.SocketType) -> bool:
    """Whether the client has reset the connection (or the socket is closed)."""
    if sock.fileno() < 0 or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return True
    # SO_ERROR is cleared when read (also by a failed write); the state stays.
    info = getattr(socket, "TCP_INFO", None)
    return info is not None and sock.getsockopt(socket.IPPROTO_TCP, info, 8)[0] == _TCP_CLOSE


async def wait_for_reset(sock: trio.socket.SocketType) -> None:
    """Return once the client has reset the connection (a probe was written); runs until
    cancelled otherwise (the connection closes when its answer is done).

    *Cancellation*: safe at any point.
    """
    interval = RESET_POLL_FIRST
    while not reset(sock):
        await trio.sleep(interval)
        interval = min(interval * 2, RESET_POLL_MAX)
