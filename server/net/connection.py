"""One HTTP connection: Hypercorn's ``TCPServer`` with keep-alive idling that works here.

Hypercorn restarts its keep-alive timer from whatever task reports the connection idle; under
Quart-Trio that is the request's own task, inside a nursery that Quart-Trio cancels as the
response ends, so the timer dies at once and idle keep-alive connections would stay open
forever (and a drain would wait on them). Here the timer is a task of the connection itself.

A connection without a complete request head in progress (between requests, or a client that
sends its headers slowly) is closed after ``keep_alive_timeout``, and at once when ``drain()``
is called, unless a request may be on its way (see ``drain``).

Writes are shielded (a half-written response would corrupt the connection) but bounded: a
client that stops reading is cut after ``write_timeout``, or at the deadline given to ``cut``.
A write that fits in the socket's send buffer (nearly every SSE event) goes out in one plain
non-blocking ``send`` first; only what is left takes trio's guarded path.

During a drain, until its deadline, a connection whose last response is done waits a moment
for its client to close first (``CLOSE_LINGER``): the side that closes first keeps the
TIME_WAIT, and one on the server's port makes a plain ``bind`` of that port fail after we exit.
A connection closed right after an answer lingers (``LINGER_*``): what the client still sends
is discarded until it closes, so that it reads the answer rather than a reset.

HTTP/1.1 only: HTTP/2 is refused (``http2``).

A client that closes its sending side after its request (a half-close: ``nc -N``, some
proxies) still gets its answer: the end of its input does not end a request in progress,
unless a probe shows the client is gone (``peer``): an interim ``100 Continue`` when the
answer has not begun, a streamed answer's ping (``on_peer_closed``) when it has; a client that
is gone answers it with a reset, which ends the request as a disconnect always did.

The api reaches a connection only through ``transport.Transport`` (``current_transport``):
a streamed response asks ``body_writer`` for a function that frames one chunk of its body and
writes it straight to the socket, bypassing Quart, Hypercorn and h11 (``body_writer`` lists the
invariants that make that safe), and ``on_peer_closed`` tells it of a half-close.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
from collections.abc import Callable

import h11
import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

from server.net import expect, http2, linger, peer, protocol_errors
from server.net.transport import ChunkWriter, current_transport

logger = logging.getLogger("llama_trio.net")

# At a drain, how long a connection that may have a request on its way (no request on it yet,
# part of a head received, or bytes not yet read) has for its request head before it is closed
# as idle: a client that has just connected sends its request within moments, and it is better
# answered (served in a hot restart's hand-over, 503 in a shutdown) than reset.
ARRIVAL_GRACE = 1.0
# While draining, how long a connection that is done waits for its client to close first.
CLOSE_LINGER = 0.5
# Lingering close (as nginx's): after an answer on a connection we then close (413, 408, 431,
# Connection: close), what the client still sends is read and thrown away until it closes its
# side, so that it gets to read the answer instead of a reset. Bounded: it ends when nothing
# arrives for LINGER_IDLE seconds, after LINGER_TOTAL seconds, or after LINGER_BYTES bytes.
LINGER_IDLE = 0.5
LINGER_TOTAL = 5.0
LINGER_BYTES = 8 * 1024 * 1024
# After the drain's deadline (``cut``) a connection closes as soon as its final event is out: no
# wait for the client to close first (a pooled keep-alive client never does), and the lingering
# close ends after this much quiet, so that the process exits within the final-write grace.
CUT_LINGER_IDLE = 0.1


class Connection(TCPServer):
    """``await Connection(app, config, context, state, stream).serve()``.

    *Cancellation*: cancelling ``serve`` closes the connection.
    """

    def __init__(self, *args: object, write_timeout: float = math.inf) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.write_timeout = write_timeout
        self._idle_since: float | None = None
        self._busy_since = 0.0  # when the request in progress (if any) had its head
        self._draining = False
        self._grace_until = -math.inf  # while draining: when an idle connection is closed
        self._had_request = False  # a request head was complete on it
        self._head_started = False  # bytes of a request head arrived since it was last idle
        self._wake = trio.Event()
        self._hard_deadline = math.inf  # set by ``cut``
        self._write_scope: trio.CancelScope | None = None
        self._scope: trio.CancelScope | None = None
        # The plain TCP socket, for the fast path of ``_write``; None for anything else.
        self._socket = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        # The tail of a ``write_nowait`` that did not fit in the socket's buffer;
        # it goes out first with the next write of any kind.
        self._owed = b""
        self._closing = False
        self._wrote_since_idle = False  # an answer (or part of one) went out since the last idle
        self._peer_closed = False  # the client sent its end of input (FIN)
        self._on_peer_closed: Callable[[], None] | None = None
        self._continue_owed = False  # the request in progress waits for a 100 (``expect``)

    async def serve(self) -> None:
        current_transport.set(self)  # the tasks Hypercorn starts for its requests inherit it
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

    @property
    def body_since(self) -> float | None:
        """When the request whose body is still arriving had its head, or None (idle, or its
        body is in, or draining)."""
        connection = getattr(self.protocol.protocol, "connection", None)
        if self._idle_since is not None or self._draining or not isinstance(connection, h11.Connection):
            return None
        return self._busy_since if connection.their_state is h11.SEND_BODY else None

    @property
    def closing(self) -> bool:
        return self._draining

    def abort(self) -> None:
        """Close now, whatever is in progress (no lingering): its request ends as at a disconnect."""
        self._draining = True
        self.cut(trio.current_time())
        if self._scope is not None:
            self._scope.cancel()

    def drain(self, arrival_grace: float = 0.0) -> None:
        """Close now if idle; otherwise close when the request in progress is answered.

        With ``arrival_grace``, an idle connection that may have a request on its way (no request
        on it yet, part of a head received, or bytes not yet read) is given that long for its
        head first.
        """
        self._draining = True
        if arrival_grace > 0 and self._request_may_be_coming():
            self._grace_until = trio.current_time() + arrival_grace
        self._wake.set()

    def _request_may_be_coming(self) -> bool:
        """Whether a request may be on its way on a connection not busy with one (a connection
        not yet served counts as one that has had no request)."""
        if not self._had_request:
            return True
        if self._idle_since is None:
            return False  # busy: closed when its answer is done
        if self._head_started:
            return True
        fd = self._socket.fileno() if self._socket is not None else -1
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

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
            if not event.idle:
                self._busy_since = trio.current_time()
            if event.idle:
                self._wrote_since_idle = False
                self._head_started = False
            else:
                self._had_request = True
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
            if not self._closing:
                self._closing = True
                if self._draining and self._hard_deadline == math.inf:
                    await linger.wait_for_client_close(self._socket, trio.current_time() + CLOSE_LINGER)
                if self._wrote_since_idle:
                    await self._linger()
            await super()._close()
        if self._scope is not None:
            self._scope.cancel()

    async def _linger(self) -> None:
        """Close our sending side, then discard what the client still sends until it closes
        its own (bounded by ``LINGER_*`` and the drain's end)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            await self.stream.send_eof()
        deadline = min(trio.current_time() + LINGER_TOTAL, self._hard_deadline)
        quiet = LINGER_IDLE if self._hard_deadline == math.inf else CUT_LINGER_IDLE
        await linger.wait_for_client_close(self._socket, deadline, discard=LINGER_BYTES, quiet=quiet)

    async def _read_data(self) -> None:
        """Hypercorn's read loop, with four differences: HTTP/2 is refused (``http2``); a
        request h11 refuses is answered with a body that says why (``protocol_errors``); the
        end of the client's input does not end a request in progress unless a probe shows the
        client is gone (``peer``); and once the connection is closing, what arrives is not parsed."""
        protocol = self.protocol.protocol
        if isinstance(protocol, H11Protocol):
            protocol._check_protocol = http2.check_protocol  # type: ignore[method-assign]
            protocol_errors.install(protocol)
            expect.install(protocol, self._owe_continue)
        try:
            while not self._closing:
                try:
                    data = bytes(await self.stream.receive_some(linger.MAX_RECV))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if self._closing:
                    break
                if data:
                    data = self._parseable(data)
                    if not data:
                        continue
                if data and self._idle_since is not None:
                    self._head_started = True
                await self.protocol.handle(RawData(data))
                if not data:
                    self._peer_closed = True
                    if self._idle_since is None and not await self._probe_peer():
                        # A half-close with a request in progress: it is answered, then the
                        # protocol closes the connection (no next request can come).
                        return
                    break
        except http2.HTTP2Refused:
            await self._write(http2.REFUSAL)
            logger.info("refused an HTTP/2 connection (this server speaks HTTP/1.1 only)")
        await self.protocol.handle(Closed())

    def _parseable(self, data: bytes) -> bytes:
        """What of ``data`` h11 is to parse. Nothing once the client's last request is complete
        (h11's ``MUST_CLOSE``: HTTP/1.0, ``Connection: close``): h11 fails on any byte then, and
        Hypercorn would end the request being answered (a stray CRLF after an HTTP/1.0 body, a
        client's second request on a connection it asked to close). And no empty lines before
        a request line, which RFC 9112 asks a server to ignore and h11 refuses. Only what
        arrives by itself is seen here: bytes already in h11's buffer (sent in one packet with
        the request before them) are left there unread (``protocol_errors``)."""
        connection = getattr(self.protocol.protocol, "connection", None)
        if not isinstance(connection, h11.Connection):
            return data
        state = connection.their_state
        if state is h11.MUST_CLOSE:
            return b""
        if state in (h11.IDLE, h11.DONE) and not connection.trailing_data[0]:
            return data.lstrip(b"\r\n")
        return data

    async def _probe_peer(self) -> bool:
        """At the client's end of input with a request in progress: write a probe (``peer``)
        and watch for the reset of a client that is gone. True once it has come (the request
        then ends as at any disconnect); False when it cannot be told (no plain TCP socket).
        Otherwise this runs until the connection closes after its answer."""
        interim = peer.interim_continue(self.protocol.protocol)
        if interim is not None:
            self.write_nowait(interim)
        if self._on_peer_closed is not None:
            self._on_peer_closed()  # a streamed answer writes a ping now
        if self._socket is None:
            return False
        await peer.wait_for_reset(self._socket)
        return True

    async def _watch_idle(self) -> None:
        while True:
            wake = self._wake
            if self._idle_since is None:
                await wake.wait()
            else:
                deadline = self._grace_until if self._draining else self._idle_since + self.config.keep_alive_timeout
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

    async def _idle_timeout(self) -> None:
        """Hypercorn's timer for the first request head, which would also close the connection
        the moment a drain starts; ``_watch_idle`` keeps that time here, so this does nothing."""

    def _owe_continue(self, waiting: bool) -> None:
        self._continue_owed = waiting

    def send_continue(self) -> None:
        """The interim ``100 Continue`` the request in progress waits for, if it does and its
        answer has not begun; once."""
        if self._continue_owed:
            self._continue_owed = False
            interim = peer.interim_continue(self.protocol.protocol)
            if interim is not None:
                self.write_nowait(interim)

    def on_peer_closed(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (synchronously, once) when the client ends its input, or now if it
        has; None forgets it. One at a time: the response in progress sets it."""
        self._on_peer_closed = callback
        if callback is not None and self._peer_closed:
            callback()

    def body_writer(self) -> ChunkWriter | None:
        """A function that frames one chunk of the response being sent now as an HTTP/1.1
        chunk and writes it with ``write_nowait``; None when that response is not a chunked
        HTTP/1.1 body in progress on a plain TCP socket (``transport.Transport``).

        Writing chunks behind Hypercorn's back is correct because of these invariants:

        1. **h11 keeps no byte count of a chunked body**, only its state (``SEND_BODY``), so
           chunks framed and written here between two of its own leave that state as valid as
           before. Hence only a chunked HTTP/1.1 body (``their_http_version == b"1.1"``) in
           ``SEND_BODY``; an HTTP/1.0 peer (close-delimited body) takes the ordinary path.
        2. **One writer at a time.** ``write_nowait`` refuses while the send lock is held (a
           write through Hypercorn in progress) and writes with one non-blocking ``write``, no
           checkpoint in between, so direct and ordinary writes never interleave.
        3. **The owed tail.** A chunk the socket takes only in part is still a whole chunk on
           the wire: its tail goes out ahead of the next write of any kind, and the writer
           refuses while one is owed.
        4. **The response is still the caller's.** At every chunk the writer checks that
           Hypercorn's current stream is the one it was made for (a later request on the
           connection has another) and that h11 is still in ``SEND_BODY``.

        What the body must hold on its side (it arms the writer only between its own chunks,
        and ends the body itself) is in ``server/api/streaming.py``.
        """
        if self._socket is None:
            return None
        protocol = self.protocol.protocol  # Hypercorn's ProtocolWrapper -> H11Protocol
        if not isinstance(protocol, H11Protocol):
            return None
        h11_connection = protocol.connection
        if not isinstance(h11_connection, h11.Connection) or h11_connection.their_http_version != b"1.1":
            return None
        response = protocol.stream  # this request's; a later one on the connection gets another
        if h11_connection.our_state is not h11.SEND_BODY or response is None:
            return None

        def write(data: bytes) -> bool:
            if protocol.stream is not response or h11_connection.our_state is not h11.SEND_BODY or not data:
                return False
            return self.write_nowait(b"%x\r\n%b\r\n" % (len(data), data))

        return write

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` to the socket now, with one non-blocking ``write``, or refuse (False).

        It refuses when the socket would block or is gone, when another write holds the send
        lock, and while the tail of an earlier ``write_nowait`` is still owed; it never writes
        part of ``data`` and then refuses: what the socket does not take at once is owed, and
        goes out ahead of the connection's next write of any kind. No checkpoint, so nothing
        else can write in between. The bytes bypass Hypercorn's protocol: the caller frames
        them (``body_writer``).
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
        self._wrote_since_idle = True
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
