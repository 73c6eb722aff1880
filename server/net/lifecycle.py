"""Serving and shutdown in one nursery tree: our listener, Hypercorn's connection handling,
the engine, and the drain.

On the first SIGTERM or SIGINT:

1. the accept loop stops and the listener is closed at once (new connections are refused);
   ``/health`` answers 503 ``draining``; idle keep-alive connections close;
2. queued jobs end at once with ``server_shutting_down`` (503, or an error event + ``[DONE]``);
3. in-flight requests run on until they finish or ``drain_timeout`` passes;
4. at the deadline, or on a second signal, every remaining job ends with the shutting-down
   error event and ``[DONE]`` (a 503 when not streamed); connections get a moment to write it;
5. the engine stops, context and model are freed, and ``serve`` returns.

Hypercorn's own ``serve`` keeps the listening socket open during its graceful window and cuts
streams without a final event when it ends; we use its per-connection ``TCPServer`` and
``Lifespan`` and run our own accept loop and drain instead.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
from collections.abc import Callable
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import wrap_app

from server.api.app import create_app
from server.engine import ShuttingDown
from server.net.connection import Connection
from server.net.listener import bound_port, open_listener
from server.settings import Settings
from server.state import ServerState

logger = logging.getLogger(__name__)

# After the drain deadline, time for connections to write the final error event and [DONE].
FINAL_WRITE_GRACE = 1.0
# Accept errors that mean "out of resources for now": wait and retry rather than crash.
_RETRY_ACCEPT = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}

_Handler = Callable[[trio.SocketStream], Connection]


def hypercorn_config(settings: Settings) -> HypercornConfig:
    config = HypercornConfig()
    config.keep_alive_timeout = settings.keep_alive_timeout
    # No read timeout: Hypercorn applies it to every read, which would cut a long stream whose
    # client has nothing more to send. Slow header senders are bounded by the keep-alive timer
    # (server/net/connection.py) and slow bodies by Quart's BODY_TIMEOUT (read_timeout).
    config.read_timeout = None
    config.h11_max_incomplete_size = settings.max_header_size
    config.graceful_timeout = settings.drain_timeout + FINAL_WRITE_GRACE
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


class Server:
    """One serving process: ``await Server(settings).serve()``."""

    def __init__(self, settings: Settings, sock: socket.socket | None = None) -> None:
        self.settings = settings
        # The listener first: a busy port fails before anything expensive happens.
        self.sock = sock or open_listener(settings.host, settings.port, reuse_port=settings.reuse_port)
        try:
            self.port = bound_port(self.sock)
            self.state = ServerState(settings)
            self.app = create_app(state=self.state)
        except BaseException:
            self.sock.close()
            raise
        self.config = hypercorn_config(settings)
        self._stop = trio.Event()
        self._force = trio.Event()
        self._connections: set[Connection] = set()

    def request_stop(self) -> None:
        """Start the drain (as a first signal does); calling it again ends the drain now."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()
        self.state.draining = True

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until a signal (or ``request_stop``) and the drain are done; then return.

        *Cancellation*: cancelling ``serve`` cuts connections without the drain, stops the
        engine and frees everything; the listener is closed either way.
        """
        context = WorkerContext(None)
        app = wrap_app(self.app, self.config.wsgi_max_body_size, "asgi")
        lifespan = Lifespan(app, self.config, {})
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self.sock))
        try:
            async with trio.open_nursery() as root:
                root.start_soon(self._watch_signals)
                await root.start(lifespan.handle_lifespan)
                await lifespan.wait_for_startup()
                await root.start(self.state.run_engine)
                root.start_soon(self._stop_if_load_fails)
                logger.info("listening on http://%s", _address(self.settings.host, self.port))
                async with trio.open_nursery() as connections:
                    limit = trio.Semaphore(self.settings.max_connections)
                    handler = partial(
                        Connection, app, self.config, context, {}, write_timeout=self.settings.write_timeout
                    )
                    async with trio.open_nursery() as accepting:
                        accepting.start_soon(self._accept, listener, handler, connections, limit)
                        task_status.started(self.port)
                        await self._stop.wait()
                        accepting.cancel_scope.cancel()
                    await listener.aclose()
                    logger.info(
                        "shutting down: listener closed, draining for up to %.0f s", self.settings.drain_timeout
                    )
                    await context.terminated.set()  # no keep-alive after the current response
                    for connection in list(self._connections):
                        connection.drain()  # idle ones close now
                    engine = self.state.engine
                    if engine is not None:
                        engine.stop_admitting()
                        engine.fail_queued(ShuttingDown("server is shutting down"))
                    root.start_soon(self._drain_deadline, connections.cancel_scope)
                root.cancel_scope.cancel()  # the deadline watcher and the signal watcher
                self.state.stop_engine()
                await lifespan.wait_for_shutdown()
        finally:
            await listener.aclose()
            self.state.stop_engine()
        logger.info("stopped")

    async def _accept(
        self, listener: trio.SocketListener, handler: _Handler, connections: trio.Nursery, limit: trio.Semaphore
    ) -> None:
        while True:
            if limit.value == 0:
                await trio.lowlevel.wait_readable(listener.socket)  # a client is waiting
                self._evict_idle()
            await limit.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:
                limit.release()
                if exc.errno in _RETRY_ACCEPT:
                    logger.warning("accept failed (%s); retrying shortly", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            except BaseException:
                limit.release()
                raise
            connections.start_soon(self._connection, handler, stream, limit)

    def _evict_idle(self) -> None:
        """At max_connections, close the connection idle the longest (as nginx reuses idle
        keep-alive connections), so that a flood of idle or slow-header connections cannot keep
        real clients in the backlog until their keep-alive timers run out."""
        idle = [(c.idle_since, i, c) for i, c in enumerate(self._connections) if c.idle_since is not None]
        if idle:
            min(idle)[2].drain()

    async def _connection(self, handler: _Handler, stream: trio.SocketStream, limit: trio.Semaphore) -> None:
        connection = handler(stream)
        self._connections.add(connection)
        try:
            if self._stop.is_set():
                connection.drain()
            await connection.serve()
        finally:
            self._connections.discard(connection)
            limit.release()

    async def _stop_if_load_fails(self) -> None:
        await self.state.ready.wait()
        if self.state.load_failed is not None:
            self.request_stop()

    async def _drain_deadline(self, connections: trio.CancelScope) -> None:
        with trio.move_on_after(self.settings.drain_timeout):
            await self._force.wait()
        logger.info("drain deadline reached: ending the remaining requests")
        engine = self.state.engine
        if engine is not None:
            engine.abort_all(ShuttingDown("server is shutting down"))
        deadline = trio.current_time() + FINAL_WRITE_GRACE
        connections.deadline = deadline
        for connection in list(self._connections):
            connection.cut(deadline)  # writes to clients that stopped reading end too

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR2) as signals:
            async for signum in signals:
                if signum == signal.SIGUSR2:
                    logger.warning("trio tasks:\n%s", _task_tree(trio.lowlevel.current_root_task()))
                    continue
                logger.info("received %s", signal.Signals(signum).name)
                self.request_stop()


def _task_tree(task: trio.lowlevel.Task | None, depth: int = 0) -> str:
    """The running trio tasks as an indented list (``kill -USR2 PID`` logs it)."""
    if task is None:
        return ""
    frames = [f for f in task.iter_await_frames() if "/trio/_core/" not in f[0].f_code.co_filename]
    where = " <- ".join(f"{f.f_code.co_name}:{lineno}" for f, lineno in reversed(frames[-4:])) or "?"
    lines = ["  " * depth + f"{task.name} @ {where}"]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            lines.append(_task_tree(child, depth + 1))
    return "\n".join(lines)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(settings: Settings) -> None:
    await Server(settings).serve()
