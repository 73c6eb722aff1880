"""Our listening socket: SO_REUSEADDR on, SO_REUSEPORT only when asked, closed on any failure.

Hypercorn would make its own sockets; we make this one so that its options are ours and so
that the lifecycle can close it the moment a shutdown starts. Accepted connections get
TCP_NODELAY from ``trio.SocketStream``.
"""

from __future__ import annotations

import errno
import socket
import sys

# Connections the kernel queues while we are not accepting (e.g. at max_connections).
BACKLOG = 1024


class ListenError(OSError):
    """The address cannot be listened on; the message is one line naming host and port."""

    def __str__(self) -> str:
        return str(self.strerror)  # without OSError's "[Errno N]" prefix


def open_listener(host: str, port: int, *, reuse_port: bool = False, backlog: int = BACKLOG) -> socket.socket:
    """A bound, listening, non-blocking TCP socket for ``host:port`` (IPv4 or IPv6).

    ``host="::"`` listens on IPv6 and, where the system allows, IPv4 too (dual stack).
    Raises ``ListenError`` when the port is taken or the address is not ours.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, type_, proto, _, address = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        if sys.platform != "win32":  # on Windows SO_REUSEADDR lets another socket steal the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(exc.errno, f"cannot listen on {host}:{port}: address already in use") from None
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])
