"""The operators' routes: ``/health`` (the serving phase, for load balancers and orchestrators;
needs no API key) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from quart import Blueprint, Response

from server.api.respond import current_state, json_response
from server.metrics import CONTENT_TYPE

PUBLIC = frozenset(["/health", "/v1/health"])  # paths that need no API key

ops = Blueprint("ops", __name__)


@ops.get("/health")
@ops.get("/v1/health")  # llama-server answers here too
async def health() -> Response:
    state = current_state()
    if state.draining:
        status, code = "draining", 503
    elif state.load_failed is not None:
        status, code = "model_load_failed", 503
    elif state.engine is None:
        status, code = "loading", 503
    else:
        status, code = "ok", 200
    return json_response({"status": status}, code)


@ops.get("/metrics")
async def metrics() -> Response:
    state = current_state()
    # As llama-server sends it: when this process started (clients compute rates from it).
    headers = {"Process-Start-Time-Unix": str(state.created)}
    return Response(state.metrics.render(), content_type=CONTENT_TYPE, headers=headers)
