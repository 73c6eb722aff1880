"""Whether a request stalls the event loop: ``/health``'s latencies while it is prepared."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from tests.support.process import ServerProcess


def health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            out.append(time.monotonic() - started)
            time.sleep(0.01)


def health_while(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[float]]:
    """``body``'s answer, and how long each ``/health`` took while it was prepared."""
    data = json.dumps(body).encode()
    assert len(data) < 4 * 1024 * 1024  # under the body limit
    latencies: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=health_latencies, args=(server.url, stop, latencies))
    prober.start()
    try:
        time.sleep(0.2)
        headers = {"Content-Type": "application/json"}
        response = httpx.post(server.url + path, content=data, headers=headers, timeout=120)
    finally:
        stop.set()
        prober.join()
    assert len(latencies) >= 5
    return response, latencies
