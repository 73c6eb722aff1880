"""``llama-trio`` / ``python -m server``: parse settings, serve until SIGTERM or SIGINT (SIGHUP:
hot restart).

The server's modules (and with them the llama.cpp binding) are imported after the command line
is parsed, so ``--help`` and ``--version`` answer without loading them.
"""

from __future__ import annotations

import faulthandler
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Sequence

from server.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)

    import trio

    from server.model_files import DefaultModelMissing
    from server.models.specs import ModelSpecError
    from server.net.listener import ListenError, inherited_socket
    from server.serve.lifecycle import Service
    from server.serve.restart import take_ready_fd
    from server.state import TemplateFileError
    from server.store import StoreError

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
    )
    if not settings.verbose:
        logging.getLogger("llama_trio.llama_cpp").setLevel(logging.WARNING)
    ready_fd = take_ready_fd(os.environ)  # set when we are a hot restart's new process
    try:
        sock = inherited_socket(settings.fd, os.environ)
        service = Service(settings, sock, inherited=sock is not None, ready_fd=ready_fd)
    except (ListenError, DefaultModelMissing, TemplateFileError, ModelSpecError, StoreError) as exc:
        print(f"llama-trio: {exc}", file=sys.stderr)
        return 2
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
