"""The Lua scripts behind every state change, against real Redis and fakeredis."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway import errors
from gateway.domain.policies import StartPolicy, StartThresholds
from gateway.domain.scheduling import Room
from gateway.domain.states import SessionState
from gateway.store import redis_store
from gateway.store.connection import open_redis, store_url
from gateway.store.records import ChunkRecord, Lease, Renewal
from gateway.store.redis_store import SessionStore
from gateway.store.session_hash import NewSession, StoredRequest
from omni_adapter.port import SamplingOptions

TOO_LARGE = json.dumps({"error": {"code": "payload_too_large"}})
EXPIRED = json.dumps({"error": {"code": "session_expired"}})
INCOMPLETE = '{"error":{"code":"incomplete_input","missing_sequence_ids":[__MISSING__]}}'


@dataclasses.dataclass(frozen=True)
class Tended:
    """A session a tender round ended, or whose work it claimed (``lease``)."""

    session_id: str
    state: SessionState
    lease: Lease | None = None


async def tend_round(store: SessionStore, replica: str, room: Room) -> tuple[list[Tended], int]:
    """One tender round as gateway/work/tender.py runs it, with ``room``; and the answers left waiting."""
    tended_round = await store.tend(EXPIRED, INCOMPLETE)
    done = [Tended(o.session_id, o.state) for o in tended_round.ended]
    answers_waiting = 0
    for work in tended_round.waiting:
        if not room.fits(work):
            answers_waiting += work.answering
            continue
        if (lease := await store.claim(work.session_id, replica)) is not None:
            room = room.taken(work)
            done.append(Tended(work.session_id, work.state, lease))
    return done, answers_waiting


async def tended(store: SessionStore, replica: str, room: int) -> list[Tended]:
    """One tender round's outcomes, with ``room`` for any kind of work."""
    return (await tend_round(store, replica, Room(room, room)))[0]


def new(**overrides: Any) -> NewSession:
    """A session as ``create`` stores it: small caps, starting on its first chunk."""
    base = NewSession(
        policy=StartPolicy.ON_FIRST_CHUNK, model="m", identity="", created_at_ms=0,
        request=StoredRequest(messages=(), modalities=("text",), sampling=SamplingOptions()),
        start=StartThresholds(chunks=1), max_out_of_order=4, max_bytes=100, max_chunks=10,
        timeout_ms=60_000, result_ttl_ms=60_000, generation_ttl_ms=60_000, lease_ttl_ms=60_000)
    return dataclasses.replace(base, **overrides)


def text(seq: int, body: str, end: bool = False) -> ChunkRecord:
    return ChunkRecord(seq, "text", body.encode(), end_of_input=end)


async def new_session(store: SessionStore, sid: str = "s1", **overrides: object) -> None:
    await store.create(sid, new(**overrides), "r1", None, TOO_LARGE)


async def input_events(store: SessionStore, sid: str = "s1") -> list[tuple[str, int]]:
    return [(e.kind, e.sequence_id) for e in await store.read_input(sid, "0-0", block_ms=10)]


async def test_out_of_order_chunks_reach_the_input_stream_in_order(store: SessionStore) -> None:
    await new_session(store, start=None)
    for seq in (2, 1):
        outcome = await store.append("s1", text(seq, f"c{seq}"), "r1", TOO_LARGE)
        assert outcome.next_sequence_id == 0 and outcome.state is SessionState.OPEN
    outcome = await store.append("s1", text(0, "c0"), "r1", TOO_LARGE)
    assert outcome.next_sequence_id == 3
    assert await input_events(store) == [("chunk", 0), ("chunk", 1), ("chunk", 2)]
    chunks = await store.load_chunks("s1", [0, 1, 2])
    assert [c.payload for c in chunks] == [b"c0", b"c1", b"c2"]


