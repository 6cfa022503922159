"""All session I/O against Redis, one method per operation.

Every state change is one Lua script (``lua/``), so two replicas racing on
one session always see a consistent order. A method returns only after
Redis answered, so a 2xx built on it means the data is in Redis. Script
replies are turned into outcomes or domain errors here; nothing from
``redis.*`` escapes (see ``translate_redis_errors``). redis-py types a
reply as "an awaitable or a value", so replies are held as ``Any`` and
decoded into typed values on the spot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway import errors
from gateway.domain.scheduling import SchedulePolicy, WaitingWork, ranked
from gateway.domain.states import SessionState
from gateway.store.connection import translate_redis_errors
from gateway.store.durability import ACKNOWLEDGED, Durability, run_replicated
from gateway.store.durability import check as check_durability
from gateway.store.keys import (
    DEAD_LETTERS,
    OPEN_SESSIONS,
    SCHEDULE,
    SCHEDULE_FAILURES,
    SessionKeys,
    call_hang_up_reply,
    call_sideband,
    channels,
    client_secret,
    engine_card,
    idempotency,
    identity_rate,
    identity_sessions,
    reader_wake,
    realtime_conversation,
    session_keys,
)
from gateway.store.records import ChunkRecord, Frame, InputOutcome, Lease, Renewal
from gateway.store.replies import Reply, decoded
from gateway.store.script_pipe import ScriptPipe
from gateway.store.scripts import LuaScripts
from gateway.store.session_hash import RECORD_FIELDS, NewSession, SessionRecord
from gateway.store.stream_reader import Entry, StreamReader, Subscription, entries_of

logger = logging.getLogger(__name__)

#: A schedule score that is due on every replica whatever its clock.
DUE_NOW = 0
#: A due session whose script fails is looked at again after 1, 2, 4, 8 s, then
#: dead-lettered at its fifth failure (``lua/quarantine.lua``).
QUARANTINE_BACKOFF_MS = 1_000
QUARANTINE_FAILURES = 5


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class InputEvent:
    """One entry of a session's input stream, read by the owner."""

    id: str
    #: "chunk", "end", "abort" or "restart" (a chunk the engine took in was replaced).
    kind: str
    sequence_id: int = -1
    #: For "end": when input became complete (ms); for "abort": the new state;
    #: for "restart": the session's count of replaced chunks at that moment.
    value: str = ""


@dataclass(frozen=True)
class TendOutcome:
    """A session the tender ended."""

    session_id: str
    #: ``expired``, or ``failed`` (input never completed).
    state: SessionState
    previous_state: SessionState


def open_session_entry(session_id: str, identity: str) -> str:
    """A session's entry in the global cap: its id and identity, so a sweep can free both slots."""
    return f"{session_id} {identity}"


@dataclass
class SlotSweep:
    """What one look at a stretch of the global cap found."""

    #: Where the next look starts (0: the end was reached, start again).
    next_start: int
    #: Slots of ended sessions freed now.
    freed: int = 0
    #: Entries whose session has no keys: gone, or about to be made.
    gone: list[str] = field(default_factory=list)
    #: Entries of live sessions (scheduled now, unless they were).
    live: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Quarantined:
    """A due session whose own script failed: looked at again later, or never (``dead``)."""

    session_id: str
    failures: int
    dead: bool
    error: str


@dataclass(frozen=True)
class TendRound:
    """What one tender round found: sessions it ended, and work waiting for an owner."""

    ended: list[TendOutcome]
    #: Started sessions with no live owner, best first (``domain/scheduling.py``).
    waiting: list[WaitingWork]
    #: Sessions whose script failed this round; the others were tended all the same.
    quarantined: list[Quarantined] = field(default_factory=list)


