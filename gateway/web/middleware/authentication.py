"""Who is calling, before any body is read.

A route that declares a body (create, finish, chat, an append) would read it
first and only then ask who sends it, so a caller without credentials could
hold a socket and a call's worth of the process for as long as its body
took to trickle in. Here every ``/v1/`` call is authenticated (401) and
charged to its identity's request budget (429) from its headers alone; the
route finds the identity in the scope (``web/resources.py``'s
``get_identity``). WebSockets authenticate in their own handshake. A Realtime client secret
(``web/client_secrets.py``) is taken only where a browser opens a call.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import errors
from gateway.web.error_handlers import render_error
from gateway.web.resources import CLIENT_SESSION, IDENTITY, authenticate

#: The calls that need an identity: the API, not the probes, the docs or the demo page.
API_PREFIX = "/v1/"
#: The calls a browser makes with a client secret instead of a key (WebRTC's signalling).
CLIENT_SECRET_PATHS = ("/v1/realtime/calls",)


class AuthenticationMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        resources = scope["state"]["resources"]
        client = scope.get("client")
        try:
            caller = await authenticate(resources, Headers(scope=scope), client[0] if client else None,
                                        client_secret_ok=scope["path"].startswith(CLIENT_SECRET_PATHS))
        except errors.GatewayError as exc:
            resources.metrics.errors.labels(exc.code).inc()
            await render_error(exc, send)
            return
        scope["state"][IDENTITY] = caller.identity
        scope["state"][CLIENT_SESSION] = caller.session
        await self.app(scope, receive, send)
