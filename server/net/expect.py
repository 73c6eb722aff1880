"""``Expect: 100-continue`` answered when the app is ready for the body, not at once.

A client that sends ``Expect: 100-continue`` waits for the interim ``100 Continue`` before it
sends its body (curl does for large bodies), so that a request refused on its head alone (a
401, a 413 by its ``Content-Length``) costs no upload. Hypercorn sends the 100 as soon as the
head is parsed, before any check. Here h11's flag is cleared as the head comes, and the app
sends the 100 through the transport once the request has passed its checks
(``Transport.send_continue``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import h11
from hypercorn.protocol.h11 import H11Protocol


def install(protocol: H11Protocol, owed: Callable[[bool], None]) -> None:
    """At each request head on ``protocol`` (one connection's), tell ``owed`` whether its
    client waits for a 100, and keep Hypercorn from sending it."""
    connection: Any = protocol.connection
    next_event = connection.next_event

    def deferring() -> Any:
        event = next_event()
        if isinstance(event, h11.Request):
            owed(connection.client_is_waiting_for_100_continue)
            connection.client_is_waiting_for_100_continue = False
        return event

    connection.next_event = deferring
