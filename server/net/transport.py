"""The one interface the api has to the transport under it.

A response's body may, while it is being sent, reach the connection it goes out on for two
things Hypercorn does not offer: writing a chunk of the body straight to the socket (the
streaming fast path, ``server/api/streaming.py``), and hearing that the client ended its input
(so that it can probe whether the client is gone). And a request sends the ``100 Continue`` its
client may wait for once its head has passed the checks (``middleware``). ``current_transport``
names the connection to the tasks that serve its requests; it is None where the connection is
not ours (under the hypercorn CLI), and then none of these is available.

This module imports nothing of the rest of the server, nor Hypercorn or h11: the api depends
on this contract, ``connection.Connection`` implements it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Protocol

ChunkWriter = Callable[[bytes], bool]
"""Writes one chunk of the response body being sent now, framed by the transport, without
waiting: True when it went out (or is owed, ahead of any other write), False when refused (the
socket would block or is gone, another write is in progress, or that response is no longer
being sent). Never called with a chunk after it refused one, until the body has caught up
through its ordinary path."""


class Transport(Protocol):
    def body_writer(self) -> ChunkWriter | None:
        """A writer for the body of the response being sent now on this connection, or None
        when that body cannot be written directly (not an HTTP/1.1 chunked body in progress,
        or not a plain TCP socket). Call it from the body's generator after its first chunk
        (when the head is out)."""
        ...

    def on_peer_closed(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (synchronously, once) when the client ends its input, or now if
        it has; None forgets it. One at a time: the response in progress sets it."""
        ...

    @property
    def closing(self) -> bool:
        """The connection closes once the request in progress is answered (the server drains,
        or hands over to a hot restart's new process): its answer says ``Connection: close``,
        so that the client's next request opens a new connection, not one that is closing."""
        ...

    def send_continue(self) -> None:
        """Send the interim ``100 Continue`` the request in progress waits for (its head had
        ``Expect: 100-continue``), if it does and its answer has not begun; once. The app
        calls it when the request has passed the checks its head alone can fail."""
        ...


current_transport: contextvars.ContextVar[Transport | None] = contextvars.ContextVar("current_transport", default=None)
