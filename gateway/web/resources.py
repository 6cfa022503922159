"""Typed access to what the lifespan opened (no untyped ``app.state`` bag)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway.metrics import Metrics
from gateway.service.sessions import SessionService
from gateway.settings import Settings
from gateway.store.redis_store import SessionStore
from gateway.web.client_secrets import bearer_secret, redeem
from gateway.web.identity import IdentityResolver
from gateway.work.draining import Draining
from omni_adapter.port import Engine


@dataclass(frozen=True)
class Resources:
    """Everything the lifespan yields; requests reach it as ``request.state.resources``."""

    settings: Settings
    store: SessionStore
    engine: Engine
    service: SessionService
    metrics: Metrics
    identity: IdentityResolver
    draining: Draining
    #: The background task that expires sessions and claims ownerless work;
    #: in an API worker (which does neither), the watch on its engine process.
    tender: asyncio.Task[None]


def get_resources(request: Request) -> Resources:
    # The lifespan's state as the server copied it into the scope: the same
    # object ``request.state.resources`` returns, without building a State
    # per request (every request asks for it).
    resources: Resources = request.scope["state"]["resources"]
    return resources


#: Where ``middleware/authentication.py`` leaves the caller's identity in the request's state,
IDENTITY = "identity"
#: and the session configuration of the client secret it came with, if it came with one.
CLIENT_SESSION = "client_session"


@dataclass(frozen=True)
class Caller:
    identity: str
    #: A client secret's session configuration (``web/client_secrets.py``); ``None`` for other credentials.
    session: dict[str, Any] | None = None


async def resolve_caller(resources: Resources, headers: Mapping[str, str], peer: str | None, *,
                         client_secret_ok: bool) -> Caller:
    """Who calls (401 without valid credentials): a client secret where one is accepted, else the resolver's way."""
    value = bearer_secret(headers) if client_secret_ok else None
    if value is not None:
        record = await redeem(resources.store, value)
        return Caller(record.identity, record.session)
    return Caller(resources.identity.resolve(headers, peer))


async def authenticate(resources: Resources, headers: Mapping[str, str], peer: str | None, *,
                       client_secret_ok: bool = False) -> Caller:
    """The caller (401 without valid credentials), charged one request (429)."""
    caller = await resolve_caller(resources, headers, peer, client_secret_ok=client_secret_ok)
    settings = resources.settings
    if settings.rate_limit_rps > 0:
        await resources.store.take_token(caller.identity, settings.rate_limit_rps, settings.token_burst)
    return caller


async def get_identity(request: Request) -> str:
    """The identity the authentication middleware found for this call, before its body was read."""
    identity: str | None = request.scope["state"].get(IDENTITY)
    if identity is None:  # an app without the middleware (it covers every /v1/ call)
        identity = (await authenticate(get_resources(request), request.headers,
                                       request.client.host if request.client else None)).identity
    return identity


# FastAPI runs a plain ``def`` dependency in its threadpool: a thread hop per
# request and dependency (measured: a quarter of the append path's event-loop
# time). These only read an attribute, so they are ``async def``.


async def get_service(request: Request) -> SessionService:
    return get_resources(request).service


async def get_settings(request: Request) -> Settings:
    return get_resources(request).settings
