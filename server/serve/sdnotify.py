"""systemd's notification protocol (``sd_notify(3)``): tell the service manager that we are
ready, reloading or stopping, and which process is the service's main one.

A notification is one datagram of newline-separated ``KEY=VALUE`` fields sent to the
``AF_UNIX`` socket that ``NOTIFY_SOCKET`` names: a path, or ``@name`` for one in the abstract
namespace. Without ``NOTIFY_SOCKET`` nothing is sent. The variable is left in the environment,
so that a hot restart's new process can notify too.

What the lifecycle sends: ``READY=1`` once serving; ``RELOADING=1`` with ``MONOTONIC_USEC`` on
SIGHUP; when a hot restart hands over, ``READY=1`` and then ``MAINPID=<new pid>`` (from the old
process, the main one until then, so the default ``NotifyAccess=main`` accepts it), or only
``READY=1`` when the restart fails; ``STOPPING=1`` when a drain starts. A hot restart's new
process sends nothing until it is the main one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

logger = logging.getLogger("llama_trio.serve.sdnotify")

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify_address(value: str | None) -> str | None:
    """The socket address ``NOTIFY_SOCKET``'s value names: a path as it is, ``@name`` as the
    abstract address ``\\0name``; None when unset, empty, or of a kind not served here (vsock)."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def message(*fields: str) -> bytes:
    """The datagram for ``fields``, each ``KEY=VALUE`` (a newline inside one, say in a STATUS
    text, becomes a space: it would start a field of its own)."""
    return "\n".join(field.replace("\n", " ") for field in fields).encode()


def monotonic_usec() -> str:
    """The ``MONOTONIC_USEC`` field systemd wants with ``RELOADING=1``: CLOCK_MONOTONIC now."""
    return f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"


def notify(*fields: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``fields`` to the service manager; True when a datagram went out.

    Never blocks (the send is non-blocking) and never raises: a manager that cannot be told is
    logged, and serving goes on.
    """
    raw = (os.environ if env is None else env).get(NOTIFY_SOCKET)
    address = notify_address(raw)
    if address is None:
        if raw:
            logger.warning("NOTIFY_SOCKET=%s is not a path or an @abstract name; not notifying", raw)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(message(*fields), address)
    except OSError as exc:
        logger.warning("could not notify the service manager at %s (%s): %s", raw, exc, ", ".join(fields))
        return False
    return True
