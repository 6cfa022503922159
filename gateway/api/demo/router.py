"""``GET /demo``: the voice page, plain files shipped inside the package.

The page (``static/``) is HTML, CSS and ES modules with no build step; it
speaks the OpenAI Realtime WebSocket (``/v1/realtime``) like any other
client, so this router only serves files. It is mounted only when
``OMNI_GATEWAY_DEMO`` is on (``app.py``), and kept out of the OpenAPI
document: it is a page, not an API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

router = APIRouter(include_in_schema=False)

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
