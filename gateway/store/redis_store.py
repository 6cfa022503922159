"""All session I/O against Redis, one method per operation.

Every state change is one Lua script (``lua/``), so two replicas racing on
one session always see a consistent order. A method returns only after
Redis answered, so a 2xx built on it means the data is in Redis. Script
replies are turned into outcomes or domain errors here; nothing from
``redis.*`` escapes (see ``translate_redis_errors``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway import errors
from gateway.sessions.states import SessionState
from gateway.store.connection import translate_redis_errors
from gateway.store.keys import (
    EXPIRY_INDEX,
    OPEN_SESSIONS,
    SessionKeys,
    identity_rate,
    identity_sessions,
    session_keys,
)
from gateway.store.records import ChunkRecord, Frame, InputOutcome, SessionRecord
from gateway.store.scripts import script_sources


def now_ms() -> int:
    return int(time.time() * 1000)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class InputEvent:
    """One entry of a session's input stream, read by the owner."""

    id: str
    #: "chunk", "end" or "abort".
    kind: str
    sequence_id: int = -1
    #: For "end": when input became complete (ms); for "abort": the new state.
    value: str = ""


@dataclass(frozen=True)
class ReapOutcome:
    session_id: str
    #: "expired" or "failed" (input never completed), with the state before.
    state: SessionState
    previous_state: SessionState


def _error_for(reply: list[Any], session_id: str, sequence_id: int | None = None) -> errors.GatewayError:
    status = _text(reply[0])
    detail = [_text(v) if isinstance(v, bytes) else v for v in reply[1:]]
    if status == "not_found":
        return errors.SessionNotFound(f"no session {session_id!r}")
    if status == "expired":
        return errors.SessionExpired(f"session {session_id!r} expired after being idle")
    if status == "closed":
        return errors.SessionClosed(f"session {session_id!r} is {detail[0]}; it takes no more input")
    if status == "conflict":
        return errors.SequenceConflict(
            f"sequence_id {sequence_id} was already received with different content",
            param="sequence_id")
    if status == "input_closed":
        return errors.InputClosed(
            f"input already ends at sequence_id {detail[0]}", param="sequence_id")
    if status == "out_of_window":
        return errors.SequenceOutOfWindow(
            f"sequence_id is too far ahead of the next expected id {detail[0]}",
            param="sequence_id")
    if status == "too_many":
        return errors.TooManyChunks("the session has reached its chunk limit")
    if status == "too_large":
        error = errors.SessionPayloadTooLarge(
            "the session's total payload exceeds its cap; the session is closed")
        error.previous_state = SessionState(detail[0])
        return error
    if status == "empty":
        return errors.EmptyInput("finish without final_sequence_id needs at least one chunk")
    if status == "exists":
        return errors.ConflictError(f"session {session_id!r} already exists")
    return errors.GatewayError(f"unexpected store reply {status!r}")


def _input_outcome(reply: list[Any], duplicate: bool = False) -> InputOutcome:
    return InputOutcome(
        state=SessionState(_text(reply[1])),
        previous_state=SessionState(_text(reply[2])),
        started=int(reply[3]) == 1,
        next_sequence_id=int(reply[4]),
        duplicate=duplicate,
        missing_sequence_ids=[int(v) for v in reply[5:]],
    )


