"""Serving and shutdown in one nursery tree: our listener, Hypercorn's connection handling,
the engine, and the drain.

On the first SIGTERM or SIGINT:

1. the accept loop stops and the listener is closed at once (new connections are refused);
   ``/health`` answers 503 ``draining``; idle keep-alive connections close;
2. queued jobs end at once with ``server_shutting_down`` (a 503), except streams, whose answer
   has begun (its head and first chunk are out): they wait for a sequence as before;
   embeddings waiting for the embedder end the same way, and so do requests waiting for a
   model, whose load in progress is aborted (a model loaded serves on for its requests);
3. in-flight requests, and those streams, run on until they finish or ``drain_timeout`` passes;
4. at the deadline, or on a second signal, every remaining job ends with the shutting-down
   error event and ``[DONE]`` (a 503 when not streamed, embeddings after their decode in
   progress); connections get a moment to write it;
5. the engine stops, context and model are freed, and ``serve`` returns.

On SIGHUP, a hot restart (``server/serve/restart.py``): a new copy of the process starts on the
same listening socket; once it reports ready, this one hands over: it stops accepting and
drains as above, except that it refuses nothing it has accepted (its successor serves, so
queued requests wait for a sequence and a request on a connection already open is answered).
A listener handed to us (``inherited``: ``--fd``, socket activation, a hot restart) is accepted
on only once the model is loaded; closing it stops only our accepting, and connections that
arrive later wait in its backlog for the next process.

Hypercorn's own ``serve`` keeps the listening socket open during its graceful window and cuts
streams without a final event when it ends; we use its per-connection ``TCPServer`` and
``Lifespan`` and run our own accept loop and drain instead.
"""

from __future__ import annotations

import errno
import logging
import os
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
from server.api.lazy import import_deferred
from server.engine import ShuttingDown
from server.models.loading import EarlyLoads
from server.net.connection import ARRIVAL_GRACE, Connection
from server.net.header_case import CanonicalHeaders
from server.net.listener import bound_address, bound_port, open_listener
from server.serve import held_signals, restart, sdnotify
from server.settings import Settings
from server.state import ServerState

logger = logging.getLogger("llama_trio.serve")

# After the drain deadline, time for connections to write the final error event and [DONE].
FINAL_WRITE_GRACE = 1.0
# At max_connections with none idle, a request whose body has been arriving longer than this
# may be cut for a waiting client (``Service._evict``).
SLOW_BODY = 1.0
# At max_connections, how often the accept loop looks again for a connection to close while a
# client waits and no slot has come free (at least CLOSE_LINGER: one closing at a time).
EVICT_AGAIN = 0.5
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
    config.errorlog = logging.getLogger("llama_trio.hypercorn")
    return config


