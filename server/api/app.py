"""``create_app``: the HTTP API as a Quart-Trio app, composed of its parts: the middleware and
error handlers (``middleware``), one blueprint per API family (``openai``; llama.cpp's own
``native``; the operators' ``ops``), and the chat page (``webui``) unless ``--no-webui``. No globals: the app's
``ServerState`` is in its extensions (``respond.current_state``).
"""

from __future__ import annotations

from quart_trio import QuartTrio

from server.api import middleware
from server.api.anthropic import anthropic
from server.api.native import native
from server.api.openai import openai
from server.api.ops import PUBLIC, ops
from server.api.respond import STATE_KEY
from server.api.responses import responses
from server.api.webui import add_webui
from server.settings import Settings, settings_from_env
from server.state import ServerState


def create_app(settings: Settings | None = None, *, state: ServerState | None = None) -> QuartTrio:
    """The app. With ``state``, the caller (``server.serve.lifecycle``) runs the engine; without,
    the app loads the model and runs the engine in its own lifespan (the hypercorn CLI launch)."""
    owns_engine = state is None
    if state is None:
        state = ServerState(settings or settings_from_env())
    app = QuartTrio(__name__)
    app.config.update(
        RESPONSE_TIMEOUT=None,  # streams have no hidden time limit
        BODY_TIMEOUT=state.settings.read_timeout,
        MAX_CONTENT_LENGTH=state.settings.max_body,
    )
    app.extensions[STATE_KEY] = state
    public = PUBLIC | (frozenset() if state.settings.no_webui else add_webui(app))
    middleware.install(app, state, public)
    app.register_blueprint(ops)
    app.register_blueprint(openai)
    app.register_blueprint(responses)
    app.register_blueprint(anthropic)
    app.register_blueprint(native)
    if owns_engine:
        _run_models_in_lifespan(app, state)
    return app


def _run_models_in_lifespan(app: QuartTrio, state: ServerState) -> None:
    @app.before_serving
    async def start_models() -> None:
        await app.nursery.start(state.run_store)
        await app.nursery.start(state.run_models)

    @app.after_serving
    async def stop_models() -> None:
        # Hypercorn has closed its connections by now (see docs/lifecycle.md).
        state.draining = True
        state.stop_models()
