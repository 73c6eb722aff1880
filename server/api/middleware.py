"""What runs around every route: the request-head limit, the refusal of ambiguous framing and
of WebSockets, API keys (each key its own cache tenant), CORS, the request counter, and the
error handlers that turn anything raised into an answer in the route's shape.

``install(app, state, public)``; nothing here is global.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re

from quart import Response, g, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from server.api.errors import ApiError
from server.net.transport import current_transport
from server.settings import Settings
from server.state import ServerState

logger = logging.getLogger("llama_trio.access")

# CORS: what a preflight allows when it names no headers, and the shape of a header list we
# reflect (header names as RFC 9110 tokens, comma-separated; anything else gets the default).
CORS_DEFAULT_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, Anthropic-Beta"
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_MAX_AGE = "600"
_HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(?:[ \t]*,[ \t]*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")
MAX_CORS_HEADER_LIST = 2048
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}


def install(app: QuartTrio, state: ServerState, public: frozenset[str]) -> None:
    """Add the middleware and error handlers to ``app``; ``public`` paths need no API key."""
    settings = state.settings
    _install_guards(app, settings)
    _install_same_origin(app, settings)
    _install_auth(app, settings, public)
    _install_continue(app, settings)
    _install_finish(app, state)
    _install_error_handlers(app, settings)


def _install_guards(app: QuartTrio, settings: Settings) -> None:
    @app.before_request
    async def limit_head() -> Response | None:
        # h11 bounds only a head that arrives in pieces; one that comes in a single read is
        # parsed whole, so the limit is checked here too.
        scope = request.scope
        head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        size = head + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > settings.max_header_size:
            message = f"request headers are larger than {settings.max_header_size} bytes"
            return ApiError(431, message, code="request_header_too_large", headers={"Connection": "close"}).response()
        return None

    @app.before_request
    async def refuse_ambiguous_length() -> Response | None:
        # RFC 9112 6.1: a message with both may be an attempt at request smuggling; it is
        # answered and the connection closed, so nothing sent after it is read as a request.
        headers = request.headers
        if "Content-Length" in headers and "Transfer-Encoding" in headers:
            message = "a request may not have both Content-Length and Transfer-Encoding"
            return ApiError(400, message, code="invalid_request", headers={"Connection": "close"}).response()
        return None

    @app.before_websocket
    async def refuse_websocket() -> Response:
        message = 'WebSocket is not served; stream a completion with POST and "stream": true (Server-Sent Events)'
        return ApiError(400, message, code="unsupported_protocol").response()


# Methods that change something: a browser page of another origin may not send them. A page
# can POST without a preflight (a text/plain body), and CORS only keeps it from reading the
# answer: without a key, any website its user visits could load, unload, queue and save here.
_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _install_same_origin(app: QuartTrio, settings: Settings) -> None:
    cors = set(settings.cors_origin)

    @app.before_request
    async def refuse_other_sites() -> None:
        if request.method not in _WRITES:
            return
        origin = request.headers.get("Origin")
        if origin is not None and _allowed_origin(origin, cors):
            return
        # Browsers say where a request comes from (Fetch Metadata); one that does not, its
        # Origin against the Host it was sent to. A client that is no browser sends neither.
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None:
            ok = site in {"same-origin", "none"}
        else:
            ok = origin is None or origin.partition("://")[2] == request.headers.get("Host", "")
        if not ok:
            message = f"a request from another site ({origin or site}) is refused; allow its origin with --cors-origin"
            raise ApiError(403, message, type_="permission_error", code="cross_origin_refused")


def _allowed_origin(origin: str, cors: set[str]) -> bool:
    return "*" in cors or origin in cors or ("localhost" in cors and _local(origin))


# What only an operator's key may do once --admin-key names one: every tenant's models go.
OPERATOR_PATHS = frozenset({"/models/load", "/models/unload"})


def _install_auth(app: QuartTrio, settings: Settings, public: frozenset[str]) -> None:
    admin_keys = frozenset(settings.admin_key)
    api_keys = settings.api_keys()

    @app.before_request
    async def authenticate() -> Response | None:
        if not api_keys or request.path in public or request.method == "OPTIONS":
            return None
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
        given_bytes = given.encode()
        if not _one_of(given_bytes, api_keys):  # raised, so that the route's own error shape renders it
            message = "invalid API key" if given else "missing API key (Authorization: Bearer <key>)"
            raise ApiError(401, message, type_="authentication_error", code="invalid_api_key")
        if admin_keys and request.path in OPERATOR_PATHS and not _one_of(given_bytes, admin_keys):
            message = f"{request.path} needs an operator's key (--admin-key)"
            raise ApiError(403, message, type_="permission_error", code="insufficient_permissions")
        # Each key is its own tenant for the prefix and grammar caches (prepare.cache_scope).
        g.tenant = hashlib.sha256(given_bytes).hexdigest()
        return None


def _one_of(given: bytes, keys: frozenset[str]) -> bool:
    ok = False
    for key in keys:  # constant time per key; every key is checked
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def _install_continue(app: QuartTrio, settings: Settings) -> None:
    @app.before_request
    async def send_continue() -> None:
        # After the checks a head alone can fail (they run first): a client that waits for
        # ``100 Continue`` sends its body only now. Not for a body over --max-body (its 413
        # follows).
        transport = current_transport.get()
        length = request.content_length
        if transport is not None and (length is None or length <= settings.max_body):
            transport.send_continue()


def _install_finish(app: QuartTrio, state: ServerState) -> None:
    cors = set(state.settings.cors_origin)

    @app.after_request
    async def finish(response: Response) -> Response:
        if cors:
            _add_cors(response, cors)
        transport = current_transport.get()
        if transport is not None and transport.closing:
            # A pooled client would send its next request on this connection as it closes
            # (the drain's lingering close reads and drops it): tell it to open a new one.
            response.headers["Connection"] = "close"
        if request.method == "OPTIONS" and request.url_rule is not None and "Allow" in response.headers:
            response.headers["Allow"] = _allowed(app, request.url_rule.rule)
        rule = request.url_rule.rule if request.url_rule else "unmatched"
        state.metrics.requests.labels(rule, str(response.status_code)).inc()
        return response


def _allowed(app: QuartTrio, rule: str) -> str:
    """The methods ``rule`` answers, for OPTIONS' ``Allow``: routing's own list counts those of
    the routes that only give other methods a 405 in their family's error shape (endpoints
    named ``wrong_method...``: ``anthropic``, ``native``)."""
    methods: set[str] = set()
    for other in app.url_map.iter_rules():
        if other.rule == rule and not other.endpoint.rpartition(".")[2].startswith("wrong_method"):
            methods |= other.methods or set()
    return ", ".join(sorted(methods))


def _add_cors(response: Response, cors: set[str]) -> None:
    # Caches must key on the origin whenever the answer can depend on it.
    response.vary.add("Origin")
    origin = request.headers.get("Origin")
    if not origin or not _allowed_origin(origin, cors):
        return
    response.headers["Access-Control-Allow-Origin"] = "*" if "*" in cors else origin
    requested = request.headers.get("Access-Control-Request-Headers", "").strip()
    if requested and len(requested) <= MAX_CORS_HEADER_LIST and _HEADER_LIST.fullmatch(requested):
        # The official SDKs send their own headers (x-stainless-*) from a browser.
        response.headers["Access-Control-Allow-Headers"] = requested
        response.vary.add("Access-Control-Request-Headers")
    else:
        response.headers["Access-Control-Allow-Headers"] = CORS_DEFAULT_HEADERS
    response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
    if request.method == "OPTIONS":
        response.headers["Access-Control-Max-Age"] = CORS_MAX_AGE


def _local(origin: str) -> bool:
    """An origin on this machine (``--cors-origin localhost``, as llama-server's keyword)."""
    scheme, _, rest = origin.partition("://")
    host = rest.rsplit(":", 1)[0] if not rest.endswith("]") else rest
    return scheme in {"http", "https"} and host in {"localhost", "127.0.0.1", "[::1]"}


def _install_error_handlers(app: QuartTrio, settings: Settings) -> None:
    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return exc.response()

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return as_api_error(exc, settings.max_body).response()

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        return as_api_error(exc, settings.max_body).response()


def as_api_error(exc: Exception, max_body: int) -> ApiError:
    """Anything a route raised as the ``ApiError`` to answer (a dialect renders it in its own
    shape): itself, an HTTP error (404, 405, 408, 413...), or a 500 for anything else (a bug,
    logged with its traceback)."""
    if isinstance(exc, ApiError):
        return exc
    method, path = _method_and_path()
    if not isinstance(exc, HTTPException):
        logger.exception("unhandled error on %s %s", method, path, exc_info=exc)
        return ApiError(500, "internal server error", type_="server_error", code="internal_error")
    status = exc.code or 500
    message = {
        404: f"no route for {path}",
        405: f"{method} is not allowed on {path}",
        413: f"request body is larger than {max_body} bytes",
    }.get(status, exc.description or exc.name)
    type_ = "invalid_request_error" if status < 500 else "server_error"
    headers = {}
    if status in {408, 413}:  # the body was not read (whole): no other request can follow
        headers["Connection"] = "close"
    allow = dict(exc.get_headers()).get("Allow")
    if allow:  # 405: RFC 9110 15.5.6 (in the order OPTIONS' Allow has)
        headers["Allow"] = ", ".join(sorted(m.strip() for m in allow.split(",")))
    return ApiError(status, message, type_=type_, code=_HTTP_CODES.get(status), headers=headers)


def _method_and_path() -> tuple[str, str]:
    """The current request's method and path, for messages; also outside a request context."""
    if has_request_context():
        return request.method, request.path
    return "?", "?"
