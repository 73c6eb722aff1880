"""A rolling restart behind a real nginx (``deploy/nginx.conf``): two replicas, clients running
through nginx, each replica stopped with SIGTERM and started again on its port in turn. No
client may see a failed request or a malformed stream.

What makes it work: a draining replica refuses new connections and answers what it has
accepted; nginx retries a request on the other replica when its connection is refused or
dropped before an answer, or the answer is our 503 (``deploy/nginx.conf`` says why that is
safe for a POST).
"""

from __future__ import annotations

import pathlib

import httpx
import pytest

from tests.support.load import Load
from tests.support.nginx import Nginx
from tests.support.ports import free_port
from tests.support.process import ServerProcess
from tests.support.restarts import restart_in_place
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.server, pytest.mark.nginx]

GUARD = 60.0


# One sequence per replica and four clients on two replicas: at each SIGTERM a request is nearly
# always queued behind a running one (a queued stream must then still be answered).
REPLICA = ["--threads", "1", "--parallel", "1", "--ctx-size", "512", "--drain-timeout", "20"]


def served(proc: ServerProcess) -> float:
    """Chat completions this replica has answered with 200."""
    return sum(
        value
        for name, value in proc.metrics().items()
        if name.startswith("llama_trio_requests_total{") and "chat" in name and "status=200" in name
    )


# nginx's error log line when an upstream's port is closed.
REFUSED = "while connecting to upstream"


def test_rolling_restart_behind_nginx_fails_no_request(tmp_path: pathlib.Path) -> None:
    ports = [free_port(), free_port()]
    replicas = [ServerProcess(REPLICA, port=port) for port in ports]
    try:
        for proc in replicas:
            proc.wait_ready()
        with Nginx(tmp_path, free_port(), ports) as nginx:
            assert httpx.get(nginx.url + "/health", timeout=GUARD).json()["status"] == "ok"
            with Load(nginx.url, clients=4) as load:
                load.wait_for_answers(8, GUARD)
                for i in range(len(replicas)):
                    # The scenario: nginx meets the replica down (its port closed) and moves on.
                    met = nginx.error_log.read_text().count(REFUSED)
                    replicas[i] = restart_in_place(
                        replicas[i],
                        REPLICA,
                        GUARD,
                        while_down=lambda met=met: nginx.error_log.read_text().count(REFUSED) > met,
                    )
                    load.wait_for_answers(8, GUARD)
                wait_for(lambda: all(served(proc) for proc in replicas), "both new replicas to serve", GUARD)
            tally = load.tally
        assert nginx.error_log.read_text().count(REFUSED) >= len(replicas)
        for proc in replicas:
            assert proc.stop() == 0
    finally:
        for proc in replicas:
            proc.__exit__(None, None, None)
    print(tally)
    assert tally.refused == 0, tally
    assert tally.failures == [], tally
    assert tally.answered >= 24 and tally.streamed > 0
    for proc in replicas:
        assert "Traceback" not in proc.log, proc.log[-5000:]
