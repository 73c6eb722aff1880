"""Waiting for a client to close its side of a connection before we close ours (``Connection``:
the drain's ``CLOSE_LINGER``, the lingering close after an answer)."""

from __future__ import annotations

import math
import os
import socket

import trio

MAX_RECV = 64 * 1024


async def wait_for_client_close(
    tcp: trio.socket.SocketType | None, deadline: float, *, discard: int = 0, quiet: float = math.inf
) -> None:
    """Wait until the client on ``tcp`` (a plain TCP socket; None: return at once) has closed
    its side, at most until ``deadline``. With ``discard``, up to that many bytes it sends
    meanwhile are read and dropped, and a pause of ``quiet`` seconds ends the wait; without, any
    byte ends it (it is not ours to read)."""
    fd = tcp.fileno() if tcp is not None else -1
    if fd < 0:
        return
    try:
        duplicate = os.dup(fd)  # a socket object of our own: Hypercorn's reader has the other
    except OSError:  # out of descriptors: close without waiting
        return
    with socket.socket(fileno=duplicate) as sock:
        quiet_until = trio.current_time() + quiet if discard else math.inf
        while True:
            try:
                data = sock.recv(MAX_RECV if discard else 1, socket.MSG_DONTWAIT | (0 if discard else socket.MSG_PEEK))
            except BlockingIOError:  # nothing yet
                with trio.move_on_at(min(deadline, quiet_until)):
                    await trio.lowlevel.wait_readable(sock)
                if trio.current_time() >= min(deadline, quiet_until):
                    return
                continue
            except OSError:  # reset: nothing more will come
                return
            if not data or not discard:
                return  # their end, or (peeking) bytes we will not read
            discard -= len(data)
            if discard <= 0:
                return
            quiet_until = trio.current_time() + quiet
