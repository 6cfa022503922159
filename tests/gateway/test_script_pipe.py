"""Publishes of many sessions in one round trip (gateway/store/script_pipe.py), on a real Redis and fakeredis."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway import errors
from gateway.store.records import Lease
from gateway.store.redis_store import SessionStore
from tests.gateway.test_store import TOO_LARGE, new_session, text
from tests.redis_server import redis_process


async def generating(store: SessionStore, count: int) -> dict[str, Lease]:
    leases = {}
    for n in range(count):
        sid = f"s{n}"
        await new_session(store, sid)
        lease = (await store.append(sid, text(0, "go", end=True), "r1", TOO_LARGE)).lease
        assert lease is not None
        leases[sid] = lease
    return leases


async def test_publishes_made_together_share_one_round_trip_and_each_gets_its_own_ids(store: SessionStore) -> None:
    leases = await generating(store, 20)
    trips = store._pipe.round_trips
    # Text with more bytes than characters: the pipe writes its commands itself (raw_calls.py).
    ids = await asyncio.gather(*(store.publish(sid, lease, 0, [("", f"héllo 🙂 {sid}", False)])
                                 for sid, lease in leases.items()))
    assert store._pipe.round_trips == trips + 1
    for sid, written in zip(leases, ids, strict=True):
        assert written is not None and len(written) == 1
        frames = await store.read_frames(sid, "0-0", block_ms=None)
        assert [(f.id, f.data) for f in frames] == [(written[0], f"héllo 🙂 {sid}")]


async def test_one_refused_publish_does_not_fail_the_others_in_its_round_trip(store: SessionStore) -> None:
    leases = await generating(store, 3)
    stale = Lease("r1", leases["s1"].epoch + 1)  # not the lease s1 holds
    results = await asyncio.gather(store.publish("s0", leases["s0"], 0, [("", "a", False)]),
                                   store.publish("s1", stale, 0, [("", "b", False)]),
                                   store.publish("s2", leases["s2"], 0, [("", "c", False)]))
    assert results[0] is not None and results[1] is None and results[2] is not None
    assert await store.read_frames("s1", "0-0", block_ms=None) == []


async def test_scripts_flushed_from_redis_are_loaded_again_inside_a_round_trip(
        store: SessionStore, redis_client: aioredis.Redis) -> None:
    leases = await generating(store, 5)
    await redis_client.script_flush()
    ids = await asyncio.gather(*(store.publish(sid, lease, 0, [("", "x", False)]) for sid, lease in leases.items()))
    assert all(written is not None and len(written) == 1 for written in ids)


async def test_a_publish_alone_after_the_scripts_were_flushed_loads_its_script_again(
        store: SessionStore, redis_client: aioredis.Redis) -> None:
    leases = await generating(store, 1)
    await redis_client.script_flush()
    assert await store.publish("s0", leases["s0"], 0, [("", "x", False)]) is not None
    assert [f.data for f in await store.read_frames("s0", "0-0", block_ms=None)] == ["x"]


async def test_a_caller_that_gives_up_leaves_the_others_their_replies(store: SessionStore) -> None:
    leases = await generating(store, 3)
    calls = [asyncio.create_task(store.publish(sid, lease, 0, [("", "x", False)])) for sid, lease in leases.items()]
    await asyncio.sleep(0)  # every call is queued, the round trip not sent yet
    assert len(store._pipe._queued) == 3
    calls[0].cancel()
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError)
    assert all(written is not None for written in done[1:])


@pytest.mark.redis
async def test_a_round_trip_that_fails_fails_each_call_as_the_store_being_unavailable(redis_url: str) -> None:
    # A client pointed at a port nobody listens on: every call in the round trip fails alike.
    client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    try:
        store = SessionStore(client, timeout_sec=2.0)
        results = await asyncio.gather(*(store.publish(f"s{n}", Lease("r1", 1), 0, [("", "x", False)])
                                         for n in range(3)), return_exceptions=True)
        assert all(isinstance(result, errors.StoreUnavailable) for result in results), results
        assert store._pipe.round_trips == 1
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_publishes_to_a_hanging_redis_fail_as_the_store_being_unavailable_in_bounded_time() -> None:
    # The pipe's one timer per round trip bounds every call in it; a call queued behind a
    # round trip in flight waits for that one first: two timeouts at most, never a hang.
    timeout_sec = 0.5
    with redis_process() as redis:
        client = aioredis.Redis.from_url(redis.url)
        try:
            store = SessionStore(client, timeout_sec=timeout_sec)
            leases = await generating(store, 2)

            def publishes() -> asyncio.Future[list[object]]:
                return asyncio.gather(*(store.publish(sid, lease, 0, [("", "x", False)])
                                        for sid, lease in leases.items()), return_exceptions=True)

            redis.freeze()
            try:
                started = time.monotonic()
                in_flight = publishes()
                await asyncio.sleep(0.1)
                queued = publishes()
                results = [*await in_flight, *await queued]
                took = time.monotonic() - started
            finally:
                redis.thaw()
        finally:
            await client.aclose()
    assert all(isinstance(result, errors.StoreUnavailable) for result in results), results
    assert took < 2 * timeout_sec + 0.3, took