class SessionStore:
    def __init__(self, client: aioredis.Redis, *, timeout_sec: float) -> None:
        self._redis = client
        self._timeout = timeout_sec
        self._scripts = {name: client.register_script(src) for name, src in script_sources().items()}

    @asynccontextmanager
    async def _call(self, extra_sec: float = 0.0):
        """Every Redis call: bounded in time, foreign errors translated."""
        with translate_redis_errors():
            try:
                async with asyncio.timeout(self._timeout + extra_sec):
                    yield
            except TimeoutError as exc:
                raise errors.StoreUnavailable("the session store did not answer in time") from exc

    async def _run(self, name: str, keys: SessionKeys, args: Sequence[Any]) -> list[Any]:
        async with self._call():
            return await self._scripts[name](keys=list(keys), args=list(args))

    # --- health ---------------------------------------------------------

    async def ping(self) -> None:
        async with self._call():
            await self._redis.ping()

    # --- input side -----------------------------------------------------

    async def create(
        self, session_id: str, fields: dict[str, Any], replica: str, first: ChunkRecord | None,
        too_large_json: str,
    ) -> InputOutcome:
        now = now_ms()
        chunk_args: list[Any] = ["0", "", "", "", "0", ""]
        if first is not None:
            chunk_args = ["1", first.sequence_id, first.digest_record(), first.to_blob(),
                          int(first.end_of_input), too_large_json]
        flat = [item for pair in fields.items() for item in pair]
        reply = await self._run("create", session_keys(session_id), [now, replica, *chunk_args, *flat])
        if _text(reply[0]) != "accepted":
            raise _error_for(reply, session_id, first.sequence_id if first else None)
        await self._index(session_id, now + int(fields["timeout_ms"]))
        return _input_outcome(reply)

    async def append(
        self, session_id: str, chunk: ChunkRecord, replica: str, too_large_json: str, caller: str = "",
    ) -> InputOutcome:
        """``caller``: the identity asking; a session of another identity is not found."""
        args = [now_ms(), replica, chunk.sequence_id, chunk.digest_record(), chunk.to_blob(),
                int(chunk.end_of_input), too_large_json, caller]
        reply = await self._run("append", session_keys(session_id), args)
        status = _text(reply[0])
        if status in ("accepted", "duplicate"):
            return _input_outcome(reply, duplicate=status == "duplicate")
        if status == "too_large":
            await self._release(session_id, _text(reply[2]))
        raise _error_for(reply, session_id, chunk.sequence_id)

    async def finish(self, session_id: str, final_sequence_id: int | None, replica: str,
                     caller: str = "") -> InputOutcome:
        asked = "" if final_sequence_id is None else final_sequence_id
        reply = await self._run("finish", session_keys(session_id), [now_ms(), replica, asked, caller])
        if _text(reply[0]) != "accepted":
            raise _error_for(reply, session_id, final_sequence_id)
        return _input_outcome(reply)

    async def cancel(self, session_id: str, cancelled_json: str, caller: str = "") -> SessionState:
        """Cancel; returns the state before (``cancelled`` again when repeated)."""
        reply = await self._run("cancel", session_keys(session_id), [now_ms(), cancelled_json, caller])
        if _text(reply[0]) != "accepted":
            raise _error_for(reply, session_id)
        if len(reply) > 3:
            await self._release(session_id, _text(reply[3]))
        return SessionState(_text(reply[2]))

    # --- limits -----------------------------------------------------------

    async def admit(self, identity: str, session_id: str, *, per_identity: int, overall: int,
                    until_ms: int) -> None:
        """Count a new session against the global and the per-identity caps.

        Two keys in two slots, so two steps; a session refused by the second
        is taken back out of the first. ``until_ms`` bounds how long an entry
        counts if its release is ever lost (a replica dying at the wrong time).
        """
        now = now_ms()
        async with self._call():
            if not await self._scripts["admit"](keys=[OPEN_SESSIONS], args=[now, overall, session_id, until_ms]):
                raise errors.CapacityExhausted("the service is at its session capacity; retry later")
            admitted = await self._scripts["admit"](
                keys=[identity_sessions(identity)], args=[now, per_identity, session_id, until_ms])
            if not admitted:
                await self._redis.zrem(OPEN_SESSIONS, session_id)
        if not admitted:
            raise errors.TooManySessions(
                f"this identity already has {per_identity} open sessions; finish or cancel one",
                retry_after=5)

    async def _release(self, session_id: str, identity: str | None) -> None:
        """A session ended: it no longer counts against any cap."""
        if not identity:
            return
        async with self._call():
            pipe = self._redis.pipeline(transaction=False)
            pipe.zrem(OPEN_SESSIONS, session_id)
            pipe.zrem(identity_sessions(identity), session_id)
            await pipe.execute()

    async def take_token(self, identity: str, rate: float, burst: int) -> None:
        """One request's worth of the identity's token bucket, or 429."""
        async with self._call():
            wait_ms = await self._scripts["rate"](keys=[identity_rate(identity)], args=[now_ms(), rate, burst])
        if int(wait_ms) > 0:
            raise errors.TooManyRequests("too many requests for this identity; slow down",
                                         retry_after=max(1, -(-int(wait_ms) // 1000)))

    # --- expiry ---------------------------------------------------------

    async def _index(self, session_id: str, due_ms: int) -> None:
        async with self._call():
            await self._redis.zadd(EXPIRY_INDEX, {session_id: due_ms})

    async def reap(self, expired_json: str, incomplete_json: str, limit: int = 200) -> list[ReapOutcome]:
        """Expire every session that is due; re-schedule the ones that are not yet."""
        now = now_ms()
        async with self._call():
            due = await self._redis.zrangebyscore(EXPIRY_INDEX, "-inf", now, start=0, num=limit)
        ended: list[ReapOutcome] = []
        for raw in due:
            session_id = _text(raw)
            reply = await self._run("expire", session_keys(session_id), [now, expired_json, incomplete_json])
            status = _text(reply[0])
            async with self._call():
                if status == "alive":
                    await self._redis.zadd(EXPIRY_INDEX, {session_id: int(reply[2])})
                else:
                    await self._redis.zrem(EXPIRY_INDEX, session_id)
            if status in ("expired", "failed"):
                await self._release(session_id, _text(reply[2]))
                ended.append(ReapOutcome(session_id, SessionState(status), SessionState(_text(reply[1]))))
        return ended

    # --- reading --------------------------------------------------------

    async def view(self, session_id: str, caller: str = "") -> SessionRecord:
        reply = await self._run("view", session_keys(session_id), [caller])
        if not reply:
            raise errors.SessionNotFound(f"no session {session_id!r}")
        flat, missing = reply
        fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return SessionRecord(session_id, fields, [int(v) for v in missing])

    async def _xread(self, key: str, after: str, block_ms: int, count: int) -> list[tuple[str, dict[str, str]]]:
        """Entries of one stream after ``after``, waiting up to ``block_ms`` for the first."""
        async with self._call(block_ms / 1000):
            reply = await self._redis.xread({key: after}, block=block_ms, count=count)
        return [(_text(entry_id), {_text(k): _text(v) for k, v in raw.items()})
                for _, entries in reply or () for entry_id, raw in entries]

    async def read_input(self, session_id: str, after: str, block_ms: int) -> list[InputEvent]:
        events: list[InputEvent] = []
        for entry, fields in await self._xread(session_keys(session_id).input, after, block_ms, 512):
            if "s" in fields:
                events.append(InputEvent(entry, "chunk", int(fields["s"])))
            elif "end" in fields:
                events.append(InputEvent(entry, "end", value=fields["end"]))
            else:
                events.append(InputEvent(entry, "abort", value=fields["abort"]))
        return events

    async def load_chunks(self, session_id: str, sequence_ids: Sequence[int]) -> list[ChunkRecord]:
        async with self._call():
            blobs = await self._redis.hmget(session_keys(session_id).chunks, list(sequence_ids))
        if any(blob is None for blob in blobs):
            # Keys expire only after the session ends, so this is a lost session.
            raise errors.SessionNotFound(f"chunks of session {session_id!r} are gone")
        return [ChunkRecord.from_blob(seq, blob) for seq, blob in zip(sequence_ids, blobs, strict=True)]

    # --- output side ----------------------------------------------------

    async def publish(
        self, session_id: str, frames: Sequence[tuple[str, str, bool]],
        completion: dict[str, Any] | None = None, identity: str | None = None,
    ) -> list[str] | None:
        """Append frames (event, data, last); with ``completion`` the session completes.

        Returns the frame ids, or ``None`` if the session stopped generating
        (cancelled meanwhile), so the caller can abort its engine work.
        """
        args: list[Any] = [now_ms(), "completed" if completion else "", json.dumps(completion or "")]
        for event, data, last in frames:
            args += [event, data, int(last)]
        reply = await self._run("publish", session_keys(session_id), args)
        if _text(reply[0]) != "ok":
            return None
        if completion:
            await self._release(session_id, identity)
        return [_text(v) for v in reply[1:]]

    async def fail(self, session_id: str, error_json: str) -> SessionState | None:
        """Fail a live session; returns the state before, ``None`` if it had ended."""
        reply = await self._run("fail", session_keys(session_id), [now_ms(), error_json])
        if _text(reply[0]) != "failed":
            return None
        await self._release(session_id, _text(reply[2]))
        return SessionState(_text(reply[1]))

    async def read_frames(self, session_id: str, after: str, block_ms: int) -> list[Frame]:
        entries = await self._xread(session_keys(session_id).output, after, block_ms, 256)
        return [Frame(entry, f["e"], f["d"], f["t"] == "1") for entry, f in entries]

    async def last_frame_id(self, session_id: str) -> str:
        async with self._call():
            entries = await self._redis.xrevrange(session_keys(session_id).output, count=1)
        return _text(entries[0][0]) if entries else "0-0"
