"""Property test of the session state machine against a real Redis.

Random interleavings of append / duplicate / conflicting append / finish /
cancel / expire, several at a time as concurrent clients would send them.
Invariants: every acknowledged chunk is consumed exactly once and in order,
acknowledged content never changes, no state goes backwards, and terminal
sessions stay terminal.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.domain.policies import StartThresholds
from gateway.domain.states import SessionState
from gateway.store.keys import SCHEDULE, session_keys
from gateway.store.records import ChunkRecord
from gateway.store.redis_store import SessionStore
from tests.gateway.test_store import EXPIRED, TOO_LARGE, new, tended

RANK = {SessionState.OPEN: 0, SessionState.STREAMING: 1, SessionState.GENERATING: 2}

append = st.tuples(st.just("append"), st.integers(0, 5), st.sampled_from("aab"),
                   st.sampled_from([False, False, False, True]))
# Appends dominate, as in real traffic, so sessions get far enough for the
# interesting paths (contiguous runs, start, end of input) to happen.
op = st.one_of(
    *[append] * 24,
    *[st.tuples(st.just("finish"), st.one_of(st.none(), st.integers(0, 5)))] * 2,
    st.tuples(st.just("cancel")),
    st.tuples(st.just("expire")),
)
#: After the random steps, clients retry every id concurrently: sessions still
#: live then fill their gaps, so long contiguous runs are always exercised.
FILL = [("append", seq, "a", False) for seq in range(6)]
steps = st.lists(st.lists(op, min_size=1, max_size=3), min_size=3, max_size=16)


def chunk(seq: int, variant: str, end: bool) -> ChunkRecord:
    return ChunkRecord(seq, "text", f"{variant}{seq}".encode(), end_of_input=end)


async def run(store: SessionStore, client: aioredis.Redis, sid: str, step: tuple[Any, ...],
              acked: dict[int, bytes]) -> None:
    try:
        if step[0] == "append":
            record = chunk(step[1], step[2], step[3])
            outcome = await store.append(sid, record, "r1", TOO_LARGE, caller="me")
            if not outcome.duplicate:
                assert step[1] not in acked
                acked[step[1]] = record.payload
            else:
                # A concurrent twin may not have recorded its ack yet: compare with Redis, by
                # digest (a concurrent cancel or expiry takes the chunks, never the digests).
                stored = await client.hget(session_keys(sid).digests, str(step[1]))
                assert stored is not None and stored.decode() == record.digest_record()
        elif step[0] == "finish":
            await store.finish(sid, step[1], "r1", caller="me")
        elif step[0] == "cancel":
            await store.cancel(sid, EXPIRED, caller="me")
        else:
            await client.hset(session_keys(sid).meta, "expires_at", 0)
            await client.zadd(SCHEDULE, {sid: 0})
            await tended(store, "r2", 1)
    except (errors.ConflictError, errors.ValidationFailed, errors.SessionExpired, errors.PayloadTooLarge):
        pass  # refusals are fine; what matters is that they changed nothing


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=steps)
async def test_random_interleavings_keep_the_invariants(redis_url: str, plan: list[list[tuple[Any, ...]]]) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        store = SessionStore(client, timeout_sec=2.0)
        sid = f"prop-{uuid.uuid4().hex}"
        await store.create(sid, new(identity="me", max_out_of_order=8, max_chunks=100, max_bytes=10_000,
                                    start=StartThresholds(chunks=2)), "r1", None, TOO_LARGE)
        acked: dict[int, bytes] = {}
        previous = SessionState.OPEN
        for concurrent in [*plan, FILL]:
            await asyncio.gather(*(run(store, client, sid, step, acked) for step in concurrent))
            state = (await store.view(sid)).state
            if previous.is_terminal:
                assert state is previous, f"terminal {previous} became {state}"
            elif not state.is_terminal:
                assert RANK[state] >= RANK[previous], f"{previous} went back to {state}"
            previous = state

        view = await store.view(sid)
        consumed = [e.sequence_id for e in await store.read_input(sid, "0-0", block_ms=10) if e.kind == "chunk"]
        next_seq = view.next_seq
        assert consumed == list(range(next_seq)), "consumed out of order or twice"
        assert set(consumed) <= set(acked), "consumed a chunk nobody acknowledged"
        assert all(seq in acked for seq in range(next_seq))
        if view.state.is_terminal:
            assert not await client.exists(session_keys(sid).chunks), "an ended session's chunks stay"
        else:
            stored = await store.load_chunks(sid, sorted(acked)) if acked else []
            assert {c.sequence_id: c.payload for c in stored} == acked, "acknowledged content changed"
        buffered = sorted(seq for seq in acked if seq >= next_seq)
        assert view.missing_sequence_ids == [s for s in range(next_seq, max(buffered, default=-1) + 1)
                                             if s not in acked] or view.final_seq is not None
        if view.state is SessionState.FAILED:
            assert view.error and view.error["error"]["code"]
