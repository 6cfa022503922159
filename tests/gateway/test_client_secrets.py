"""Realtime client secrets: minted with a key by the official SDK, used by a browser-like client.

Real Redis holds the secrets (so any replica honours them), and the openai
SDK both mints them (``client.realtime.client_secrets.create``) and connects
with one as its API key, as a browser app's backend and page would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
import websockets

from gateway.store.keys import client_secret
from omni_adapter.scripted import ScriptedEngine
from omni_adapter.talker import with_talker
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import TEXT_ONLY, answer_text, sdk, text_turn, until

KEY = "sk-backend"


@pytest.fixture
async def keyed(redis_url: str) -> AsyncIterator[str]:
    async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), ScriptedEngine()) as url:
        yield url


async def mint(url: str, **body: Any) -> Any:
    return await sdk(url, api_key=KEY).realtime.client_secrets.create(**body)


async def test_a_secret_opens_a_realtime_connection_with_its_session(keyed: str) -> None:
    secret = await mint(keyed, expires_after={"anchor": "created_at", "seconds": 120},
                        session={**TEXT_ONLY, "model": "scripted", "instructions": "Be brief."})
    assert secret.value.startswith("ek_")
    assert secret.session.instructions == "Be brief."
    async with sdk(keyed, api_key=secret.value).realtime.connect(model="scripted") as connection:
        created = (await until(connection, "session.created"))[-1]
        assert created["session"]["instructions"] == "Be brief."
        assert created["session"]["output_modalities"] == ["text"]
        assert answer_text(await text_turn(connection, "hello")).endswith("hello")
    # A browser's way: the secret in the subprotocol.
    async with websockets.connect(keyed.replace("http", "ws") + "/v1/realtime", subprotocols=[
            "realtime", f"openai-insecure-api-key.{secret.value}"]) as ws:  # type: ignore[list-item]
        assert json.loads(await ws.recv())["session"]["instructions"] == "Be brief."


async def test_the_secret_lives_in_redis_as_a_digest_with_its_ttl(keyed: str, redis_url: str) -> None:
    secret = await mint(keyed, expires_after={"anchor": "created_at", "seconds": 60})
    redis = aioredis.Redis.from_url(redis_url)
    try:
        key = client_secret(hashlib.sha256(secret.value.encode()).hexdigest())
        assert 55_000 < await redis.pttl(key) <= 60_000
        assert secret.value not in (await redis.get(key)).decode()
        # Expiry is Redis's: the key goes at its TTL (shortened here, rather than waiting ten seconds).
        await redis.pexpire(key, 1)
    finally:
        await redis.aclose()
    await asyncio.sleep(0.05)  # past that millisecond: on a fast machine the handshake came within it
    await _refused(keyed, secret.value)


async def test_forged_and_expired_secrets_are_401_in_the_envelope(keyed: str) -> None:
    await _refused(keyed, "ek_forged")
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(keyed.replace("http", "ws") + "/v1/realtime", subprotocols=[
                "realtime", "openai-insecure-api-key.ek_forged"]):  # type: ignore[list-item]
            pass
    assert refused.value.response.status_code == 401


async def test_a_secret_authenticates_nothing_but_realtime(keyed: str) -> None:
    secret = await mint(keyed)
    with pytest.raises(openai.AuthenticationError):
        await sdk(keyed, api_key=secret.value).models.list()
    # Nor does it mint more secrets.
    with pytest.raises(openai.AuthenticationError):
        await mint_with(keyed, secret.value)


async def test_a_bad_session_is_refused_when_minting(keyed: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await mint(keyed, session={"type": "realtime", "output_modalities": ["video"]})
    assert refused.value.body["param"] == "session.output_modalities"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await mint(keyed, session={"type": "realtime", "model": "gpt-nope"})
    async with httpx.AsyncClient(base_url=keyed, headers={"Authorization": f"Bearer {KEY}"}) as client:
        response = await client.post("/v1/realtime/client_secrets",
                                      json={"expires_after": {"anchor": "created_at", "seconds": 5}})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "validation_error"
    with pytest.raises(openai.AuthenticationError):
        await sdk(keyed, api_key="sk-wrong").realtime.client_secrets.create()


async def mint_with(url: str, api_key: str) -> Any:
    return await sdk(url, api_key=api_key).realtime.client_secrets.create()


async def _refused(url: str, value: str) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime",
                                      additional_headers={"Authorization": f"Bearer {value}"}):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"


async def test_a_secret_for_a_voice_on_a_replica_that_cannot_speak_is_said_in_an_event(redis_url: str) -> None:
    # Minted where the engine speaks; used, through the same Redis, on a replica whose engine
    # does not (another release, another engine): an error event, then the close.
    settings = make_settings(redis_url=redis_url, api_keys=KEY)
    async with live_app(settings, with_talker(ScriptedEngine())) as speaking, \
            live_app(settings, ScriptedEngine()) as mute:
        secret = await mint(speaking, session={"type": "realtime", "model": "scripted", "output_modalities": ["audio"]})
        async with sdk(mute, api_key=secret.value).realtime.connect(model="scripted") as connection:
            error = (await until(connection, "error"))[-1]
            assert error["error"]["code"] == "unsupported_modality"
            with pytest.raises(websockets.ConnectionClosed):
                await connection.recv()
