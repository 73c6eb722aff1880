"""Local TCP ports: a free one, whether a plain bind works, what TIME_WAIT sockets hold one.

Used by the tests and by the HTTP benchmarks (``bench/support/``); standard library only.
"""

from __future__ import annotations

import socket

# Kernel TCP tables, IPv4 and IPv6; a socket in state 06 is in TIME_WAIT.
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_TIME_WAIT = "06"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the probe socket never connects, so it
    leaves no TIME_WAIT behind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plain_bind(port: int) -> OSError | None:
    """Bind ``127.0.0.1:port`` without SO_REUSEADDR; the error, or None when it worked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc
    return None


def time_wait_on(port: int) -> list[str]:
    """The TIME_WAIT sockets whose local port is ``port`` (the ones that make a plain bind of
    it fail), as their lines of ``/proc/net/tcp`` or ``tcp6``; [] where there are none."""
    found: list[str] = []
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii") as rows:
                next(rows)  # the header
                for row in rows:
                    fields = row.split()
                    local, state = fields[1], fields[3]
                    if state == _TIME_WAIT and int(local.rsplit(":", 1)[1], 16) == port:
                        found.append(f"{table}: {row.strip()}")
        except FileNotFoundError:
            if table == _TCP_TABLES[0]:
                raise  # without the IPv4 table nothing can be said; only tcp6 may be missing
    return found
