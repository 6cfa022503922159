"""Short-lived Realtime client secrets: what a browser holds instead of an API key.

An app's backend, authenticated with its real credentials, asks
``POST /v1/realtime/client_secrets`` for a secret (``ek_...``) and hands it to
the browser. Until it expires, the secret authenticates ``/v1/realtime`` (the
WebSocket) and ``/v1/realtime/calls`` (WebRTC) as the identity that minted it,
and the connection starts with the session configuration given at minting.
It authenticates nothing else: a leaked secret can hold a conversation for a
few minutes, not read sessions or call the API.

The record lives in Redis under the secret's digest with the secret's TTL, so
every replica honours it and nobody has to sweep expired ones; this module is
the only one that writes or reads it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gateway import errors
from gateway.store.redis_store import SessionStore

#: OpenAI's prefix for ephemeral keys; a bearer token with it is looked up here, not among the API keys.
PREFIX = "ek_"


@dataclass(frozen=True)
class ClientSecret:
    #: The identity that minted it: the conversation is that caller's (its limits, its sessions).
    identity: str
    #: The session configuration a connection made with it starts from (a ``session.update`` body).
    session: dict[str, Any] | None
    #: Unix seconds.
    expires_at: int


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def bearer_secret(headers: Mapping[str, str]) -> str | None:
    """The client secret in ``Authorization: Bearer``, if the token is one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token.startswith(PREFIX) else None


async def mint(store: SessionStore, identity: str, session: dict[str, Any] | None,
               ttl_sec: int) -> tuple[str, ClientSecret]:
    """A new secret (its value, shown once) and its record, stored until it expires."""
    value = PREFIX + secrets.token_urlsafe(32)
    record = ClientSecret(identity, session, int(time.time()) + ttl_sec)
    await store.save_client_secret(_digest(value), json.dumps(asdict(record)), ttl_sec)
    return value, record


async def redeem(store: SessionStore, value: str) -> ClientSecret:
    """The record of a live secret; an expired, forged or unknown one is 401."""
    raw = await store.load_client_secret(_digest(value))
    record = ClientSecret(**json.loads(raw)) if raw else None
    # Redis drops the key at expiry; the time check covers the last moment before it does.
    if record is None or record.expires_at <= time.time():
        raise errors.InvalidApiKey("the client secret is not valid or has expired")
    return record
