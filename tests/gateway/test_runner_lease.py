"""A runner's lease heartbeat (gateway/work/runner.py): a lost lease against a session that ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.metrics import Metrics
from gateway.store.records import Lease, Renewal
from gateway.store.redis_store import SessionStore
from gateway.work.runner import LeaseLost, SessionRunner
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.test_store import TOO_LARGE, new_session, text

LEASE_TTL_SEC = 0.3  # a renewal every 0.1 s


async def generating(store: SessionStore) -> Lease:
    await new_session(store, "s1")
    lease = (await store.append("s1", text(0, "go", end=True), "r1", TOO_LARGE)).lease
    assert lease is not None
    return lease


def runner(store: SessionStore, lease: Lease) -> SessionRunner:
    return SessionRunner("s1", lease, store, ScriptedEngine(), Metrics(), LEASE_TTL_SEC,
                         on_engine_dead=pytest.fail)


async def test_a_lease_taken_over_stops_the_work_at_the_next_renewal(store: SessionStore) -> None:
    lease = await generating(store)
    stale = Lease(lease.replica, lease.epoch - 1)  # what a replica that was taken over from holds
    assert await store.renew("s1", stale) == Renewal.TAKEN
    with pytest.raises(LeaseLost) as lost:
        await asyncio.wait_for(runner(store, stale)._heartbeat(), timeout=1.0)
    assert not lost.value.ended


async def test_a_session_that_ended_is_not_a_lost_lease_and_leaves_its_work_time_to_stop(
        store: SessionStore) -> None:
    """A renewal that races the relay's last frame must not report another replica taking over
    (it logged that warning for about 1% of sessions at 200 streaming), and must not cut the
    relay short while it finishes: the heartbeat only stops the work a renewal period later."""
    lease = await generating(store)
    await store.cancel("s1", '{"error":{"code":"cancelled"}}')
    assert await store.renew("s1", lease) == Renewal.ENDED
    started = time.monotonic()
    with pytest.raises(LeaseLost) as lost:
        await asyncio.wait_for(runner(store, lease)._heartbeat(), timeout=2.0)
    assert lost.value.ended
    assert time.monotonic() - started >= LEASE_TTL_SEC / 3 * 1.4  # the first renewal, then a period


@pytest.mark.parametrize("dead", [True, False], ids=["dead-engine", "refusing-engine"])
async def test_an_engine_dead_for_good_hands_the_session_back_and_stops_the_replica(
        store: SessionStore, dead: bool) -> None:
    """A dead engine (its core process died) is no fault of the session: the runner releases it
    for another replica, which goes on from Redis, and tells the replica to stop. An engine that
    only refuses the session still fails it."""
    lease = await generating(store)
    reasons: list[str] = []
    engine = ScriptedEngine(refuse_with=RuntimeError("the engine core is gone"), dead=dead)
    work = SessionRunner("s1", lease, store, engine, Metrics(), LEASE_TTL_SEC, on_engine_dead=reasons.append)
    await asyncio.wait_for(work.run(), timeout=5)
    record = await store.view("s1")
    if dead:
        assert reasons and "scripted engine marked dead" in reasons[0]
        assert record.state.value == "generating" and record.owner is None, "released, not failed"
        taken = await store.tend("{}", "{}")  # another replica, at once
        assert [w.session_id for w in taken.waiting] == ["s1"] and await store.claim("s1", "r2") is not None
    else:
        assert not reasons
        assert record.state.value == "failed"
