"""The chat page: ``GET /`` and its assets under ``/webui/``, static files shipped as package
data in ``server/webui/`` (no build step, nothing from another host).

The files are read once, when the app is made, so serving them never touches the disk on the
event loop. Every answer carries a Content-Security-Policy that allows scripts, styles and
``fetch`` from this origin only and nothing inline (no inline script, no event-handler
attributes, no ``eval``), and Trusted Types with no policy, so assigning a string to
``innerHTML`` throws: model output can only ever become text. The page and its assets need no
API key (they hold no secret); the API routes they call do.
"""

from __future__ import annotations

from importlib import resources

from quart import Response
from quart_trio import QuartTrio

from server.api.errors import ApiError

# The page at / and its assets at /webui/<name>; anything else under /webui/ is a 404.
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
PAGE = "index.html"
ASSET_PREFIX = "/webui/"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",  # data: for the empty favicon (no request for /favicon.ico)
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate on every load, so a new server version's page is never mixed with old assets.
    "Cache-Control": "no-cache",
}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of ``server/webui/`` with a known type: name -> (bytes, content type)."""
    assets = {}
    for entry in (resources.files("server") / "webui").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            assets[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    if PAGE not in assets:
        raise RuntimeError(f"server/webui/{PAGE} is missing from the installed package")
    return assets


def add_webui(app: QuartTrio) -> frozenset[str]:
    """Serve the page at ``/`` and its assets under ``/webui/``; returns the paths that need no
    API key."""
    assets = load_assets()

    def answer(name: str) -> Response:
        body, content_type = assets[name]
        return Response(body, content_type=content_type, headers=SECURITY_HEADERS)

    @app.get("/")
    async def page() -> Response:
        return answer(PAGE)

    @app.get(ASSET_PREFIX + "<name>")
    async def asset(name: str) -> Response:
        if name == PAGE or name not in assets:
            raise ApiError(404, f"no route for {ASSET_PREFIX}{name}", code="not_found")
        return answer(name)

    return frozenset(["/"] + [ASSET_PREFIX + name for name in assets if name != PAGE])
