"""``Idempotency-Key`` on create and chat: a repeat returns the first session (issue 29, item 7).

A client that lost the answer to a create (a 503 from Redis after the
session was made, a dropped connection) retries it; without a key that
made a second session, counted against its caps until it expired.
"""

from __future__ import annotations

import asyncio

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings

CHAT = {"messages": [{"role": "user", "content": "hello there"}]}


async def test_a_repeated_create_returns_the_first_session(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_sessions_per_identity=1)
    async with app_client(settings, ScriptedEngine()) as client:
        key = {"Idempotency-Key": "create-1"}
        first = await client.post(BASE, json={"start_policy": "on_end_only"}, headers=key)
        again = await client.post(BASE, json={"start_policy": "on_end_only"}, headers=key)
        assert first.status_code == again.status_code == 201
        assert first.json()["session_id"] == again.json()["session_id"]
        # A new key is a new session: the identity's one slot is taken by the first.
        other = await client.post(BASE, json={}, headers={"Idempotency-Key": "create-2"})
        assert other.status_code == 429 and other.json()["error"]["code"] == "too_many_sessions"
        reused = await client.post(BASE, json={"start_policy": "on_first_chunk"}, headers=key)
        assert reused.status_code == 422 and reused.json()["error"]["code"] == "idempotency_key_reused"


async def test_a_create_retried_after_its_session_expired_is_a_410(redis_url: str) -> None:
    # Schemathesis found it: a documented status, not a surprise, and no new session made.
    settings = make_settings(redis_url=redis_url, session_timeout_sec=0.3, tend_interval_sec=0.05)
    async with app_client(settings, ScriptedEngine()) as client:
        key = {"Idempotency-Key": "create-expired"}
        first = await client.post(BASE, json={}, headers=key)
        await asyncio.sleep(0.8)
        again = await client.post(BASE, json={}, headers=key)
        assert again.status_code == 410 and again.json()["error"]["code"] == "session_expired"
        assert first.json()["session_id"] in again.json()["error"]["message"]


async def test_twins_sent_at_once_make_one_session(redis_url: str) -> None:
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as client:
        twins = await asyncio.gather(*(client.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "hi"}},
                                                   headers={"Idempotency-Key": "twin"}) for _ in range(5)))
        assert {r.status_code for r in twins} == {201}
        assert len({r.json()["session_id"] for r in twins}) == 1


async def test_a_repeated_chat_answers_from_the_first_session(redis_url: str) -> None:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        key = {"Idempotency-Key": "chat-1"}
        first = await client.post("/v1/chat/completions", json=CHAT, headers=key)
        again = await client.post("/v1/chat/completions", json=CHAT, headers=key)
        assert first.status_code == again.status_code == 200
        assert first.headers["X-Session-Id"] == again.headers["X-Session-Id"]
        assert first.json()["choices"] == again.json()["choices"]
        assert len(engine.sessions) == 1, "the answer was made once"
        bad = await client.post(BASE, json={}, headers={"Idempotency-Key": "x" * 300})
        assert bad.status_code == 422
