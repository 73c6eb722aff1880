"""HTTP/2 refused on the cleartext port.

Hypercorn would switch a cleartext connection to HTTP/2 (the ``PRI`` preface, or ``Upgrade:
h2c``), where its flow-control waits have no deadline: a client with a zero window would hold
the connection, and its slot of ``max_connections``, for ever. Here an ``Upgrade: h2c`` is
ignored (the request is answered in HTTP/1.1, as RFC 9110 7.8 allows) and the HTTP/2 preface
is answered with ``REFUSAL`` (a GOAWAY with HTTP_1_1_REQUIRED) and the connection closed.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h11


def _refusal() -> bytes:
    """What a client that opens with HTTP/2's preface gets: our SETTINGS and a GOAWAY with
    HTTP_1_1_REQUIRED (RFC 9113 7), the protocol's own way to say "use HTTP/1.1"."""
    h2_connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    h2_connection.initiate_connection()
    message = b"this server speaks HTTP/1.1 only"
    h2_connection.close_connection(error_code=h2.errors.ErrorCodes.HTTP_1_1_REQUIRED, additional_data=message)
    return h2_connection.data_to_send()


REFUSAL = _refusal()


class HTTP2Refused(Exception):
    """Raised through Hypercorn's protocol when a client starts HTTP/2 with prior knowledge."""


async def check_protocol(event: h11.Request) -> None:
    """Hypercorn's HTTP/1.1 protocol decides on HTTP/2 in this method (``_check_protocol``);
    ours says no: the preface raises ``HTTP2Refused``, anything else (``Upgrade: h2c``
    included) is served as the HTTP/1.1 request it is."""
    if event.method == b"PRI" and event.http_version == b"2.0":
        raise HTTP2Refused