def _error_for(reply: Reply, session_id: str, sequence_id: int | None = None) -> errors.GatewayError:
    status = reply.status
    if status == "not_found":
        return errors.SessionNotFound(f"no session {session_id!r}")
    if status == "expired":
        return errors.SessionExpired(f"session {session_id!r} expired after being idle")
    if status == "closed":
        return errors.SessionClosed(f"session {session_id!r} is {reply.text('state')}: it has ended (no more "
                                    "input, nothing to cancel)")
    if status == "conflict":
        return errors.SequenceConflict(
            f"sequence_id {sequence_id} was already received with different content",
            param="sequence_id")
    if status == "input_closed":
        return errors.InputClosed(
            f"input already ends at sequence_id {reply.number('final_seq')}: no chunk after it is taken, and "
            "only that one says end_of_input", param="sequence_id")
    if status == "out_of_window":
        return errors.SequenceOutOfWindow(
            f"sequence_id is too far ahead of the next expected id {reply.number('next_seq')}",
            param="sequence_id")
    if status == "too_many":
        return errors.TooManyChunks("the session has reached its chunk limit")
    if status == "too_large":
        error = errors.SessionPayloadTooLarge(
            "the session's total payload exceeds its cap; the session is closed")
        error.previous_state = reply.state("previous_state")
        return error
    if status == "too_long":
        tokens, limit = reply.number("tokens"), reply.number("max_tokens")
        return errors.ContextLengthExceeded(
            f"the input would be at least {tokens} tokens, more than the model's context allows "
            f"({limit} tokens for the input); the session is unchanged",
            param="sequence_id", prompt_tokens=tokens, max_input_tokens=limit)
    if status == "empty":
        return errors.EmptyInput("finish without final_sequence_id needs at least one chunk")
    if status == "exists":
        return errors.SessionExists(f"session {session_id!r} already exists")
    if status == "unknown":
        return errors.SequenceConflict(
            f"sequence_id {sequence_id} was never received, so there is nothing to replace; send it as a new "
            f"chunk (the next expected id is {reply.number('next_seq')})", param="sequence_id")
    if status == "over_cap":
        return errors.SessionPayloadTooLarge(
            f"the replacement would take the session's input past its cap of {reply.number('max_bytes')} "
            "bytes; the session is unchanged")
    return errors.GatewayError(f"unexpected store reply {status!r}")


def _frame(entry_id: str, fields: dict[str, str]) -> Frame:
    return Frame(entry_id, fields["e"], fields["d"], fields["t"] == "1")


def _input_events(entries: list[Entry]) -> list[InputEvent]:
    events: list[InputEvent] = []
    for entry, fields in entries:
        if "s" in fields:
            events.append(InputEvent(entry, "chunk", int(fields["s"])))
        elif "end" in fields:
            events.append(InputEvent(entry, "end", value=fields["end"]))
        elif "restart" in fields:
            events.append(InputEvent(entry, "restart", value=fields["restart"]))
        else:
            events.append(InputEvent(entry, "abort", value=fields["abort"]))
    return events


def _frames(entries: list[Entry]) -> list[Frame]:
    return [_frame(entry, fields) for entry, fields in entries]


def _input_outcome(reply: Reply, replica: str) -> InputOutcome:
    started, epoch = reply.number("started"), reply.number("lease_epoch")
    return InputOutcome(
        state=reply.state(),
        previous_state=reply.state("previous_state"),
        started=started == 1,
        unowned=started == 2,
        next_sequence_id=reply.number("next_seq"),
        duplicate=reply.status in ("duplicate", "unchanged"),
        missing_sequence_ids=reply.numbers("missing"),
        lease=Lease(replica, epoch) if epoch > 0 else None,
        token_mark=reply.values.get("token_mark"),
    )


