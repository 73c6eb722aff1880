"""The operators' routes: ``/health`` (the serving phase, for load balancers and orchestrators;
needs no API key) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import dataclasses

from quart import Blueprint, Response

from server.api.respond import current_state, json_response
from server.metrics import CONTENT_TYPE

PUBLIC = frozenset(["/health"])  # paths that need no API key

ops = Blueprint("ops", __name__)


@ops.get("/health")
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
    body: dict[str, object] = {"status": status}
    if state.info is not None:  # the devices llama.cpp found, and the model's layers on each
        body["devices"] = [dataclasses.asdict(d) for d in state.info.devices]
    return json_response(body, code)


@ops.get("/metrics")
async def metrics() -> Response:
    return Response(current_state().metrics.render(), content_type=CONTENT_TYPE)
