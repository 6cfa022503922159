"""A session's chunk payloads live only as long as its engine work can read them.

The session caps bound the chunks of live sessions; an ended session counts
against no cap, so its chunks must not stay in Redis for the result's life
(a hostile client filled Redis by failing, cancelling and abandoning sessions
whose chunks kept an hour's TTL). The result, the view and the SSE replay
stay as long as before. Real Redis: TTLs are what is tested.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from gateway.settings import Settings
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings, parse_sse

TIMEOUT_SEC = 30.0
RESULT_TTL_SEC = 600.0
LEASE_TTL_SEC = 10.0


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url=redis_url, session_timeout_sec=TIMEOUT_SEC, result_ttl_sec=RESULT_TTL_SEC,
                         lease_ttl_sec=LEASE_TTL_SEC, max_payload_per_session=3000, max_chunk_bytes=2000,
                         tend_interval_sec=0.05)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def client(settings: Settings, engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(settings, engine) as c:
        yield c


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as client:
        yield client


def key(sid: str, name: str) -> str:
    return f"sis:{{{sid}}}:{name}"


async def create(client: httpx.AsyncClient, **body: object) -> str:
    response = await client.post(BASE, json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


async def append(client: httpx.AsyncClient, sid: str, seq: int, text: str, **extra: object) -> httpx.Response:
    return await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": text, **extra})


def assert_chunks_gone_result_kept(admin: redis.Redis, sid: str) -> None:
    assert not admin.exists(key(sid, "chunks")), "an ended session's chunks stay in Redis"
    for name in ("meta", "digests", "out"):
        # Still readable for the result's life, as before.
        assert (RESULT_TTL_SEC - 60) * 1000 < admin.pttl(key(sid, name)) <= RESULT_TTL_SEC * 1000, name


async def state_is(client: httpx.AsyncClient, sid: str, state: str) -> dict:
    deadline = time.monotonic() + 10
    while (view := (await client.get(f"{BASE}/{sid}")).json()).get("state") != state:
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.02)
    return view


async def test_a_live_sessions_chunks_expire_with_its_idle_deadline(client: httpx.AsyncClient,
                                                                   admin: redis.Redis) -> None:
    sid = await create(client, start_policy="on_end_only")
    assert (await append(client, sid, 0, "x" * 1000)).status_code == 202
    # The idle deadline plus a lease's time, not plus the result's hour.
    assert (TIMEOUT_SEC - 5) * 1000 < admin.pttl(key(sid, "chunks")) <= (TIMEOUT_SEC + LEASE_TTL_SEC) * 1000
    # The rest stays past the deadline, so an expired session is still a 410 for the result's life.
    assert admin.pttl(key(sid, "meta")) > RESULT_TTL_SEC * 1000


async def test_delete_drops_the_chunks_and_keeps_the_result(client: httpx.AsyncClient, admin: redis.Redis) -> None:
    sid = await create(client, start_policy="on_end_only")
    assert (await append(client, sid, 0, "x" * 1000)).status_code == 202
    assert admin.hlen(key(sid, "chunks")) == 1
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204
    assert_chunks_gone_result_kept(admin, sid)
    result = await client.get(f"{BASE}/{sid}/result")
    assert result.status_code == 200 and result.json()["state"] == "cancelled"
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].event == "error" and events[-1].json()["error"]["code"] == "session_cancelled"
    # A retried chunk of the cancelled session is still told apart (its digest is kept).
    assert (await append(client, sid, 0, "x" * 1000)).json()["error"]["code"] == "session_closed"


async def test_the_session_cap_fails_the_session_and_drops_its_chunks(client: httpx.AsyncClient,
                                                                     admin: redis.Redis) -> None:
    """The probe's case: the chunk over the session's cap is a 413 and fails the session."""
    sid = await create(client, start_policy="on_end_only")
    for seq in range(2):
        assert (await append(client, sid, seq, "x" * 1500)).status_code == 202
    over = await append(client, sid, 2, "x" * 1500)
    assert over.status_code == 413 and over.json()["error"]["code"] == "payload_too_large"
    assert_chunks_gone_result_kept(admin, sid)
    result = await client.get(f"{BASE}/{sid}/result")
    assert result.status_code == 200 and result.json()["state"] == "failed"
    assert result.json()["error"]["code"] == "payload_too_large"


async def test_a_completed_session_keeps_its_result_and_replay_not_its_chunks(
    client: httpx.AsyncClient, admin: redis.Redis,
) -> None:
    sid = await create(client)
    assert (await append(client, sid, 0, "hello ")).status_code == 202
    assert (await append(client, sid, 1, "world", end_of_input=True)).status_code == 202
    result = await client.get(f"{BASE}/{sid}/result", params={"wait": 10})
    assert result.status_code == 200 and result.json()["state"] == "completed", result.text
    assert result.json()["completion"]["choices"][0]["message"]["content"] == "echo: hello world"
    assert_chunks_gone_result_kept(admin, sid)
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].data == "[DONE]"
    resumed = parse_sse((await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": events[0].id})).text)
    assert [e.id for e in resumed] == [e.id for e in events[1:]]
    # A retry of a chunk already taken is still a duplicate: dedupe reads the digests, not the chunks.
    again = await append(client, sid, 1, "world", end_of_input=True)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    # The view says how long the ended session stays readable: its result's time, not the idle deadline.
    view = (await client.get(f"{BASE}/{sid}")).json()
    assert RESULT_TTL_SEC - 30 < view["expires_in"] <= RESULT_TTL_SEC, view
    assert abs(admin.pttl(key(sid, "meta")) / 1000 - view["expires_in"]) < 5, "the meta goes then"


async def test_an_engine_failure_drops_the_chunks(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                  admin: redis.Redis) -> None:
    engine.script = Script(error_after_words=1)
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "one two", "end_of_input": True})
    await state_is(client, sid, "failed")
    assert_chunks_gone_result_kept(admin, sid)


async def test_an_idle_session_expires_with_its_chunks(redis_url: str, admin: redis.Redis) -> None:
    settings = make_settings(redis_url=redis_url, session_timeout_sec=0.3, tend_interval_sec=0.05,
                             result_ttl_sec=RESULT_TTL_SEC)
    engine = ScriptedEngine()
    async with app_client(settings, engine) as client:
        sid = await create(client)
        assert (await append(client, sid, 0, "started")).status_code == 202
        await asyncio.sleep(0.8)
        assert (await client.get(f"{BASE}/{sid}")).status_code == 410
        assert_chunks_gone_result_kept(admin, sid)
        assert engine.sessions[0].aborted


async def test_input_past_the_deadline_is_refused_with_no_tender_running(redis_url: str,
                                                                          admin: redis.Redis) -> None:
    """The chunks of a live session die with its deadline: a session no tender expired (none
    running) must not take input then, or it would go on without the chunks it had."""
    settings = make_settings(redis_url=redis_url, session_timeout_sec=0.3, tend_interval_sec=3600)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = await create(client, start_policy="on_end_only")
        assert (await append(client, sid, 0, "early")).status_code == 202
        await asyncio.sleep(0.5)
        assert (await client.get(f"{BASE}/{sid}")).json()["state"] == "open"  # not tended yet
        for late in (await append(client, sid, 1, "late"), await append(client, sid, 0, "early"),
                     await client.post(f"{BASE}/{sid}/finish"),
                     await client.put(f"{BASE}/{sid}/chunks/0", json={"sequence_id": 0, "text": "again"})):
            assert late.status_code == 410, late.text
            assert late.json()["error"]["code"] == "session_expired"


async def test_the_runner_stops_quietly_when_the_chunks_went_with_the_sessions_end(
    client: httpx.AsyncClient, engine: ScriptedEngine, admin: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """A cancel between the runner's read of the input and its read of the chunks: they are gone.
    That is the session's end, not a failure to feed it."""
    caplog.set_level(logging.INFO, logger="gateway.work.runner")
    sid = await create(client)
    assert (await append(client, sid, 0, "hello ")).status_code == 202
    await state_is(client, sid, "streaming")
    deadline = time.monotonic() + 10
    while not (engine.sessions and engine.sessions[0].fed):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    # What a cancel leaves, but for its abort mark, which the runner has not read yet.
    pipe = admin.pipeline()
    pipe.hset(key(sid, "meta"), mapping={"state": "cancelled", "owner": "", "lease_until": 0})
    pipe.delete(key(sid, "chunks"))
    pipe.xadd(key(sid, "in"), {"s": 1})
    pipe.execute()
    while "ended before its input was fed" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        await asyncio.sleep(0.02)
    admin.xadd(key(sid, "in"), {"abort": "cancelled"})
    while not engine.sessions[0].aborted:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert "feeding input failed" not in caplog.text
    assert [c.sequence_id for c in engine.sessions[0].fed] == [0]
