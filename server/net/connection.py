"""One HTTP connection: Hypercorn's ``TCPServer`` with keep-alive idling that works here.

Hypercorn restarts its keep-alive timer from whatever task reports the connection idle; under
Quart-Trio that is the request's own task, inside a nursery that Quart-Trio cancels as the
response ends, so the timer dies at once and idle keep-alive connections would stay open
forever (and a drain would wait on them). Here the timer is a task of the connection itself.

A connection without a complete request head in progress (between requests, or a client that
sends its headers slowly) is closed after ``keep_alive_timeout``, and at once when ``drain()``
is called.

Writes are shielded (a half-written response would corrupt the connection) but bounded: a
client that stops reading is cut after ``write_timeout``, or at the deadline given to ``cut``.
A write that fits in the socket's send buffer (nearly every SSE event) goes out in one plain
non-blocking ``send`` first; only what is left takes trio's guarded path.

During a drain, a connection whose last response is done waits a moment for its client to
close first (``CLOSE_LINGER``): the side that closes first keeps the TIME_WAIT, and one on the
server's port makes a plain ``bind`` of that port fail after we exit.

``current_connection`` names the connection to the tasks that serve its requests; a streamed
response uses ``write_nowait`` to write its chunks straight to the socket (the framing, and why
it is safe, are in ``server/api/streaming.py``). This module frames nothing: it moves bytes.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import socket

import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.tcp_server import TCPServer

logger = logging.getLogger(__name__)

# While draining, how long a connection that is done waits for its client to close first, and
# how often it looks (a peek at the socket: Hypercorn's read loop owns the waiting on it).
CLOSE_LINGER = 0.5
CLOSE_LINGER_POLL = 0.01

# Set in each connection's task; the tasks Hypercorn starts for its requests inherit it.
current_connection: contextvars.ContextVar[Connection | None] = contextvars.ContextVar(
    "current_connection", default=None
)


class Connection(TCPServer):
    """``await Connection(app, config, context, state, stream).serve()``.

    *Cancellation*: cancelling ``serve`` closes the connection.
    """

    def __init__(self, *args: object, write_timeout: float = math.inf) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.write_timeout = write_timeout
        self._idle_since: float | None = None
        self._draining = False
        self._wake = trio.Event()
        self._hard_deadline = math.inf
        self._write_scope: trio.CancelScope | None = None
        self._scope: trio.CancelScope | None = None
        # The plain TCP socket, for the fast path of ``_write``; None for anything else.
        self._socket = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        # The tail of a ``write_nowait`` that did not fit in the socket's buffer;
        # it goes out first with the next write of any kind.
        self._owed = b""

    async def serve(self) -> None:
        current_connection.set(self)
        self._idle_since = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            nursery.start_soon(self._watch_idle)
            try:
                await self.run()
            finally:
                nursery.cancel_scope.cancel()

    @property
    def idle_since(self) -> float | None:
        """When the connection last became idle (no request head complete), or None if busy."""
        return None if self._draining else self._idle_since

    def drain(self) -> None:
        """Close now if idle; otherwise close when the request in progress is answered."""
        self._draining = True
        self._wake.set()

    def cut(self, deadline: float) -> None:
        """Give up on any write still blocked at ``deadline`` (the end of a drain)."""
        self._hard_deadline = deadline
        if self._write_scope is not None:
            self._write_scope.deadline = min(self._write_scope.deadline, deadline)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            await self._write(event.data)
            return
        if isinstance(event, Updated):
            # State first, without a checkpoint: the caller may be a request task that is
            # cancelled at its next checkpoint.
            self._idle_since = trio.current_time() if event.idle else None
            self._wake.set()
            # Hypercorn's own timer guards only the first request head (started in run()).
            await self.idle_task.stop()
            return
        await super().protocol_send(event)

    async def _close(self) -> None:
        # Shielded: a response that ends before its request body was read is followed by
        # Hypercorn's close in the task that sent it, and Quart-Trio cancels that task as it
        # hears of the end, which left the socket open with a half-read body on it (the next
        # request on it then hung). Once closed, nothing here has more to do: the read loop may
        # be stuck handing body data to an app that is gone, so the connection's tasks end too.
        with trio.CancelScope(shield=True):
            if self._draining:
                await self._let_client_close_first()
            await super()._close()
        if self._scope is not None:
            self._scope.cancel()

    async def _let_client_close_first(self) -> None:
        """Wait until the client has closed its side (or sent more), at most ``CLOSE_LINGER``
        and never past the drain's end."""
        fd = self._socket.fileno() if self._socket is not None else -1
        if fd < 0:
            return
        deadline = min(trio.current_time() + CLOSE_LINGER, self._hard_deadline)
        try:
            duplicate = os.dup(fd)  # a socket object of our own to peek with
        except OSError:  # out of descriptors: close without waiting
            return
        with socket.socket(fileno=duplicate) as peek:
            while trio.current_time() < deadline:
                try:
                    peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:  # nothing yet
                    await trio.sleep(CLOSE_LINGER_POLL)
                    continue
                except OSError:
                    pass
                return  # their end (b""), or bytes we will not read: close now

    async def _watch_idle(self) -> None:
        while True:
            wake = self._wake
            if self._idle_since is None:
                await wake.wait()
            else:
                deadline = -math.inf if self._draining else self._idle_since + self.config.keep_alive_timeout
                with trio.move_on_at(deadline):
                    await wake.wait()
                if not wake.is_set():  # idle past the deadline
                    with trio.CancelScope(shield=True):
                        # Hypercorn's first-request timer would hold the connection (and its
                        # max_connections slot) open until it ran out.
                        await self.idle_task.stop()
                        await self._initiate_server_close()
                    return
            self._wake = trio.Event()

    @property
    def writes_nowait(self) -> bool:
        """Whether ``write_nowait`` can ever succeed (a plain TCP socket)."""
        return self._socket is not None

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` to the socket now, with one non-blocking ``write``, or refuse (False).

        It refuses when the socket would block or is gone, when another write holds the send
        lock, and while the tail of an earlier ``write_nowait`` is still owed; it never writes
        part of ``data`` and then refuses: what the socket does not take at once is owed, and
        goes out ahead of the connection's next write of any kind. No checkpoint, so nothing
        else can write in between. The bytes bypass Hypercorn's protocol: the caller frames
        them (``server/api/streaming.py`` says when that is safe).
        """
        fd = self._socket.fileno() if self._socket is not None else -1
        if fd < 0 or self._owed or self.send_lock.locked():
            return False
        try:
            sent = os.write(fd, data)
        except OSError:  # would block, or the peer is gone: the caller takes its slow path
            return False
        self._owed = data[sent:]
        return True

    async def _write(self, data: bytes) -> None:
        if self._owed:  # the tail of a direct write goes first
            data, self._owed = self._owed + data, b""
        # The descriptor is asked for at each write: it is -1 once the socket is closed, so a
        # number reused by a newer connection is never written to.
        fd = self._socket.fileno() if self._socket is not None else -1
        sent = 0
        if fd >= 0 and not self.send_lock.locked():
            # No await between the check and the send: nothing else can write in between.
            # Without trio's cancel scope, lock and wrappers this costs a third as much, and an
            # SSE stream makes one write per token. A send that would block (full buffer) or
            # fails leaves it all to the guarded path below.
            try:
                sent = os.write(fd, data)
            except OSError:
                sent = 0
            if sent == len(data):
                return
        if sent:
            # Part of it is on the wire: the rest must follow before any other write, even if
            # this task is cancelled now. The lock was free and nothing has run since, so it is
            # taken without a checkpoint.
            self.send_lock.acquire_nowait()
            try:
                written = await self._send_locked(data[sent:])
            finally:
                self.send_lock.release()
        else:
            async with self.send_lock:
                written = await self._send_locked(data)
        if not written:
            await self.protocol.handle(Closed())

    async def _send_locked(self, data: bytes) -> bool:
        """Send all of ``data`` (shielded, bounded by the write deadline); False when the
        connection is gone or was cut for not reading (then it is closed)."""
        deadline = min(trio.current_time() + self.write_timeout, self._hard_deadline)
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            self._write_scope = scope
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass  # gone, or being closed: Hypercorn's close sends EOF without the send lock
            else:
                return True
            finally:
                self._write_scope = None
        if scope.cancelled_caught:
            logger.info("closing a connection whose client stopped reading")
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
        return False
