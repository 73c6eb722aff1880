"""The operators' routes: ``/health`` (the serving phase, for load balancers and orchestrators;
needs no API key), ``/metrics`` (Prometheus), and ``POST /models/load`` and ``/models/unload``
(``{"model": ID}``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from quart import Blueprint, Response

from server.api.errors import ApiError
from server.api.lazy import deferred
from server.api.preflight import model_lease, read_json, resolve
from server.api.respond import current_state, json_response
from server.metrics import CONTENT_TYPE
from server.models.registry import ModelBusy

if TYPE_CHECKING:
    from server.api import model_list
else:  # imported once the server is ready (server.api.lazy)
    model_list = deferred("server.api.model_list")

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
    elif not state.ready.is_set():
        status, code = "loading", 503
    else:
        status, code = "ok", 200
    body: dict[str, object] = {"status": status}
    # The devices llama.cpp found, and each loaded model's layers on them (the first loaded
    # model's under "devices", as with a single model).
    devices = {}
    for spec in state.models.specs:
        runtime = state.models.runtime(spec.id)
        if runtime is not None and runtime.engine is not None and runtime.info is not None:
            devices[spec.id] = [dataclasses.asdict(d) for d in runtime.info.devices]
    if devices:
        body["devices"] = next(iter(devices.values()))
    if len(devices) > 1:
        body["models"] = devices
    return json_response(body, code)


@ops.get("/metrics")
async def metrics() -> Response:
    state = current_state()
    # As llama-server sends it: when this process started (clients compute rates from it).
    headers = {"Process-Start-Time-Unix": str(state.models.created)}
    return Response(state.metrics.render(), content_type=CONTENT_TYPE, headers=headers)


@ops.post("/models/load")
async def load_model() -> Response:
    """Load a model now and answer once it serves (an operator's preload; behind the API key).

    *Cancellation*: the wait ends; the load goes on.
    """
    state = current_state()
    req: model_list.ModelAction = await read_json(model_list.ModelAction)
    lease = await model_lease(state, req.model)
    lease.release()
    return json_response({"model": lease.spec.id, "status": "loaded"})


@ops.post("/models/unload")
async def unload_model() -> Response:
    """Unload a model now; a 409 while requests hold it (never unloaded from under them)."""
    state = current_state()
    req: model_list.ModelAction = await read_json(model_list.ModelAction)
    spec = resolve(state, req.model)
    try:
        unloaded = state.models.unload(spec.id)
    except ModelBusy as exc:
        raise ApiError(409, str(exc), param="model", code="model_busy") from None
    return json_response({"model": spec.id, "status": "unloading" if unloaded else "unloaded"})
