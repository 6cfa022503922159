"""Identities, isolation and limits, with two identities and real Redis."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from dataclasses import dataclass

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.store.keys import OPEN_SESSIONS
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings


@dataclass(frozen=True)
class Keys:
    """Two fresh identities per test: the suite shares one Redis, and limits are per identity."""

    a: str
    b: str

    @property
    def setting(self) -> str:
        # One plain entry, one stored as a digest.
        return f"{self.a},sha256:{hashlib.sha256(self.b.encode()).hexdigest()}"


@pytest.fixture
def keys() -> Keys:
    return Keys(f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def code_of(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


async def new_session(client: httpx.AsyncClient, headers: dict[str, str]) -> httpx.Response:
    return await client.post(BASE, json={"start_policy": "on_end_only"}, headers=headers)


async def test_api_keys_are_required_and_checked(redis_url: str, keys: Keys) -> None:
    A, B = bearer(keys.a), bearer(keys.b)
    async with app_client(make_settings(redis_url=redis_url, api_keys=keys.setting), ScriptedEngine()) as client:
        missing = await client.post(BASE, json={})
        assert missing.status_code == 401 and code_of(missing) == "missing_credentials"
        wrong = await client.post(BASE, json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and code_of(wrong) == "invalid_api_key"
        basic = await client.post(BASE, json={}, headers={"Authorization": f"Basic {keys.a}"})
        assert basic.status_code == 401
        assert (await new_session(client, A)).status_code == 201
        assert (await new_session(client, B)).status_code == 201
        assert (await client.get("/healthz")).status_code == 200


async def test_a_session_is_invisible_to_other_identities(redis_url: str, keys: Keys) -> None:
    A, B = bearer(keys.a), bearer(keys.b)
    async with app_client(make_settings(redis_url=redis_url, api_keys=keys.setting), ScriptedEngine()) as client:
        sid = (await new_session(client, A)).json()["session_id"]
        chunk = {"sequence_id": 0, "text": "mine"}
        for response in (
            await client.get(f"{BASE}/{sid}", headers=B),
            await client.post(f"{BASE}/{sid}/chunks", json=chunk, headers=B),
            await client.post(f"{BASE}/{sid}/finish", headers=B),
            await client.get(f"{BASE}/{sid}/events", headers=B),
            await client.get(f"{BASE}/{sid}/result", headers=B),
            await client.delete(f"{BASE}/{sid}", headers=B),
        ):
            assert response.status_code == 404 and code_of(response) == "session_not_found"
        view = (await client.get(f"{BASE}/{sid}", headers=A)).json()
        assert view["state"] == "open" and view["received_chunks"] == 0
        assert (await client.post(f"{BASE}/{sid}/chunks", json=chunk, headers=A)).status_code == 202


async def test_trusted_identity_header(redis_url: str, keys: Keys) -> None:
    settings = make_settings(redis_url=redis_url, identity_header="X-Consumer-ID")
    async with app_client(settings, ScriptedEngine()) as client:
        assert (await new_session(client, {})).status_code == 401
        alice, bob = f"alice-{keys.a}", f"bob-{keys.b}"
        sid = (await new_session(client, {"X-Consumer-ID": alice})).json()["session_id"]
        assert (await client.get(f"{BASE}/{sid}", headers={"X-Consumer-ID": bob})).status_code == 404
        assert (await client.get(f"{BASE}/{sid}", headers={"X-Consumer-ID": alice})).status_code == 200


async def test_open_sessions_per_identity_are_capped(redis_url: str, keys: Keys) -> None:
    A, B = bearer(keys.a), bearer(keys.b)
    settings = make_settings(redis_url=redis_url, api_keys=keys.setting, max_sessions_per_identity=2)
    async with app_client(settings, ScriptedEngine()) as client:
        first = (await new_session(client, A)).json()["session_id"]
        assert (await new_session(client, A)).status_code == 201
        refused = await new_session(client, A)
        assert refused.status_code == 429 and code_of(refused) == "too_many_sessions"
        assert int(refused.headers["retry-after"]) >= 1
        assert (await new_session(client, B)).status_code == 201, "another identity is not affected"
        assert (await client.delete(f"{BASE}/{first}", headers=A)).status_code == 204
        assert (await new_session(client, A)).status_code == 201, "an ended session frees its slot"


async def test_completed_sessions_free_their_slot(redis_url: str, keys: Keys) -> None:
    A = bearer(keys.a)
    settings = make_settings(redis_url=redis_url, api_keys=keys.setting, max_sessions_per_identity=1)
    async with app_client(settings, ScriptedEngine()) as client:
        created = await client.post(BASE, headers=A, json={
            "first_chunk": {"sequence_id": 0, "text": "quick", "end_of_input": True}})
        sid = created.json()["session_id"]
        result = await client.get(f"{BASE}/{sid}/result", params={"wait": 5}, headers=A)
        assert result.json()["state"] == "completed"
        assert (await new_session(client, A)).status_code == 201


async def test_a_refused_first_chunk_leaves_no_session_and_frees_its_slot(redis_url: str, keys: Keys) -> None:
    A = bearer(keys.a)
    settings = make_settings(redis_url=redis_url, api_keys=keys.setting, max_sessions_per_identity=1,
                             max_out_of_order=8)
    async with app_client(settings, ScriptedEngine()) as client:
        refused = await client.post(BASE, headers=A, json={"first_chunk": {"sequence_id": 285, "text": "/"}})
        assert refused.status_code == 409 and code_of(refused) == "sequence_out_of_window"
        assert (await new_session(client, A)).status_code == 201, "the refused create held no slot"


async def test_global_session_cap_is_503(redis_url: str, keys: Keys) -> None:
    A, B = bearer(keys.a), bearer(keys.b)
    async with aioredis.Redis.from_url(redis_url) as redis:
        # Other tests' sessions share this Redis: allow exactly one more.
        already_open = await redis.zcard(OPEN_SESSIONS)
    settings = make_settings(redis_url=redis_url, api_keys=keys.setting, max_open_sessions=already_open + 1)
    async with app_client(settings, ScriptedEngine()) as client:
        assert (await new_session(client, A)).status_code == 201
        full = await new_session(client, B)
        assert full.status_code == 503 and code_of(full) == "capacity_exhausted"
        assert full.headers["retry-after"] == "5"


async def test_rate_limit_is_shared_across_replicas(redis_url: str, keys: Keys) -> None:
    A, B = bearer(keys.a), bearer(keys.b)
    settings = make_settings(redis_url=redis_url, api_keys=keys.setting, rate_limit_rps=0.5, rate_limit_burst=3)
    async with app_client(settings, ScriptedEngine()) as one, app_client(settings, ScriptedEngine()) as two:
        statuses = [(await c.get(f"{BASE}/sis-none", headers=A)).status_code for c in (one, two, one, two)]
        assert statuses == [404, 404, 404, 429]
        limited = await one.get(f"{BASE}/sis-none", headers=A)
        assert code_of(limited) == "rate_limit_exceeded" and int(limited.headers["retry-after"]) >= 1
        assert (await two.get(f"{BASE}/sis-none", headers=B)).status_code == 404, "B has its own bucket"


async def test_logs_carry_no_keys_or_payloads(redis_url: str, keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    A = bearer(keys.a)
    secret_text = "the-secret-payload-text"
    caplog.set_level(logging.DEBUG)
    async with app_client(make_settings(redis_url=redis_url, api_keys=keys.setting), ScriptedEngine()) as client:
        created = await client.post(BASE, headers=A, json={
            "first_chunk": {"sequence_id": 0, "text": secret_text, "end_of_input": True}})
        sid = created.json()["session_id"]
        await client.get(f"{BASE}/{sid}/result", params={"wait": 5}, headers=A)
        await client.delete(f"{BASE}/{sid}", headers=A)
        await asyncio.sleep(0.05)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert keys.a not in logged and secret_text not in logged


# --- open mode: limits per client, not one bucket for everyone ---------------


def from_client(address: str) -> dict[str, str]:
    """A request the API gateway (a trusted proxy on loopback) forwarded for ``address``."""
    return {"X-Forwarded-For": f"198.51.100.250, {address}"}


async def test_open_mode_rate_limits_each_client_on_its_own(redis_url: str) -> None:
    a, b = f"203.0.113.{uuid.uuid4().int % 200}", "2001:db8::7"
    settings = make_settings(redis_url=redis_url, rate_limit_rps=0.5, rate_limit_burst=3, trusted_proxies="127.0.0.1")
    async with app_client(settings, ScriptedEngine()) as client:
        codes = [(await client.get(f"{BASE}/sis-x", headers=from_client(a))).status_code for _ in range(4)]
        assert codes == [404, 404, 404, 429]
        # Another client behind the same gateway still has its whole burst.
        assert (await client.get(f"{BASE}/sis-x", headers=from_client(b))).status_code == 404


async def test_open_mode_caps_sessions_per_client_but_hides_none(redis_url: str) -> None:
    a, b = f"192.0.2.{uuid.uuid4().int % 200}", f"192.0.2.{200 + uuid.uuid4().int % 50}"
    settings = make_settings(redis_url=redis_url, max_sessions_per_identity=1, trusted_proxies="127.0.0.0/8")
    async with app_client(settings, ScriptedEngine()) as client:
        first = await client.post(BASE, json={}, headers=from_client(a))
        assert first.status_code == 201
        assert (await client.post(BASE, json={}, headers=from_client(a))).status_code == 429
        assert (await client.post(BASE, json={}, headers=from_client(b))).status_code == 201
        # Open mode has no owners: the id is the secret, and addresses change behind NAT.
        sid = first.json()["session_id"]
        assert (await client.get(f"{BASE}/{sid}", headers=from_client(b))).status_code == 200
        assert (await client.delete(f"{BASE}/{sid}", headers=from_client(b))).status_code == 204
        assert (await client.post(BASE, json={}, headers=from_client(a))).status_code == 201  # slot freed


async def test_forwarded_for_counts_only_from_trusted_proxies(redis_url: str) -> None:
    # Without trusted proxies the header is the client's own claim: ignored.
    settings = make_settings(redis_url=redis_url, rate_limit_rps=0.5, rate_limit_burst=2)
    async with app_client(settings, ScriptedEngine()) as client:
        seen = [(await client.get(f"{BASE}/sis-x", headers=from_client(f"192.0.2.{i}"))).status_code
                for i in range(3)]
        assert seen[-1] == 429
