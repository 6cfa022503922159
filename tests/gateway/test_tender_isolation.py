"""One bad session never stops the cluster's tenders (issue 29, item 5).

A session whose hash is corrupted makes its script fail. It was the first
entry of every tender round, so every round failed at it, on every
replica, for good: nothing else expired, started or failed over. Now it is
backed off, then dead-lettered, and the round goes on with the others.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from gateway.store.keys import DEAD_LETTERS, SCHEDULE, session_keys
from gateway.store.redis_store import QUARANTINE_FAILURES, SessionStore
from gateway.work.draining import Draining
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings


async def until_status(client: httpx.AsyncClient, path: str, status: int, within_sec: float = 10) -> None:
    deadline = time.monotonic() + within_sec
    while (response := await client.get(path)).status_code != status:
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.05)


async def test_a_corrupted_session_is_set_aside_and_every_other_one_is_tended(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.store.redis_store.QUARANTINE_BACKOFF_MS", 50)
    admin = redis.Redis.from_url(redis_url)
    common = {"redis_url": redis_url, "tend_interval_sec": 0.05, "lease_ttl_sec": 1.0}
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(app_client(make_settings(**common, replica_id="a"), ScriptedEngine()))
        b = await stack.enter_async_context(app_client(
            make_settings(**common, replica_id="b", session_timeout_sec=0.5), ScriptedEngine()))
        leaving = AsyncExitStack()
        draining = Draining()
        c = await leaving.enter_async_context(app_client(
            make_settings(**common, replica_id="c"), ScriptedEngine(Script(hang=True)), draining))

        broken = (await a.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        admin.hset(session_keys(broken).meta, "expires_at", "not a number")
        admin.zadd(SCHEDULE, {broken: 0})  # first in every round

        # Work c runs, then leaves behind when it stops (failover); work c starts while
        # draining (nobody owns it); a session that idles out on b (expiry).
        moving = (await c.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "moved"}})).json()
        assert moving["owner"] == "c"
        draining.begin()
        waiting = (await c.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "waited",
                                                            "end_of_input": True}})).json()
        assert waiting["owner"] is None
        await leaving.aclose()
        idle = (await b.post(BASE, json={})).json()["session_id"]

        await until_status(a, f"{BASE}/{idle}", 410)
        result = (await a.get(f"{BASE}/{waiting['session_id']}/result", params={"wait": 10})).json()
        assert result["state"] == "completed", result
        await a.post(f"{BASE}/{moving['session_id']}/finish")
        result = (await b.get(f"{BASE}/{moving['session_id']}/result", params={"wait": 10})).json()
        assert result["completion"]["choices"][0]["message"]["content"] == "echo: moved", result

        deadline = time.monotonic() + 10
        while not admin.hexists(DEAD_LETTERS, broken):
            assert time.monotonic() < deadline, "the broken session was never set aside for good"
            await asyncio.sleep(0.05)
        assert admin.zscore(SCHEDULE, broken) is None
        assert "compare" in admin.hget(DEAD_LETTERS, broken).decode()  # the script's own error
        metrics = (await a.get("/metrics")).text + (await b.get("/metrics")).text
        assert 'omni_gateway_sessions_quarantined_total{outcome="dead"} 1.0' in metrics
    admin.close()


async def test_a_late_failure_from_another_tender_leaves_a_dead_letter_out_of_the_schedule(
        store: SessionStore, redis_client: aioredis.Redis) -> None:
    """Two tenders read the broken session as due; one sets it aside at its fifth failure, then
    the other's failure arrives. It put the session back in the schedule, counted from one (CI
    saw it); an ended session, gone from the schedule, was put back the same way."""
    await redis_client.delete(SCHEDULE, DEAD_LETTERS)
    await redis_client.zadd(SCHEDULE, {"sis-broken": 0})
    for _ in range(QUARANTINE_FAILURES):
        last = await store.quarantine("sis-broken", RuntimeError("corrupted"))
    assert last.dead
    late = await store.quarantine("sis-broken", RuntimeError("corrupted"))
    assert late.dead
    assert await redis_client.zscore(SCHEDULE, "sis-broken") is None
    await store.quarantine("sis-ended", RuntimeError("its hash went away"))
    assert await redis_client.zscore(SCHEDULE, "sis-ended") is None
