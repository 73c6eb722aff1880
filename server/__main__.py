"""``llama-trio`` / ``python -m server``: parse settings, serve until SIGTERM or SIGINT (SIGHUP:
hot restart).

The start is ordered for speed: the command line is parsed first (``--help`` and ``--version``
answer without loading anything), then the listener is opened (a busy port fails before anything
expensive), then the models loaded at start begin loading in threads of their own
(``EarlyLoads``), and only then are the server's modules imported: the import, about 0.3 s of
Python, and llama.cpp's load, which runs without the GIL, overlap.
"""

from __future__ import annotations

import signal

from server.serve import held_signals

# From here on a SIGHUP is held for the lifecycle (a hot restart asked while the process still
# starts), not left to its default action; only the interpreter's own start comes before.
held_signals.hold(signal.SIGHUP)

import faulthandler
import gc
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.settings import Settings, parse_settings

if TYPE_CHECKING:
    from server.models.loading import EarlyLoads


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while it starts (once it serves, the lifecycle drains)
        print("llama-trio: interrupted while starting", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    settings = parse_settings(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
    )
    if not settings.verbose:
        logging.getLogger("llama_trio.llama_cpp").setLevel(logging.WARNING)
    # Start-up makes objects that live as long as the process: no collections while it does,
    # and none of them scanned again afterwards (gc.freeze).
    gc.disable()
    from server.net.listener import ListenError, inherited_socket, open_listener

    try:
        sock = inherited_socket(settings.fd, os.environ)
        inherited = sock is not None
        sock = sock or open_listener(settings.host, settings.port, reuse_port=settings.reuse_port)
    except ListenError as exc:
        print(f"llama-trio: {exc}", file=sys.stderr)
        return 2
    # The binding (llama.cpp's backends: a GPU's initialisation) only once the port is ours.
    from server.model_files import DefaultModelMissing
    from server.models.loading import EarlyLoads
    from server.models.specs import ModelSpecError

    try:
        early = EarlyLoads.begin(settings)
    except (DefaultModelMissing, ModelSpecError) as exc:
        sock.close()
        print(f"llama-trio: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(settings, sock, inherited, early)
    finally:
        early.close()


def _serve(settings: Settings, sock: socket.socket, inherited: bool, early: EarlyLoads) -> int:
    import trio

    from server.serve.lifecycle import Service
    from server.serve.restart import take_ready_fd
    from server.state import TemplateFileError
    from server.store import StoreError

    ready_fd = take_ready_fd(os.environ)  # set when we are a hot restart's new process
    try:
        service = Service(settings, sock, inherited=inherited, ready_fd=ready_fd, early=early)
    except (TemplateFileError, StoreError) as exc:
        print(f"llama-trio: {exc}", file=sys.stderr)
        return 2
    gc.enable()
    gc.freeze()
    host = service.sock.getsockname()[0]
    if not ipaddress.ip_address(host).is_loopback and not settings.api_keys():
        logging.getLogger("llama_trio").warning(
            "listening on %s without an API key: anyone who can reach it may use it", host
        )
    trio.run(service.serve)
    if service.state.load_failed is not None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
