"""A real nginx (Debian's package) in front of test replicas, run from ``deploy/nginx.conf``.

The deployment's own file is used, with its replica addresses and listening port replaced,
inside a minimal main configuration whose pid file, logs and temporary files are in a temporary
directory. nginx runs in the foreground as a child of the test (``daemon off``), with one
worker. ``make test`` installs nginx when it is missing.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence

from tests.support.needs import needs
from tests.support.process import ROOT
from tests.support.waiting import wait_for

DEPLOY_CONF = ROOT / "deploy" / "nginx.conf"
_REPLICA = re.compile(r"^(\s*server )127\.0\.0\.1:\d+( .*;)$", re.MULTILINE)
_LISTEN = re.compile(r"^(\s*listen )\d+;$", re.MULTILINE)


def nginx_binary() -> str:
    """nginx's path (Debian puts it in /usr/sbin, which a user's PATH may lack)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise AssertionError("nginx is not installed: `make test` installs it (apt-get install nginx)")
    return found


def site_conf(port: int, replicas: Sequence[int]) -> str:
    """``deploy/nginx.conf`` listening on 127.0.0.1:``port`` with ``replicas`` as its upstream
    (each with the parameters of the file's first replica line)."""
    text = DEPLOY_CONF.read_text()
    lines = list(_REPLICA.finditer(text))
    assert lines, "no `server 127.0.0.1:PORT ...;` line in deploy/nginx.conf"
    prefix, parameters = lines[0].group(1), lines[0].group(2)
    ours = "\n".join(f"{prefix}127.0.0.1:{replica}{parameters}" for replica in replicas)
    text = text[: lines[0].start()] + ours + _REPLICA.sub("", text[lines[0].end() :])
    text, count = _LISTEN.subn(rf"\g<1>127.0.0.1:{port};", text)
    assert count == 1, "deploy/nginx.conf should have one `listen PORT;`"
    return text


class Nginx:
    """``with Nginx(directory, port, replicas) as nginx:`` runs nginx until the block ends."""

    def __init__(self, directory: pathlib.Path, port: int, replicas: Sequence[int]) -> None:
        self.directory = directory
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        (directory / "llama-trio.conf").write_text(site_conf(port, replicas))
        temp = "\n".join(
            f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        # As root, nginx would run its worker as `nobody`, which cannot enter a private
        # temporary directory; the worker runs as the test's user instead.
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        (directory / "nginx.conf").write_text(
            f"{user}worker_processes 1;\npid {directory / 'nginx.pid'};\nerror_log {self.error_log} notice;\n"
            f"events {{\n    worker_connections 512;\n}}\n"
            f"http {{\n    log_format upstreams '$status $request_time $upstream_addr $upstream_status';\n"
            f"    access_log {directory / 'access.log'} upstreams;\n{temp}\n"
            f"    include {directory / 'llama-trio.conf'};\n}}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def error_log(self) -> pathlib.Path:
        return self.directory / "error.log"

    def __enter__(self) -> Nginx:
        needs("nginx", "nginx")
        argv = [nginx_binary(), "-p", str(self.directory), "-c", str(self.directory / "nginx.conf")]
        argv += ["-e", str(self.error_log), "-g", "daemon off;"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        wait_for(self._listening, "nginx to listen", 30)
        return self

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"nginx exited with {self.proc.returncode}:\n{self.error_log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except ConnectionRefusedError:
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: the workers finish what they serve
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
