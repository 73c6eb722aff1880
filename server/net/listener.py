"""The listening socket: ours (SO_REUSEADDR on, SO_REUSEPORT only when asked, closed on any
failure), or one handed to us (``--fd``, systemd socket activation, a hot restart).

Hypercorn would make its own sockets; we make this one so that its options are ours and so
that the lifecycle can close it the moment a shutdown starts. Accepted connections get
TCP_NODELAY from ``trio.SocketStream``.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import MutableMapping

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


# sd_listen_fds(3): systemd passes its sockets from this descriptor on.
SD_LISTEN_FDS_START = 3
# What socket activation sets (LISTEN_FDNAMES only with FileDescriptorName= or several sockets).
_SYSTEMD_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def systemd_fd(env: MutableMapping[str, str], pid: int) -> int | None:
    """The descriptor systemd's socket activation passed to process ``pid``, or None.

    ``LISTEN_PID``, ``LISTEN_FDS`` and ``LISTEN_FDNAMES`` are removed from ``env`` in every
    case (as ``sd_listen_fds(1)`` does), so that no child of ours takes them for its own.
    Raises ``ListenError`` when the variables are not numbers or name more than one socket.
    """
    listen_pid, listen_fds, _ = (env.pop(name, None) for name in _SYSTEMD_VARIABLES)
    if listen_pid is None or listen_fds is None:
        return None
    try:
        ours, count = int(listen_pid) == pid, int(listen_fds)
    except ValueError:
        raise ListenError(
            errno.EINVAL, f"socket activation: LISTEN_PID={listen_pid!r} LISTEN_FDS={listen_fds!r} are not numbers"
        ) from None
    if not ours or count == 0:
        return None
    if count > 1:
        raise ListenError(
            errno.EINVAL,
            f"socket activation passed {count} sockets; llama-trio serves one (one ListenStream= in the .socket unit)",
        )
    return SD_LISTEN_FDS_START


def inherited_listener(fd: int, origin: str) -> socket.socket:
    """The listening TCP socket at descriptor ``fd``, which ``origin`` (``--fd 5``, ``socket
    activation``) handed us, made non-blocking and not inherited by our children.

    The kernel's socket is shared with whoever handed it over (systemd, a parent, our own
    predecessor): closing our descriptor stops only our accepting, and connections that arrive
    afterwards wait in its backlog for the next process. Its options are the creator's. Note
    that non-blocking mode belongs to the shared open file, not to our descriptor.

    Raises ``ListenError`` (one line naming ``origin`` and ``fd``) when the descriptor is not
    open, not a socket, or not a listening TCP stream socket; the descriptor is then left as
    it was.
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ListenError(exc.errno, f"{origin}: descriptor {fd} is not an open socket ({exc.strerror})") from None
    try:
        kind = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if kind != socket.SOCK_STREAM or sock.family not in {socket.AF_INET, socket.AF_INET6}:
            raise ListenError(errno.EINVAL, f"{origin}: descriptor {fd} is not a TCP socket")
        if not listening:
            raise ListenError(errno.EINVAL, f"{origin}: descriptor {fd} is a TCP socket that is not listening")
        sock.setblocking(False)
        os.set_inheritable(fd, False)
    except BaseException:
        sock.detach()  # not ours to close
        raise
    return sock


def inherited_socket(fd: int | None, env: MutableMapping[str, str]) -> socket.socket | None:
    """The listening socket handed to this process: descriptor ``fd`` (``--fd``) when given,
    else systemd's (socket activation), else None. ``env`` loses the socket activation
    variables either way (see ``systemd_fd``). Raises ``ListenError`` as
    ``inherited_listener`` does."""
    activated = systemd_fd(env, os.getpid())
    if fd is not None:
        return inherited_listener(fd, f"--fd {fd}")
    if activated is not None:
        return inherited_listener(activated, "socket activation")
    return None


def bound_address(sock: socket.socket) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