@pytest.mark.parametrize("option", ["protocol=3", "protocol=2", "legacy_responses=false"])
async def test_a_redis_url_choosing_the_shape_of_replies_still_works(redis_url: str, option: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # redis-py lets the URL's query choose these. protocol=3 gave XREAD's reply as a map that the
    # store read as a list: every chunk's way to the engine failed. The store now gets redis-py's
    # default shapes whatever the URL asks, so its reader parses one shape.
    url = redis_url + ("&" if "?" in redis_url else "?") + option
    async with open_redis(url, timeout_sec=2.0) as client:
        store = SessionStore(client, timeout_sec=2.0)
        await new_session(store, start=None)
        for seq in (0, 1):
            await store.append("s1", text(seq, f"c{seq}"), "r1", TOO_LARGE)
        assert await input_events(store) == [("chunk", 0), ("chunk", 1)]
        async with store.input_stream("s1", "0-0") as stream:  # the replica's shared reader
            assert [e.sequence_id for e in await stream.read(2000)] == [0, 1]
    assert f"the Redis URL's {option} is ignored" in caplog.text


def test_only_the_options_shaping_replies_are_taken_out_of_a_redis_url() -> None:
    assert store_url("redis://:p%40ss@h:6379/2?protocol=3&socket_keepalive=true") == \
        "redis://:p%40ss@h:6379/2?socket_keepalive=true"
    assert store_url("rediss://h:6380/0?protocol=2&legacy_responses=true") == "rediss://h:6380/0"
    assert store_url("redis://h/0?health_check_interval=5") == "redis://h/0?health_check_interval=5"


async def test_scripts_flushed_from_redis_are_loaded_again(store: SessionStore,
                                                           redis_client: aioredis.Redis) -> None:
    # A restarted or failed-over Redis has lost its script cache: the next call loads the script.
    await new_session(store, start=None)
    await redis_client.script_flush()
    outcome = await store.append("s1", text(0, "c0"), "r1", TOO_LARGE)
    assert outcome.next_sequence_id == 1 and not outcome.duplicate
    assert await input_events(store) == [("chunk", 0)]


async def test_duplicate_is_idempotent_and_conflict_changes_nothing(store: SessionStore) -> None:
    await new_session(store, start=None)
    await store.append("s1", text(0, "same"), "r1", TOO_LARGE)
    again = await store.append("s1", text(0, "same"), "r1", TOO_LARGE)
    assert again.duplicate
    with pytest.raises(errors.SequenceConflict):
        await store.append("s1", text(0, "other"), "r1", TOO_LARGE)
    view = await store.view("s1")
    assert view.received == 1 and view.bytes == 4
    assert await input_events(store) == [("chunk", 0)]


async def test_window_and_chunk_count_limits(store: SessionStore) -> None:
    await new_session(store, start=None, max_chunks=2)
    with pytest.raises(errors.SequenceOutOfWindow):
        await store.append("s1", text(4, "x"), "r1", TOO_LARGE)
    await store.append("s1", text(3, "x"), "r1", TOO_LARGE)
    await store.append("s1", text(0, "x"), "r1", TOO_LARGE)
    with pytest.raises(errors.TooManyChunks):
        await store.append("s1", text(1, "x"), "r1", TOO_LARGE)
    assert (await store.view("s1")).missing_sequence_ids == [1, 2]


async def test_session_cap_closes_the_session_and_tells_subscribers(store: SessionStore) -> None:
    await new_session(store, start=None, max_bytes=10)
    await store.append("s1", text(0, "12345678"), "r1", TOO_LARGE)
    with pytest.raises(errors.SessionPayloadTooLarge):
        await store.append("s1", text(1, "123"), "r1", TOO_LARGE)
    view = await store.view("s1")
    assert view.state is SessionState.FAILED
    assert view.error == {"error": {"code": "payload_too_large"}}
    frames = await store.read_frames("s1", "0-0", block_ms=10)
    assert [(f.event, f.last) for f in frames] == [("error", True)]
    with pytest.raises(errors.SessionClosed):
        await store.append("s1", text(1, "1"), "r1", TOO_LARGE)


async def test_on_first_chunk_starts_once_and_end_moves_to_generating(store: SessionStore) -> None:
    await new_session(store)
    first = await store.append("s1", text(1, "b"), "r1", TOO_LARGE)
    assert not first.started and first.state is SessionState.OPEN
    second = await store.append("s1", text(0, "a"), "r1", TOO_LARGE)
    assert second.started and second.state is SessionState.STREAMING
    last = await store.append("s1", text(2, "c", end=True), "r2", TOO_LARGE)
    assert not last.started and last.state is SessionState.GENERATING
    assert (await store.view("s1")).owner == "r1"
    assert [k for k, _ in await input_events(store)] == ["chunk", "chunk", "chunk", "end"]
    with pytest.raises(errors.InputClosed):
        await store.append("s1", text(3, "d"), "r1", TOO_LARGE)
    assert (await store.append("s1", text(2, "c", end=True), "r1", TOO_LARGE)).duplicate


async def test_min_length_waits_for_enough_contiguous_bytes(store: SessionStore) -> None:
    await new_session(store, start=StartThresholds(bytes=6))
    assert not (await store.append("s1", text(0, "abc"), "r1", TOO_LARGE)).started
    assert not (await store.append("s1", text(2, "ghi"), "r1", TOO_LARGE)).started
    assert (await store.append("s1", text(1, "def"), "r1", TOO_LARGE)).started


async def test_finish_reports_gaps_then_completes_input(store: SessionStore) -> None:
    await new_session(store, start=None)
    await store.append("s1", text(0, "a"), "r1", TOO_LARGE)
    await store.append("s1", text(2, "c"), "r1", TOO_LARGE)
    outcome = await store.finish("s1", 3, "r1")
    assert outcome.state is SessionState.OPEN and outcome.missing_sequence_ids == [1, 3]
    again = await store.finish("s1", 3, "r1")
    assert again.missing_sequence_ids == [1, 3]
    with pytest.raises(errors.InputClosed):
        await store.finish("s1", 5, "r1")
    await store.append("s1", text(1, "b"), "r1", TOO_LARGE)
    done = await store.append("s1", text(3, "d"), "r1", TOO_LARGE)
    assert done.state is SessionState.GENERATING and done.started
    assert (await store.finish("s1", None, "r1")).state is SessionState.GENERATING


async def test_finish_without_chunks_is_refused(store: SessionStore) -> None:
    await new_session(store)
    with pytest.raises(errors.EmptyInput):
        await store.finish("s1", None, "r1")


async def test_reaper_expires_idle_sessions_and_fails_incomplete_ones(store: SessionStore) -> None:
    # Input past a session's deadline is refused even before a tender expired it: take it before.
    await new_session(store, "idle", timeout_ms=300, start=None)
    await new_session(store, "gappy", timeout_ms=300, start=None)
    await store.append("gappy", text(1, "b"), "r1", TOO_LARGE)
    await store.finish("gappy", 1, "r1")
    await new_session(store, "fresh", timeout_ms=60_000)
    import asyncio
    await asyncio.sleep(0.35)
    ended = {o.session_id: o.state for o in await tended(store, "r1", 0)}
    assert ended == {"idle": SessionState.EXPIRED, "gappy": SessionState.FAILED}
    assert (await store.view("gappy")).error["error"]["missing_sequence_ids"] == [0]
    with pytest.raises(errors.SessionExpired):
        await store.append("idle", text(0, "late"), "r1", TOO_LARGE)
    assert await tended(store, "r1", 0) == []
    assert (await store.view("fresh")).state is SessionState.OPEN


async def test_cancel_aborts_and_is_idempotent(store: SessionStore) -> None:
    await new_session(store)
    await store.append("s1", text(0, "a"), "r1", TOO_LARGE)
    assert await store.cancel("s1", EXPIRED) is SessionState.STREAMING
    assert await store.cancel("s1", EXPIRED) is SessionState.CANCELLED
    assert (await input_events(store))[-1] == ("abort", -1)
    with pytest.raises(errors.SessionClosed):
        await store.append("s1", text(1, "b"), "r1", TOO_LARGE)
    with pytest.raises(errors.SessionNotFound):
        await store.cancel("nope", EXPIRED)


async def test_publish_only_while_generating(store: SessionStore) -> None:
    await new_session(store)
    lease = (await store.append("s1", text(0, "a", end=True), "r1", TOO_LARGE)).lease
    assert lease == Lease("r1", 1)
    ids = await store.publish("s1", lease, 0, [("", "role", False), ("", "hi", False)])
    assert ids is not None and len(ids) == 2
    assert await store.last_frame_id("s1") == ids[-1]
    done = await store.publish("s1", lease, 2, [("", "[DONE]", True)], completion={"ok": 1})
    assert done is not None
    view = await store.view("s1", with_result=True)
    assert view.state is SessionState.COMPLETED and view.result == {"ok": 1}
    assert (await store.view("s1")).result is None, "only /result reads the result (a voice answer is megabytes)"
    assert await store.publish("s1", lease, 3, [("", "late", False)]) is None
    frames = await store.read_frames("s1", ids[0], block_ms=10)
    assert [f.data for f in frames] == ["hi", "[DONE]"] and frames[-1].last


async def test_a_publish_reads_the_session_hash_once(redis_url: str) -> None:
    """The relay publishes every delta: its lease and frame checks are one HMGET, not four HGETs."""
    async with open_redis(redis_url, timeout_sec=2.0) as client:
        store = SessionStore(client, timeout_sec=2.0)
        await new_session(store)
        lease = (await store.append("s1", text(0, "a", end=True), "r1", TOO_LARGE)).lease
        assert lease is not None
        # The first frame also gives the output stream its TTL (a few reads, once per session).
        assert await store.publish("s1", lease, 0, [("", "t0", False)]) is not None
        await client.config_resetstat()
        for index in range(1, 11):
            assert await store.publish("s1", lease, index, [("", f"t{index}", False)]) is not None
        stats = await client.info("commandstats")
    assert "cmdstat_hget" not in stats, stats.get("cmdstat_hget")
    assert stats["cmdstat_hmget"]["calls"] == 10, stats["cmdstat_hmget"]


async def test_first_chunk_is_atomic_with_create(store: SessionStore) -> None:
    with pytest.raises(errors.SequenceOutOfWindow):
        await store.create("s1", new(), "r1", text(9, "far"), TOO_LARGE)
    with pytest.raises(errors.SessionNotFound):
        await store.view("s1")
    outcome = await store.create("s1", new(), "r1", text(0, "a"), TOO_LARGE)
    assert outcome.started and outcome.state is SessionState.STREAMING


# --- leases: who runs a session's engine work --------------------------------


async def test_the_starting_replica_takes_the_lease_only_when_it_has_room(store: SessionStore) -> None:
    await new_session(store, "mine")
    taken = await store.append("mine", text(0, "a"), "r1", TOO_LARGE)
    assert taken.started and taken.lease == Lease("r1", 1)
    await new_session(store, "waiting")
    waiting = await store.append("waiting", text(0, "a"), "", TOO_LARGE)
    assert waiting.started and waiting.lease is None
    assert (await store.view("waiting")).owner is None
    # Work nobody took waits in Redis until a tender with room claims it.
    assert await tended(store, "r2", 0) == []
    (claimed,) = await tended(store, "r2", 5)
    assert (claimed.session_id, claimed.lease) == ("waiting", Lease("r2", 1))
    assert claimed.state is SessionState.STREAMING
    assert (await store.view("waiting")).owner == "r2"


async def test_a_lapsed_lease_is_claimed_and_the_old_holder_is_fenced_off(store: SessionStore) -> None:
    import asyncio

    await new_session(store, lease_ttl_ms=50)
    old = (await store.append("s1", text(0, "a", end=True), "r1", TOO_LARGE)).lease
    assert old is not None and await store.renew("s1", old) == Renewal.RENEWED
    assert await store.publish("s1", old, 0, [("", "one", False)]) is not None
    # While the lease is live, nobody else takes the work.
    assert await tended(store, "r2", 5) == []
    await asyncio.sleep(0.08)
    (claimed,) = await tended(store, "r2", 5)
    new = claimed.lease
    assert new == Lease("r2", 2) and claimed.state is SessionState.GENERATING
    # The old holder (paused, partitioned) can neither renew, write nor fail it.
    assert await store.renew("s1", old) == Renewal.TAKEN
    assert await store.publish("s1", old, 1, [("", "stale", False)]) is None
    assert await store.fail("s1", EXPIRED, old) is None
    assert await store.publish("s1", new, 1, [("", "two", False)]) is not None
    assert [f.data for f in await store.read_output("s1")] == ["one", "two"]


async def test_publish_retried_after_a_lost_reply_repeats_nothing(store: SessionStore) -> None:
    await new_session(store)
    lease = (await store.append("s1", text(0, "a", end=True), "r1", TOO_LARGE)).lease
    assert lease is not None
    await store.publish("s1", lease, 0, [("", "a", False), ("", "b", False)])
    # The same call again (its reply was lost), then one overlapping it.
    assert await store.publish("s1", lease, 0, [("", "a", False), ("", "b", False)]) == []
    await store.publish("s1", lease, 1, [("", "b", False), ("", "c", False)])
    assert [f.data for f in await store.read_output("s1")] == ["a", "b", "c"]


async def test_released_work_is_claimed_at_once(store: SessionStore) -> None:
    await new_session(store)
    lease = (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).lease
    assert lease is not None
    await store.release("s1", lease)
    assert await store.renew("s1", lease) == Renewal.TAKEN
    (claimed,) = await tended(store, "r2", 1)
    assert claimed.lease == Lease("r2", 2)


# --- clocks: Redis's, not the replica's ----------------------------------------


async def leased_session(store: SessionStore) -> Lease:
    await new_session(store, lease_ttl_ms=10_000)
    lease = (await store.append("s1", text(0, "a", end=True), "r1", TOO_LARGE)).lease
    assert lease is not None
    return lease


def skew_clock(monkeypatch: pytest.MonkeyPatch, offset_ms: int) -> None:
    real = redis_store.now_ms
    monkeypatch.setattr(redis_store, "now_ms", lambda: real() + offset_ms)


async def test_a_replica_whose_clock_runs_ahead_does_not_steal_a_live_lease(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = await leased_session(store)
    skew_clock(monkeypatch, 60_000)  # r2's clock: a minute ahead
    assert await tended(store, "r2", 5) == []
    assert await store.renew("s1", lease) == Renewal.RENEWED


async def test_a_replica_whose_clock_runs_behind_keeps_its_lease(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = await leased_session(store)
    skew_clock(monkeypatch, -60_000)  # r1's clock: a minute behind
    assert await store.renew("s1", lease) == Renewal.RENEWED
    monkeypatch.undo()
    assert await tended(store, "r2", 5) == []  # r2 sees a live lease


# --- started work is never left without a runner --------------------------------


async def test_a_failed_schedule_call_is_a_503_and_the_retry_schedules_the_work(
        store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    await new_session(store)
    real_schedule = store.schedule

    async def schedule_times_out(session_id: str, due_ms: int) -> None:
        raise errors.StoreUnavailable("the session store did not answer in time")

    monkeypatch.setattr(store, "schedule", schedule_times_out)
    # The script stored the chunk and started the work, nobody took it, and
    # the schedule call after it failed: the client must not get a 2xx.
    with pytest.raises(errors.StoreUnavailable):
        await store.append("s1", text(0, "a"), "", TOO_LARGE)
    monkeypatch.setattr(store, "schedule", real_schedule)
    retry = await store.append("s1", text(0, "a"), "", TOO_LARGE)  # what the client does with a 503
    assert retry.duplicate and retry.unowned
    (claimed,) = await tended(store, "r2", 5)
    assert claimed.session_id == "s1" and claimed.lease == Lease("r2", 1)


@pytest.mark.parametrize("call", ["append", "finish"])
async def test_a_duplicate_or_finish_reasserts_ownerless_work(store: SessionStore, redis_client,
                                                              call: str) -> None:
    from gateway.store.keys import SCHEDULE

    await new_session(store)
    assert (await store.append("s1", text(0, "a", end=True), "", TOO_LARGE)).started
    await redis_client.zrem(SCHEDULE, "s1")  # the schedule entry got lost
    assert await tended(store, "r2", 5) == []  # nothing a tender could find
    outcome = (await store.append("s1", text(0, "a", end=True), "", TOO_LARGE) if call == "append"
               else await store.finish("s1", None, ""))
    assert outcome.unowned
    (claimed,) = await tended(store, "r2", 5)
    assert claimed.session_id == "s1"


async def test_owned_work_is_not_reasserted(store: SessionStore) -> None:
    await new_session(store)
    assert (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).lease is not None
    assert not (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).unowned


async def test_renewing_a_lease_puts_the_work_back_in_the_schedule(store: SessionStore, redis_client) -> None:
    from gateway.store.keys import SCHEDULE

    await new_session(store)
    lease = (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).lease
    assert lease is not None
    await redis_client.zrem(SCHEDULE, "s1")
    assert await store.renew("s1", lease) == Renewal.RENEWED
    assert await redis_client.zscore(SCHEDULE, "s1") == (await store.view("s1")).lease_until_ms


async def test_the_tender_never_overwrites_a_newer_due_now(store: SessionStore, redis_client) -> None:
    from gateway.store.keys import SCHEDULE

    await redis_client.zadd(SCHEDULE, {"s9": 1000})

    async def rescore(*args: object) -> int:
        return await store._scripts.run("rescore", [SCHEDULE], args)

    await redis_client.zadd(SCHEDULE, {"s9": 0})  # an append made it due now after the tender read 1000
    assert await rescore("s9", 1000, 99_999) == 0
    assert await redis_client.zscore(SCHEDULE, "s9") == 0
    assert await rescore("s9", 0, 99_999) == 1
    assert await redis_client.zscore(SCHEDULE, "s9") == 99_999
    assert await rescore("s9", 99_999, "") == 1
    assert await redis_client.zscore(SCHEDULE, "s9") is None


# --- scheduling: parking, ranked claims, update mode ----------------------------


async def test_parking_waits_for_unread_input_and_the_next_input_resumes(store: SessionStore) -> None:
    await new_session(store)
    lease = (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).lease
    assert lease is not None
    await store.append("s1", text(1, "b"), "r1", TOO_LARGE)
    read = await store.read_input("s1", "0-0", block_ms=10)
    assert not await store.park("s1", lease, read[0].id), "input the owner has not read keeps it"
    assert await store.park("s1", lease, read[-1].id)
    view = await store.view("s1")
    assert (view.parked, view.owner, view.parks, view.state) == (True, None, 1, SessionState.STREAMING)
    assert await tended(store, "r2", 5) == [], "a parked session waits for input, not for room"
    assert await store.renew("s1", lease) == Renewal.TAKEN, "the parked runner's lease is gone"

    resumed = await store.append("s1", text(2, "c"), "r2", TOO_LARGE)
    assert resumed.lease == Lease("r2", 2)
    view = await store.view("s1")
    assert (view.parked, view.owner, view.resumes) == (False, "r2", 1)


async def test_a_parked_session_resumed_without_room_waits_for_a_tender(store: SessionStore) -> None:
    await new_session(store)
    lease = (await store.append("s1", text(0, "a"), "r1", TOO_LARGE)).lease
    assert lease is not None
    read = await store.read_input("s1", "0-0", block_ms=10)
    assert await store.park("s1", lease, read[-1].id)
    outcome = await store.finish("s1", None, "")
    assert outcome.state is SessionState.GENERATING and outcome.lease is None and outcome.unowned
    (claimed,) = await tended(store, "r2", 1)
    assert claimed.lease == Lease("r2", 2)


async def test_the_tender_claims_answers_first_and_keeps_listening_work_in_its_cap(store: SessionStore) -> None:
    for sid in ("listen-1", "listen-2", "answer"):
        await new_session(store, sid)
        await store.append(sid, text(0, "a", end=sid == "answer"), "", TOO_LARGE)
    outcomes, _ = await tend_round(store, "r1", Room(total=2, listening=1))
    claimed = {o.session_id for o in outcomes if o.lease}
    assert "answer" in claimed and len(claimed) == 2
    outcomes, answers_waiting = await tend_round(store, "r1", Room(total=0, listening=0))
    assert outcomes == [] and answers_waiting == 0, "only listening work is left waiting"
    await new_session(store, "late-answer")
    await store.append("late-answer", text(0, "a", end=True), "", TOO_LARGE)
    _, answers_waiting = await tend_round(store, "r1", Room(total=0, listening=0))
    assert answers_waiting == 1, "the replica must make room for it"


async def test_replacing_a_chunk_marks_a_restart_only_for_input_the_engine_took(store: SessionStore) -> None:
    await new_session(store)
    await store.append("s1", text(0, "aa"), "r1", TOO_LARGE)
    await store.append("s1", text(2, "cc"), "r1", TOO_LARGE)  # beyond a gap: not fed yet
    assert not (await store.replace("s1", text(2, "zz"), "r1", kept_tokens=0)).duplicate
    assert [e.kind for e in await store.read_input("s1", "0-0", block_ms=10)] == ["chunk"]
    await store.replace("s1", text(0, "bb"), "r1", kept_tokens=0)
    events = await store.read_input("s1", "0-0", block_ms=10)
    assert [(e.kind, e.value) for e in events][-1] == ("restart", "2")
    assert [c.payload for c in await store.load_chunks("s1", [0, 2])] == [b"bb", b"zz"]
    assert (await store.replace("s1", text(0, "bb"), "r1", kept_tokens=0)).duplicate

    with pytest.raises(errors.SessionPayloadTooLarge):
        await store.replace("s1", text(0, "x" * 99), "r1", kept_tokens=0)
    with pytest.raises(errors.SequenceConflict):
        await store.replace("s1", text(7, "x"), "r1", kept_tokens=0)
    view = await store.view("s1")
    assert (view.bytes, view.state, view.replaced) == (4, SessionState.STREAMING, 2)


async def test_deployments_on_two_databases_of_one_redis_server_do_not_hear_each_others_asks(
        redis_url: str) -> None:
    """Pub/sub spans the Redis server, not a database. A process of another deployment (another
    database) that heard our hang-up ask would answer it in its own database, and we would wait
    for that answer until the ask timed out."""
    base, database = redis_url.rsplit("/", 1)
    ours_client = aioredis.Redis.from_url(redis_url)
    theirs_client = aioredis.Redis.from_url(f"{base}/{int(database or 0) + 1}")
    ours, theirs = SessionStore(ours_client, timeout_sec=2.0), SessionStore(theirs_client, timeout_sec=2.0)
    heard: list[tuple[str, str, str]] = []

    async def listen() -> None:
        async for ask in theirs.hang_up_requests():
            heard.append(ask)

    listening = asyncio.create_task(listen())
    try:
        async with asyncio.timeout(5):
            while not await ours_client.pubsub_channels():  # type: ignore[no-untyped-call]  # noqa: ASYNC110 (another client subscribes)
                await asyncio.sleep(0.01)
            assert await ours.ask_hang_up("rtc_unknown", "someone", wait_sec=30) is False
        assert heard == []
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)
        await ours_client.aclose()
        await theirs_client.aclose()