class Service:
    """One serving process: ``await Service(settings).serve()``.

    ``sock``: a listening socket to serve instead of opening one; ``inherited`` when it was
    handed to this process (see the module's docstring). ``ready_fd``: the pipe on which a hot
    restart's old process waits for this one (``restart.report_ready``). ``early``: the loads of
    the models loaded at start, begun before the server's modules were imported
    (``__main__``); each model's runtime takes its own, and the caller closes the rest.
    """

    def __init__(
        self,
        settings: Settings,
        sock: socket.socket | None = None,
        *,
        inherited: bool = False,
        ready_fd: int | None = None,
        early: EarlyLoads | None = None,
    ) -> None:
        self.settings = settings
        # The listener first: a busy port fails before anything expensive happens.
        self.sock = sock or open_listener(settings.host, settings.port, reuse_port=settings.reuse_port)
        try:
            self.port = bound_port(self.sock)
            self.address = bound_address(self.sock)
            self.state = ServerState(settings, early)
            self.app = create_app(state=self.state)
        except BaseException:
            self.sock.close()
            raise
        self.inherited = inherited
        self.ready_fd = ready_fd
        self.config = hypercorn_config(settings)
        self._stop = trio.Event()
        self._force = trio.Event()
        self._handover = False  # the stop is a hot restart's hand-over
        self._restart: trio.CancelScope | None = None  # a hot restart in progress
        self._successor: trio.Process | None = None
        self._connections: set[Connection] = set()

    def request_stop(self, *, handover: bool = False) -> None:
        """Start the drain (as a first signal does); calling it again ends the drain now.

        ``handover``: a hot restart's new process serves now, so the drain refuses nothing
        accepted; a plain ``request_stop`` during it turns it into the plain drain.
        """
        if not self._stop.is_set():
            self._stop.set()
            self._handover = handover
            if self._restart is not None:
                self._restart.cancel()
            if not handover:
                self.state.draining = True
                if self.ready_fd is None:  # a hot restart's new process is not the main one before it is ready
                    sdnotify.notify("STOPPING=1", "STATUS=draining")
        elif handover:
            return
        elif self._handover:
            self._handover = False
            self.state.draining = True
            self._refuse_queued()
        else:
            self._force.set()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until a signal (or ``request_stop``) and the drain are done; then return.

        *Cancellation*: cancelling ``serve`` cuts connections without the drain, stops the
        engine and frees everything; the listener is closed either way.
        """
        context = WorkerContext(None)
        # Header names as llama-server and most servers write them (clients that compare names
        # case-sensitively exist: llama.cpp's own tests).
        app = wrap_app(CanonicalHeaders(self.app), self.config.wsgi_max_body_size, "asgi")
        lifespan = Lifespan(app, self.config, {})
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self.sock))
        try:
            async with trio.open_nursery() as root:
                root.start_soon(self._watch_signals)
                await root.start(lifespan.handle_lifespan)
                await lifespan.wait_for_startup()
                await root.start(self.state.run_store)
                await root.start(self.state.run_models)
                root.start_soon(self._stop_if_load_fails)
                logger.info(
                    "listening on http://%s%s",
                    self.address,
                    " (a socket handed to us: accepting once the model is loaded)" if self.inherited else "",
                )
                async with trio.open_nursery() as connections:
                    limit = trio.Semaphore(self.settings.max_connections)
                    handler = partial(
                        Connection, app, self.config, context, {}, write_timeout=self.settings.write_timeout
                    )
                    async with trio.open_nursery() as accepting:
                        accepting.start_soon(self._accept, listener, handler, connections, limit)
                        accepting.start_soon(self._announce_ready)
                        task_status.started(self.port)
                        await self._stop.wait()
                        accepting.cancel_scope.cancel()
                    await listener.aclose()
                    logger.info(
                        "%s: listener closed, draining for up to %.0f s",
                        "handing over" if self._handover else "shutting down",
                        self.settings.drain_timeout,
                    )
                    await context.terminated.set()  # no keep-alive after the current response
                    for connection in list(self._connections):
                        connection.drain(ARRIVAL_GRACE)  # idle ones close now
                    if not self._handover:
                        self._refuse_queued()
                    root.start_soon(self._drain_deadline, connections.cancel_scope)
                root.cancel_scope.cancel()  # the deadline watcher and the signal watcher
                self.state.stop_models()
                await lifespan.wait_for_shutdown()
        finally:
            await listener.aclose()
            self.state.stop_models()
        logger.info("stopped")

    def _refuse_queued(self) -> None:
        """No new jobs, loads or grammar compiles; queued ones end now with a 503 that a proxy may
        retry elsewhere, except streams, whose answer has begun: they keep their place and run
        within the drain. Requests waiting for a compile, or for a model (its load, aborted now,
        or room for it), have not begun their answer: they get the 503."""
        self.state.drain_models()  # first: an engine whose load ends later never admits a job
        for engine in self.state.engines():
            engine.stop_admitting()
            engine.fail_queued(ShuttingDown("server is shutting down"), keep_streamed=True)
        self.state.stop_compiles()
        for embedder in self.state.embedders():
            embedder.fail_waiting(ShuttingDown("server is shutting down"))

    async def _accept(
        self, listener: trio.SocketListener, handler: _Handler, connections: trio.Nursery, limit: trio.Semaphore
    ) -> None:
        if self.inherited:
            # Until the model is loaded, connections wait in the backlog (or go to our
            # predecessor, which still accepts on the same socket).
            await self.state.ready.wait()
            if self.state.load_failed is not None:
                return
        while True:
            while limit.value == 0:
                await trio.lowlevel.wait_readable(listener.socket)  # a client is waiting
                self._evict()
                # Until a slot is free, look again now and then: the one closed may not go at
                # once (a drained connection whose request had just arrived), and a body may
                # have become slow enough meanwhile.
                with trio.move_on_after(EVICT_AGAIN):
                    await limit.acquire()
                    limit.release()
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

    def _evict(self) -> None:
        """At max_connections, close the connection idle the longest (as nginx reuses idle
        keep-alive connections), so that a flood of idle or slow-header connections cannot keep
        real clients in the backlog until their keep-alive timers run out. With none idle, cut
        the request whose body has been arriving the longest, past ``SLOW_BODY``: a flood of
        slow bodies would otherwise hold every connection for ``--read-timeout``. Connections
        already closing (draining) are not counted."""
        idle = [(c.idle_since, i, c) for i, c in enumerate(self._connections) if c.idle_since is not None]
        if idle:
            min(idle)[2].drain()
            return
        now = trio.current_time()
        slow = [(since, i, c) for i, c in enumerate(self._connections) if (since := c.body_since) is not None]
        if slow and (slowest := min(slow))[0] <= now - SLOW_BODY:
            logger.warning(
                "at --max-connections %d: cut a request whose body has been arriving for %.1f s",
                self.settings.max_connections,
                now - slowest[0],
            )
            slowest[2].abort()

    async def _connection(self, handler: _Handler, stream: trio.SocketStream, limit: trio.Semaphore) -> None:
        connection = handler(stream)
        self._connections.add(connection)
        try:
            if self._stop.is_set():
                connection.drain(ARRIVAL_GRACE)  # accepted as the drain began
            await connection.serve()
        finally:
            self._connections.discard(connection)
            limit.release()

    async def _announce_ready(self) -> None:
        """Once the model is loaded: tell a hot restart's old process (which then tells
        systemd who the main process is), or else systemd, that we serve."""
        await self.state.ready.wait()
        if self.state.load_failed is not None:
            return
        if self.ready_fd is not None:
            restart.report_ready(self.ready_fd)
            self.ready_fd = None
        else:
            sdnotify.notify("READY=1", f"STATUS=serving on {self.address}")
        # What every client's requests need (the request models, the model list), imported now
        # that /health answers rather than before: a request that comes first waits for it.
        try:
            await trio.to_thread.run_sync(import_deferred)
        except Exception:
            logger.exception("importing the request modules failed")

    async def _stop_if_load_fails(self) -> None:
        await self.state.ready.wait()
        if self.state.load_failed is not None:
            self.request_stop()

    async def _drain_deadline(self, connections: trio.CancelScope) -> None:
        with trio.move_on_after(self.settings.drain_timeout):
            await self._force.wait()
        logger.info("drain deadline reached: ending the remaining requests")
        for engine in self.state.engines():
            engine.abort_all(ShuttingDown("server is shutting down"))
        for embedder in self.state.embedders():
            embedder.abort_all(ShuttingDown("server is shutting down"))
            await embedder.idle()  # its decode in progress ends first; then its 503 is written
        deadline = trio.current_time() + FINAL_WRITE_GRACE
        connections.deadline = deadline
        for connection in list(self._connections):
            connection.cut(deadline)  # writes to clients that stopped reading end too

    async def _watch_signals(self) -> None:
        signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
        async with trio.open_nursery() as restarts:
            with trio.open_signal_receiver(*signums) as signals:
                for signum in held_signals.take():  # arrived while the process started
                    self._on_signal(signum, restarts)
                async for signum in signals:
                    self._on_signal(signum, restarts)

    def _on_signal(self, signum: int, restarts: trio.Nursery) -> None:
        if signum == signal.SIGUSR2:
            logger.warning("trio tasks:\n%s", _task_tree(trio.lowlevel.current_root_task()))
            return
        logger.info("received %s", signal.Signals(signum).name)
        if signum == signal.SIGHUP:
            self._start_restart(restarts)
        else:
            self.request_stop()

    def _start_restart(self, nursery: trio.Nursery) -> None:
        if self._stop.is_set():
            logger.info(
                "SIGHUP ignored: process %d is already %s",
                os.getpid(),
                "handing over" if self._handover else "draining",
            )
        elif self._restart is not None:
            logger.info("SIGHUP ignored: a hot restart is already in progress")
        else:
            self._restart = trio.CancelScope()
            nursery.start_soon(self._hot_restart, self._restart)

    async def _hot_restart(self, scope: trio.CancelScope) -> None:
        """Start a new copy on our socket; hand over to it once it is ready, or serve on."""
        me = os.getpid()
        sdnotify.notify("RELOADING=1", sdnotify.monotonic_usec(), "STATUS=hot restart: starting a new process")
        successor = None
        try:
            with scope:
                successor = await restart.start_successor(self.sock.fileno(), self.settings.restart_timeout)
        except restart.RestartFailed as exc:
            logger.error("hot restart failed: %s; process %d keeps serving", exc, me)
            sdnotify.notify("READY=1", f"STATUS=hot restart failed: {exc}")
            return
        finally:
            self._restart = None
        if successor is None or self._stop.is_set():  # told to stop meanwhile: the new one goes too
            if successor is not None:
                successor.kill()
                with trio.CancelScope(shield=True):
                    await successor.wait()
            logger.info("hot restart abandoned: process %d is stopping", me)
            return
        logger.info("hot restart: process %d is ready; process %d hands over and drains", successor.pid, me)
        # Two datagrams, the reload's end first: MAINPID= then comes while the unit is running,
        # the state in which every systemd version takes it.
        sdnotify.notify("READY=1", f"STATUS=serving on {self.address} (process {successor.pid})")
        sdnotify.notify(f"MAINPID={successor.pid}")
        self._successor = successor  # never waited for: it outlives us
        self.request_stop(handover=True)


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


async def serve(settings: Settings) -> None:
    await Service(settings).serve()