class SessionStore:
    def __init__(self, client: aioredis.Redis, *, timeout_sec: float, durability: Durability = "everysec",
                 replica_wait_ms: int = 1000) -> None:
        self._redis = client
        self._timeout = timeout_sec
        #: ``replica``: acknowledged scripts wait for a replica (store/durability.py).
        self._replica_wait_ms = replica_wait_ms if durability == "replica" else 0
        self._scripts = LuaScripts(client)
        pool = None if isinstance(client, RedisCluster) else client.connection_pool
        self._channels = channels(int(pool.connection_kwargs.get("db") or 0) if pool is not None else 0)
        #: The per-token call (publish) goes through here: one round trip for many sessions.
        #: Redis Cluster refuses scripts in a pipeline (redis-py blocks them): one call each there.
        self._pipe: ScriptPipe | None = (
            None if isinstance(client, RedisCluster) else ScriptPipe(client, self._scripts, timeout_sec))
        # One reader for every stream this replica waits on (runners' input, SSE
        # subscribers' frames); on a Cluster each waiter reads its own (one slot per session).
        self._reader = StreamReader(client, reader_wake(secrets.token_hex(8)), self._call,
                                    multiplex=not isinstance(client, RedisCluster))

    async def aclose(self) -> None:
        """Stop the stream reader (the lifespan closes the client next)."""
        await self._reader.aclose()

    @asynccontextmanager
    async def _call(self, extra_sec: float = 0.0) -> AsyncIterator[None]:
        """Every Redis call: bounded in time, foreign errors translated."""
        with translate_redis_errors():
            async with asyncio.timeout(self._timeout + extra_sec):
                yield

    async def _run(self, name: str, keys: SessionKeys, args: Sequence[Any], *, piped: bool = False) -> Reply:
        if piped and self._pipe is not None:
            # The pipe bounds each round trip itself: one timer per pipeline, not one per
            # call (a timer and a context per publish were a tenth of the engine process's
            # CPU at 200 streaming sessions). A call queued behind a round trip in flight
            # waits for that one first, so it fails after two timeouts at most.
            with translate_redis_errors():
                raw = await self._pipe.run(name, keys, args)
        elif self._replica_wait_ms and name in ACKNOWLEDGED:
            async with self._call():
                raw = await run_replicated(self._redis, self._scripts, name, keys, args, self._replica_wait_ms)
        else:
            async with self._call():
                raw = await self._scripts.run(name, keys, args)
        return Reply.parse(name, raw)

    # --- health ---------------------------------------------------------

    async def ping(self) -> None:
        async with self._call():
            await self._redis.ping()

    async def check_durability(self, level: Durability) -> list[str]:
        """Warn at start when Redis's settings do not give ``level`` (store/durability.py)."""
        try:
            async with self._call():
                return await check_durability(self._redis, level)
        except errors.StoreUnavailable as exc:
            logger.warning("durability: not checked, %s", exc.message)
            return []

    # --- input side -----------------------------------------------------

    # ``replica`` on the input calls: the caller's id when it has room to take
    # engine work this call starts, '' when it does not (the work then waits).

    async def create(
        self, session_id: str, new: NewSession, replica: str, first: ChunkRecord | None, too_large_json: str,
    ) -> InputOutcome:
        chunk_args: list[Any] = ["0", "", "", "", "0", ""]
        if first is not None:
            chunk_args = ["1", first.sequence_id, first.digest_record(), first.to_blob(),
                          int(first.end_of_input), too_large_json]
        flat = [item for pair in new.to_hash().items() for item in pair]
        reply = await self._run("create", session_keys(session_id), [now_ms(), replica, *chunk_args, *flat])
        if reply.status != "accepted":
            # A refused first chunk leaves no session behind, so no slot either
            # (``admit`` took it just before). A session that exists keeps its slot.
            if reply.status != "exists":
                await self._free_slots(session_id, new.identity)
            raise _error_for(reply, session_id, first.sequence_id if first else None)
        outcome = _input_outcome(reply, replica)
        if outcome.started:
            await self._schedule_if_started(session_id, outcome)
        else:
            await self.schedule(session_id, now_ms() + new.timeout_ms)
        return outcome

    async def append(
        self, session_id: str, chunk: ChunkRecord, replica: str, too_large_json: str, caller: str = "",
    ) -> InputOutcome:
        """``caller``: the identity asking; a session of another identity is not found."""
        args = [now_ms(), replica, chunk.sequence_id, chunk.digest_record(), chunk.to_blob(),
                int(chunk.end_of_input), too_large_json, caller]
        reply = await self._run("append", session_keys(session_id), args)
        if reply.status in ("accepted", "duplicate"):
            outcome = _input_outcome(reply, replica)
            await self._schedule_if_started(session_id, outcome)
            return outcome
        if reply.status == "too_large":
            await self._free_slots(session_id, reply.text("identity"))
        raise _error_for(reply, session_id, chunk.sequence_id)

    async def finish(self, session_id: str, final_sequence_id: int | None, replica: str,
                     caller: str = "") -> InputOutcome:
        asked = "" if final_sequence_id is None else final_sequence_id
        reply = await self._run("finish", session_keys(session_id), [now_ms(), replica, asked, caller])
        if reply.status == "below_received":
            raise errors.SequenceConflict(
                f"final_sequence_id {final_sequence_id} is below a chunk already received (sequence_id "
                f"{reply.number('max_seq')}): the input cannot end before it", param="final_sequence_id")
        if reply.status != "accepted":
            error = _error_for(reply, session_id, final_sequence_id)
            if error.param == "sequence_id":  # this call's field
                error.param = "final_sequence_id"
            raise error
        outcome = _input_outcome(reply, replica)
        await self._schedule_if_started(session_id, outcome)
        return outcome

    async def replace(self, session_id: str, chunk: ChunkRecord, replica: str, kept_tokens: int,
                      caller: str = "") -> InputOutcome:
        """Replace a chunk already received (update mode); ``duplicate`` when it is the same content."""
        args = [now_ms(), replica, chunk.sequence_id, chunk.digest_record(), chunk.to_blob(), caller, kept_tokens]
        reply = await self._run("replace", session_keys(session_id), args)
        if reply.status not in ("replaced", "unchanged"):
            raise _error_for(reply, session_id, chunk.sequence_id)
        outcome = _input_outcome(reply, replica)
        await self._schedule_if_started(session_id, outcome)
        return outcome

    async def token_mark(self, session_id: str, sequence_id: int) -> str | None:
        """The token mark kept for ``sequence_id`` (``service/token_marks.py``), if any."""
        async with self._call():
            value: Any = await self._redis.hget(session_keys(session_id).digests, f"tokens:{sequence_id}")
        return None if value is None else str(decoded(value))

    async def keep_token_marks(self, session_id: str, first: int, counted_from: str | None,
                               marks: Sequence[tuple[str, str]]) -> bool:
        """Keep the marks after chunks ``first``, ``first + 1``...: pairs (the chunk's content sha256,
        the mark after it), counted from ``counted_from`` (the mark of ``first``; ``None`` at 0).

        Only marks whose chunks are still stored as counted are kept. True when the chunk after the
        last one is already here with no mark after it (it arrived early): count it too.
        """
        args = [now_ms(), first, counted_from or "", *(item for pair in marks for item in pair)]
        reply = await self._run("mark_tokens", session_keys(session_id), args)
        return reply.status == "kept" and reply.number("more") == 1

    async def cancel(self, session_id: str, cancelled_json: str, caller: str = "") -> SessionState:
        """Cancel; returns the state before (``cancelled`` again when repeated)."""
        reply = await self._run("cancel", session_keys(session_id), [now_ms(), cancelled_json, caller])
        if reply.status != "accepted":
            raise _error_for(reply, session_id)
        await self._free_slots(session_id, reply.text("identity"))
        return reply.state("previous_state")

    # --- limits -----------------------------------------------------------

    async def admit(self, identity: str, session_id: str, *, per_identity: int, overall: int,
                    until_ms: int) -> None:
        """Count a new session against the global and the per-identity caps.

        Two keys in two slots, so two steps; a session refused by the second
        is taken back out of the first. ``until_ms`` bounds how long an entry
        counts if its release is ever lost (a replica dying at the wrong time).
        """
        now = now_ms()
        everyone = open_session_entry(session_id, identity)
        async with self._call():
            if not await self._scripts.run("admit", [OPEN_SESSIONS], [now, overall, everyone, until_ms]):
                raise errors.CapacityExhausted("the service is at its session capacity; retry later")
            admitted = await self._scripts.run(
                "admit", [identity_sessions(identity)], [now, per_identity, session_id, until_ms])
            if not admitted:
                await self._redis.zrem(OPEN_SESSIONS, everyone)
        if not admitted:
            raise errors.TooManySessions(
                f"this identity already has {per_identity} open sessions; finish or cancel one",
                retry_after=5)

    async def _free_slots(self, session_id: str, identity: str | None) -> None:
        """A session ended: it no longer counts against any cap.

        Idempotent, so every script that finds the session ended frees them
        again: a release that failed once is healed by the next one (a
        retried call, the runner's retry, the tender's look at the session).
        ``identity`` unknown (the session's keys are gone): nothing here; the
        tender's sweep of the caps (``sweep_slots``) finds the entry.
        """
        if not identity:
            return
        async with self._call():
            pipe = self._redis.pipeline(transaction=False)
            pipe.zrem(OPEN_SESSIONS, open_session_entry(session_id, identity))
            pipe.zrem(identity_sessions(identity), session_id)
            await pipe.execute()

    async def sweep_slots(self, start: int, count: int) -> SlotSweep:
        """Look at ``count`` entries of the global cap from rank ``start``: free the slots of
        sessions that ended, schedule live ones the schedule lost, and name the ones whose
        keys are gone (or not made yet: ``admit`` comes just before ``create``).

        The self-healing behind every release: a session whose end was recorded but
        whose release failed, and which no script looks at again (never scheduled: its
        scheduling failed too), would otherwise hold its slots until their entries lapse.
        """
        async with self._call():
            raw: Any = await self._redis.zrange(OPEN_SESSIONS, start, start + count - 1)
            entries = [str(decoded(entry)) for entry in raw]
            pipe = self._redis.pipeline(transaction=False)
            for entry in entries:
                pipe.hget(session_keys(entry.split(" ", 1)[0]).meta, "state")
            states: list[Any] = await pipe.execute() if entries else []
        sweep = SlotSweep(next_start=start + len(entries) if len(entries) == count else 0)
        for entry, state in zip(entries, states, strict=True):
            session_id, _, identity = entry.partition(" ")
            if state is None:
                sweep.gone.append(entry)
            elif SessionState(decoded(state)).is_terminal:
                await self._free_slots(session_id, identity)
                sweep.freed += 1
            else:
                sweep.live.append(entry)
        if sweep.live:
            live = {entry.partition(" ")[0]: DUE_NOW for entry in sweep.live}
            async with self._call():  # kept if scheduled; one the schedule lost is due now
                await self._redis.zadd(SCHEDULE, live, nx=True)
        return sweep

    async def drop_slot_entries(self, entries: Sequence[str]) -> None:
        """Free the slots of sessions ``sweep_slots`` found gone (and gone still, a while later)."""
        async with self._call():
            pipe = self._redis.pipeline(transaction=False)
            for entry in entries:
                session_id, _, identity = entry.partition(" ")
                pipe.zrem(OPEN_SESSIONS, entry)
                if identity:
                    pipe.zrem(identity_sessions(identity), session_id)
            await pipe.execute()

    async def remember_creation(self, identity: str, key: str, made: str, ttl_ms: int) -> str | None:
        """Note that ``key`` (an identity's ``Idempotency-Key``) makes ``made``, unless it made
        something already: then return that. Kept ``ttl_ms``, as long as the session can be read."""
        name = idempotency(identity, hashlib.sha256(key.encode()).hexdigest()[:32])
        async with self._call():
            if await self._redis.set(name, made, px=max(1, ttl_ms), nx=True):
                return None
            first: Any = await self._redis.get(name)
        return None if first is None else str(decoded(first))

    async def take_token(self, identity: str, rate: float, burst: int) -> None:
        """One request's worth of the identity's token bucket, or 429."""
        async with self._call():
            wait_ms = await self._scripts.run("rate", [identity_rate(identity)], [now_ms(), rate, burst])
        if int(wait_ms) > 0:
            raise errors.TooManyRequests("too many requests for this identity; slow down",
                                         retry_after=max(1, -(-int(wait_ms) // 1000)))

    # --- transports' own state ---------------------------------------------

    async def save_conversation(self, conversation_id: str, state: str, ttl_sec: float) -> None:
        """A Realtime connection's state, kept ``ttl_sec`` past its last change."""
        await self._set_text(realtime_conversation(conversation_id), state, ttl_sec)

    async def load_conversation(self, conversation_id: str) -> str | None:
        return await self._get_text(realtime_conversation(conversation_id))

    async def save_client_secret(self, digest: str, record: str, ttl_sec: float) -> None:
        """A Realtime client secret's record, gone from Redis when the secret expires."""
        await self._set_text(client_secret(digest), record, ttl_sec)

    async def load_client_secret(self, digest: str) -> str | None:
        return await self._get_text(client_secret(digest))

    # --- WebRTC calls: what other processes ask of the one holding a call --------

    async def ask_hang_up(self, call_id: str, identity: str, wait_sec: float) -> bool:
        """Ask whichever process holds the call (another replica, another API worker) to end
        it, if it is ``identity``'s; whether one did within ``wait_sec``."""
        return await self._ask_holder(self._channels.call_hang_ups, [call_id, identity], wait_sec)

    async def ask_attach(self, call_id: str, identity: str, attachment: str, wait_sec: float) -> bool:
        """Ask whichever process holds the call to relay it to a control socket here, through the
        ``attachment``'s channels (``call_sideband``), if it is ``identity``'s; whether one does."""
        return await self._ask_holder(self._channels.call_attaches, [call_id, identity, attachment], wait_sec)

    async def _ask_holder(self, channel: str, ask: list[str], wait_sec: float) -> bool:
        """Every process that hears the ask answers, holder or not: an unknown call is a "no"
        as soon as all have answered (milliseconds), not after ``wait_sec``."""
        call_id, identity, *rest = ask
        reply = call_hang_up_reply(secrets.token_hex(8))
        async with self._call():
            listeners = await self._redis.publish(channel, json.dumps([call_id, identity, reply, *rest]))
        deadline = asyncio.get_running_loop().time() + wait_sec
        for _ in range(listeners):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            async with self._call(left):
                answered: Any = await self._redis.blpop([reply], timeout=left)
            if answered is None:
                return False
            if answered[1] in (b"1", "1"):
                return True
        return False

    async def hang_up_requests(self) -> AsyncIterator[tuple[str, str, str]]:
        """(call id, identity, reply key) of each hang-up asked for, as it comes (pub/sub: only
        while listening; the one who asked gets no answer otherwise, and says so)."""
        async for message in self._messages(self._channels.call_hang_ups):
            call_id, identity, reply = json.loads(message)
            yield str(call_id), str(identity), str(reply)

    async def attach_requests(self) -> AsyncIterator[tuple[str, str, str, str]]:
        """(call id, identity, reply key, attachment) of each control socket asking for a call."""
        async for message in self._messages(self._channels.call_attaches):
            call_id, identity, reply, attachment = json.loads(message)
            yield str(call_id), str(identity), str(reply), str(attachment)

    async def answer_ask(self, reply: str, *, held: bool) -> None:
        """Tell the one who asked (a hang-up, a control socket) whether this process holds the
        call and does what was asked."""
        async with self._call():
            pipe = self._redis.pipeline(transaction=False)
            pipe.rpush(reply, int(held))
            pipe.expire(reply, 10)
            await pipe.execute()

    async def tell_sideband(self, attachment: str, direction: str, message: str) -> None:
        """One message on a control socket's channel (``call_sideband``)."""
        async with self._call():
            await self._redis.publish(call_sideband(attachment, direction), message)

    @asynccontextmanager
    async def sideband(self, attachment: str, direction: str) -> AsyncIterator[AsyncIterator[str]]:
        """The messages on a control socket's channel, subscribed before the block starts (so
        nothing told after it is missed), until it ends."""
        async with self._subscribed(call_sideband(attachment, direction)) as messages:
            yield messages

    # --- a replica's processes ---------------------------------------------

    async def publish_engine_card(self, replica: str, card: str, ttl_sec: float) -> None:
        await self._set_text(engine_card(replica), card, ttl_sec)

    async def engine_card(self, replica: str) -> str | None:
        """The card the replica's engine process published, ``None`` once it stopped renewing it."""
        return await self._get_text(engine_card(replica))

    async def _set_text(self, key: str, value: str, ttl_sec: float) -> None:
        async with self._call():
            await self._redis.set(key, value, px=max(1, int(ttl_sec * 1000)))

    async def _get_text(self, key: str) -> str | None:
        async with self._call():
            value: Any = await self._redis.get(key)
        return None if value is None else str(decoded(value))

    async def work_waiting(self) -> AsyncIterator[str]:
        """Session ids whose engine work was left waiting for an owner, as they are announced.

        Pub/sub: an announcement made while nobody listens is lost, which is
        fine, since the schedule holds the work and the next tender round finds it.
        """
        async for message in self._messages(self._channels.work_waiting):
            yield message

    async def _messages(self, channel: str) -> AsyncIterator[str]:
        """What is published on ``channel`` from now on, for as long as the caller listens."""
        async with self._subscribed(channel) as messages:
            async for message in messages:
                yield message

    @asynccontextmanager
    async def _subscribed(self, channel: str) -> AsyncIterator[AsyncIterator[str]]:
        """Subscribed to ``channel`` for the block: what is published on it from the block's start."""
        with translate_redis_errors():
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(channel)

                async def messages() -> AsyncIterator[str]:
                    with translate_redis_errors():
                        async for message in pubsub.listen():
                            if message["type"] == "message":
                                yield str(decoded(message["data"]))

                yield messages()
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    # --- the schedule: expiry and ownership ------------------------------

    async def schedule(self, session_id: str, due_ms: int) -> None:
        """Have a tender look at the session by ``due_ms`` (never later than already planned)."""
        async with self._call():
            await self._redis.zadd(SCHEDULE, {session_id: due_ms}, lt=True)

    async def _schedule_if_started(self, session_id: str, outcome: InputOutcome) -> None:
        """Started (or ownerless) work is due for a tender now.

        If nobody took it, any replica with room claims it; if this one did,
        the tender learns when its lease could lapse and looks again then.
        The schedule lives in another Redis slot, so this is a second call
        that can fail after the script succeeded. Work nobody owns must not
        be left unscheduled: the client gets a 503 and its retry (a
        duplicate, which re-asserts ownerless work) schedules it. Work this
        replica took runs anyway; its heartbeat schedules it.
        """
        if not (outcome.started or outcome.unowned):
            return
        try:
            await self.schedule(session_id, DUE_NOW)
            if outcome.lease is None:
                await self._announce(session_id)
        except errors.StoreUnavailable:
            if outcome.lease is None:
                raise
            logger.warning("session %s: could not schedule its started work; its runner will", session_id)

    async def _announce(self, session_id: str) -> None:
        """Tell the tenders that work waits for an owner, so an engine process with room
        claims it now, not at its next round. Only a shortcut: the schedule has it already."""
        try:
            async with self._call():
                await self._redis.publish(self._channels.work_waiting, session_id)
        except errors.StoreUnavailable as exc:
            logger.info("session %s: waiting work not announced (%s); the next tender round finds it",
                        session_id, exc.message)

    async def tend(self, expired_json: str, incomplete_json: str, policy: SchedulePolicy = SchedulePolicy.FCFS,
                   limit: int = 200) -> TendRound:
        """Expire idle sessions; rank the engine work that waits for an owner, in ``policy`` order.

        The schedule is only a hint: each session is decided by ``tend.lua``
        on its own meta hash, which also says when to look again. The caller
        claims the waiting work it has room for (``claim``), best first. A
        session whose script fails is backed off (``_quarantine``); the round
        goes on with the others.
        """
        async with self._call():
            # Redis's clock, like the scripts': a replica's own may be off.
            clock: Any = await self._redis.time()
            now = int(clock[0]) * 1000 + int(clock[1]) // 1000
            due: Any = await self._redis.zrangebyscore(SCHEDULE, "-inf", now, start=0, num=limit, withscores=True,
                                                  score_cast_func=int)
        ended: list[TendOutcome] = []
        waiting: list[WaitingWork] = []
        quarantined: list[Quarantined] = []
        for raw, seen in due:
            session_id = decoded(raw)
            try:
                reply = await self._tend_one(session_id, seen, now, expired_json, incomplete_json)
            except Exception as exc:
                quarantined.append(await self.quarantine(session_id, exc))
                continue
            if reply.status in ("expired", "failed"):
                ended.append(TendOutcome(session_id, SessionState(reply.status), reply.state("previous_state")))
            elif reply.status == "waiting":
                waiting.append(WaitingWork(session_id, reply.state(), reply.number("arrived"),
                                           reply.number("last_input"), reply.number("computed_tokens")))
        return TendRound(ended, ranked(waiting, policy), quarantined)

    async def claim(self, session_id: str, replica: str) -> Lease | None:
        """Take waiting engine work (``tend`` ranked it); ``None`` if another replica was quicker."""
        reply = await self._run("claim", session_keys(session_id), [now_ms(), replica])
        return Lease(replica, reply.number("lease_epoch")) if reply.status == "claimed" else None

    async def _tend_one(self, session_id: str, seen: int, now: int, expired_json: str,
                        incomplete_json: str) -> Reply:
        reply = await self._run("tend", session_keys(session_id), [now, expired_json, incomplete_json])
        if reply.status in ("expired", "failed", "gone"):
            # Before its schedule entry goes: if this fails, the next round frees them.
            await self._free_slots(session_id, reply.text("identity"))
        async with self._call():
            await self._scripts.run("rescore", [SCHEDULE], [
                session_id, seen, reply.number("look_again_at") if reply.has("look_again_at") else ""])
        return reply

    async def quarantine(self, session_id: str, exc: Exception) -> Quarantined:
        """One session's script failed: back it off (the round goes on with the others),
        and after ``QUARANTINE_FAILURES`` take it out of the schedule for good.

        Redis that cannot serve fails the whole round instead: that is no one session's fault.
        """
        if isinstance(exc, errors.StoreUnavailable):
            raise exc  # the round's caller backs off
        error = f"{type(exc).__name__}: {exc}"[:500]
        async with self._call():
            raw = await self._scripts.run("quarantine", [SCHEDULE, SCHEDULE_FAILURES, DEAD_LETTERS],
                                          [session_id, QUARANTINE_FAILURES, QUARANTINE_BACKOFF_MS, error])
        reply = Reply.parse("quarantine", raw)
        return Quarantined(session_id, reply.number("failures"), reply.status == "dead", error)

    async def dead_letters(self) -> dict[str, str]:
        """Sessions taken out of the schedule for good, with the error that did it."""
        async with self._call():
            letters: Any = await self._redis.hgetall(DEAD_LETTERS)
        return {decoded(k): decoded(v) for k, v in letters.items()}

    async def park(self, session_id: str, lease: Lease, last_input_id: str) -> bool:
        """Give up idle streaming work until its next input; False if input came in meanwhile."""
        reply = await self._run("park", session_keys(session_id), [now_ms(), lease.replica, lease.epoch, last_input_id])
        return reply.status == "parked"

    async def renew(self, session_id: str, lease: Lease) -> Renewal:
        """Extend the lease, or say why it cannot be: taken, or the session ended.

        Also makes sure a tender looks by the time the lease could lapse,
        should the call that started this work have failed to schedule it.
        """
        reply = await self._run("renew", session_keys(session_id), [now_ms(), lease.replica, lease.epoch])
        if reply.status != "ok":
            ended = not reply.has("state") or reply.state().is_terminal  # no state: its keys expired
            return Renewal.ENDED if ended else Renewal.TAKEN
        await self.schedule(session_id, reply.number("lease_until"))
        return Renewal.RENEWED

    async def release(self, session_id: str, lease: Lease) -> None:
        """Hand the session's engine work back (shutdown): another replica takes it at once."""
        reply = await self._run("release", session_keys(session_id), [lease.replica, lease.epoch])
        if reply.status == "released":
            async with self._call():
                await self._redis.zadd(SCHEDULE, {session_id: DUE_NOW})

    # --- reading --------------------------------------------------------

    async def view(self, session_id: str, caller: str = "", *, with_result: bool = False) -> SessionRecord:
        """The session, read field by field; its stored result only ``with_result`` (megabytes
        with a spoken answer, and only ``/result`` shows it)."""
        # Not a status reply: the fields themselves (see view.lua), so not through Reply.
        async with self._call():
            raw = await self._scripts.run("view", session_keys(session_id),
                                          [caller, "1" if with_result else "0", *RECORD_FIELDS])
        if not raw:
            raise errors.SessionNotFound(f"no session {session_id!r}")
        values, result, missing = raw
        fields = {name: decoded(value) for name, value in zip(RECORD_FIELDS, values, strict=True)
                  if value is not None}
        if result:
            fields["result"] = decoded(result)
        return SessionRecord.from_hash(session_id, fields, [int(v) for v in missing])

    async def state(self, session_id: str) -> SessionState | None:
        """Only the session's state (``None``: its keys are gone): one field, for the checks made often."""
        async with self._call():
            state: Any = await self._redis.hget(session_keys(session_id).meta, "state")
        return None if state is None else SessionState(decoded(state))

    async def _xread(self, key: str, after: str, block_ms: int | None, count: int) -> list[Entry]:
        """Entries of one stream after ``after``, waiting up to ``block_ms`` for the first (``None``: no wait)."""
        async with self._call((block_ms or 0) / 1000):
            reply: Any = await self._redis.xread({key: after}, block=block_ms, count=count)
        return [entry for _, entries in reply or () for entry in entries_of(entries)]

    async def read_input(self, session_id: str, after: str, block_ms: int) -> list[InputEvent]:
        """One read of the input stream on a connection of its own (the runner follows it: ``input_stream``)."""
        return _input_events(await self._xread(session_keys(session_id).input, after, block_ms, 512))

    def input_stream(self, session_id: str, after: str) -> AbstractAsyncContextManager[Subscription[InputEvent]]:
        """Follow the session's input after ``after`` through the replica's shared reader."""
        return self._reader.subscribe(session_keys(session_id).input, after, _input_events)

    async def load_chunks(self, session_id: str, sequence_ids: Sequence[int]) -> list[ChunkRecord]:
        async with self._call():
            blobs: Any = await self._redis.hmget(session_keys(session_id).chunks, [str(s) for s in sequence_ids])
        if any(blob is None for blob in blobs):
            # A session's chunks go when it ends (lua/lib.lua refresh_ttl), and a live
            # one's only after its deadline: an ended session, or a lost one.
            raise errors.SessionNotFound(f"chunks of session {session_id!r} are gone")
        return [ChunkRecord.from_blob(seq, blob) for seq, blob in zip(sequence_ids, blobs, strict=True)]

    # --- output side ----------------------------------------------------

    async def publish(
        self, session_id: str, lease: Lease, first: int, frames: Sequence[tuple[str, str, bool]],
        completion: dict[str, Any] | None = None, identity: str | None = None,
    ) -> list[str] | None:
        """Append frames (event, data, last); with ``completion`` the session completes.

        ``first`` is the index of the first frame in the session's output:
        frames already written are skipped, so retrying a call whose reply was
        lost repeats nothing. Returns the ids written, or ``None`` if the
        session stopped generating (cancelled meanwhile) or ``lease`` was
        taken over, so the caller can stop its engine work.
        """
        args: list[Any] = [now_ms(), lease.replica, lease.epoch, first,
                           "completed" if completion else "", json.dumps(completion) if completion else '""']
        for event, data, last in frames:
            args += [event, data, int(last)]
        reply = await self._run("publish", session_keys(session_id), args, piped=True)
        if reply.status != "ok":
            if reply.has("identity"):  # it had ended: its slots are free, or are now
                await self._free_slots(session_id, reply.text("identity"))
            return None
        if completion:
            await self._free_slots(session_id, identity)
        return reply.texts("ids")

    async def fail(self, session_id: str, error_json: str, lease: Lease | None = None) -> SessionState | None:
        """Fail a live session; returns the state before, ``None`` if it had ended.

        With ``lease``, only while the caller still holds it.
        """
        holder = [lease.replica, lease.epoch] if lease else ["", ""]
        reply = await self._run("fail", session_keys(session_id), [now_ms(), error_json, *holder])
        if reply.status != "failed":
            if reply.has("identity"):  # it had ended: its slots are free, or are now
                await self._free_slots(session_id, reply.text("identity"))
            return None
        await self._free_slots(session_id, reply.text("identity"))
        return reply.state("previous_state")

    async def read_output(self, session_id: str) -> list[Frame]:
        """Every frame written so far (a new owner picks up from them)."""
        async with self._call():
            entries: Any = await self._redis.xrange(session_keys(session_id).output)
        return _frames(entries_of(entries))

    async def read_frames(self, session_id: str, after: str, block_ms: int | None) -> list[Frame]:
        return _frames(await self._xread(session_keys(session_id).output, after, block_ms, 256))

    def output_stream(self, session_id: str, after: str) -> AbstractAsyncContextManager[Subscription[Frame]]:
        """Follow the session's frames after ``after`` through the replica's shared reader."""
        return self._reader.subscribe(session_keys(session_id).output, after, _frames)

    async def last_frame(self, session_id: str) -> Frame | None:
        async with self._call():
            entries: Any = await self._redis.xrevrange(session_keys(session_id).output, count=1)
        return next((_frame(entry, fields) for entry, fields in entries_of(entries)), None)

    async def last_frame_id(self, session_id: str) -> str:
        frame = await self.last_frame(session_id)
        return frame.id if frame else "0-0"
