"""``GET /demo``: the voice page, plain files shipped inside the package.

The page (``static/``) is HTML, CSS and ES modules with no build step; it
speaks the OpenAI Realtime protocol like any other client: a WebRTC call
(``/v1/realtime/calls``) by default, the WebSocket (``/v1/realtime``) as the
fallback. Besides its files this router has one endpoint of the page's own,
``POST /demo/client_secret``: the browser never holds an API key, so the
page's "backend" mints it a short-lived client secret. That is the pattern
an app copies, with one difference: an app mints for the user it has
authenticated; the page, which has no users, mints for one ``demo``
identity, whose limits every visitor shares. It is mounted only when
``OMNI_GATEWAY_DEMO`` is on (``app.py``), and kept out of the OpenAPI
document: it is a page, not an API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from gateway.web.client_secrets import mint
from gateway.web.resources import get_resources

router = APIRouter(include_in_schema=False)

#: Whose the page's calls are: every visitor's conversation counts against this identity's limits.
DEMO_IDENTITY = "demo"
#: The page uses its secret at once; a minute covers a slow call set-up.
SECRET_TTL_SEC = 60

#: The page's files and their types; nothing else under /demo is served.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "demo.css": "text/css; charset=utf-8",
    "demo.js": "text/javascript; charset=utf-8",
    "pcm.js": "text/javascript; charset=utf-8",
    "player.js": "text/javascript; charset=utf-8",
    "capture-worklet.js": "text/javascript; charset=utf-8",
}


def _static() -> Path:
    # A real directory: the package is installed as files (wheel or editable), never zipped.
    return Path(str(resources.files("gateway.api.demo") / "static"))


def _serve(name: str) -> Callable[[], Awaitable[FileResponse]]:
    async def serve() -> FileResponse:
        # FileResponse reads in a worker thread; no-cache: a new gateway's page is picked up on reload.
        return FileResponse(_static() / name, media_type=FILES[name], headers={"Cache-Control": "no-cache"})
    return serve


# One route per file, so any other name under /demo is the app's ordinary 404.
router.add_api_route("/demo", _serve("index.html"), methods=["GET"])
for _name in FILES:
    router.add_api_route(f"/demo/{_name}", _serve(_name), methods=["GET"])


@router.post("/demo/client_secret")
async def client_secret(request: Request) -> dict[str, object]:
    """A client secret for the page's next connection (OpenAI's ``value`` and ``expires_at``)."""
    resources = get_resources(request)
    settings = resources.settings
    if settings.rate_limit_rps > 0:  # each secret is one request of the demo identity's rate
        await resources.store.take_token(DEMO_IDENTITY, settings.rate_limit_rps, settings.token_burst)
    value, record = await mint(resources.store, DEMO_IDENTITY, None, SECRET_TTL_SEC)
    return {"value": value, "expires_at": record.expires_at}
