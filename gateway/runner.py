"""Drive the engine work of the sessions this replica owns.

A session's runner has two halves that run side by side:

    :in stream ──► feed ──► EngineSession ──► relay ──► :out stream (+ result)

``feed`` reads newly contiguous input (and the ``end`` / ``abort`` marks)
from Redis, so input appended on any replica reaches the engine, and a
cancel or expiry decided anywhere aborts it. ``relay`` turns engine events
into OpenAI frames and publishes them; it stops as soon as the session is
no longer generating.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway import errors
from gateway.metrics import Metrics
from gateway.output.audio import AudioOutput
from gateway.output.frames import DONE, FrameBuilder
from gateway.sessions.states import SessionState
from gateway.store.records import SessionRecord
from gateway.store.redis_store import InputEvent, SessionStore
from omni_adapter.port import (
    AudioDelta,
    Engine,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineSession,
    Finished,
    InputChunk,
    SamplingOptions,
    TextDelta,
)

logger = logging.getLogger(__name__)

#: How long one blocking read of the input stream waits before looking again.
INPUT_POLL_MS = 5_000


def engine_request(record: SessionRecord) -> EngineRequest:
    """Rebuild the engine request from what ``create`` stored in Redis."""
    stored = record.json("request")
    return EngineRequest(
        request_id=record.session_id,
        model=record.fields["model"],
        messages=tuple(stored["messages"]),
        sampling=SamplingOptions(**{**stored["sampling"], "stop": tuple(stored["sampling"]["stop"])}),
        output_modalities=tuple(stored["modalities"]),
    )


def error_json(error: errors.GatewayError) -> str:
    return json.dumps(error.envelope())


@dataclass
class _Timing:
    created_ms: int
    input_done_ms: int | None = None


class SessionRunner:
    def __init__(self, session_id: str, store: SessionStore, engine: Engine, metrics: Metrics) -> None:
        self.session_id = session_id
        self._store = store
        self._engine = engine
        self._metrics = metrics

    async def run(self) -> None:
        record = await self._store.view(self.session_id)
        if record.state.is_terminal:
            return
        timing = _Timing(created_ms=record.int("created_at"))
        try:
            session = self._engine.open_session(engine_request(record))
        except EngineRejectedError as exc:
            # Nothing else would ever end this session: fail it for the client.
            await self._fail(errors.ValidationFailed(str(exc)))
            return
        except Exception:
            logger.exception("session %s: the engine could not open it", self.session_id)
            await self._fail(errors.EngineUnavailable("the engine could not take this session"))
            return
        self._metrics.engine_start.observe(max(0.0, time.time() - timing.created_ms / 1000))
        feeder = asyncio.create_task(self._feed(session, timing), name=f"feed-{self.session_id}")
        try:
            await self._relay(session, record, timing)
        except asyncio.CancelledError:
            # Only shutdown cancels a runner. Until another replica can take
            # the session over, the honest answer to its client is a failure,
            # not a stream that never ends.
            await self._fail(errors.EngineUnavailable("the replica running this session shut down"))
            raise
        except errors.GatewayError as exc:
            logger.warning("session %s: runner stopped: %s", self.session_id, exc.code)
        except Exception:
            logger.exception("session %s: runner crashed", self.session_id)
            await self._fail(errors.GatewayError("the engine work of this session failed"))
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
            await session.abort()

    async def _feed(self, session: EngineSession, timing: _Timing) -> None:
        """Feed input until aborted; if feeding fails, fail the session and stop the engine."""
        try:
            await self._feed_until_abort(session, timing)
        except asyncio.CancelledError:
            raise
        except EngineRejectedError as exc:
            await self._fail(errors.ValidationFailed(str(exc)))
            await session.abort()
        except Exception as exc:
            logger.exception("session %s: feeding input failed", self.session_id)
            await self._fail(exc if isinstance(exc, errors.GatewayError)
                             else errors.GatewayError("feeding input to the engine failed"))
            await session.abort()

    async def _feed_until_abort(self, session: EngineSession, timing: _Timing) -> None:
        after = "0-0"
        while True:
            events = await self._store.read_input(self.session_id, after, INPUT_POLL_MS)
            if not events:
                continue
            after = events[-1].id
            await self._apply(session, events, timing)
            if events[-1].kind == "abort":
                return

    async def _apply(self, session: EngineSession, events: list[InputEvent], timing: _Timing) -> None:
        pending = [e.sequence_id for e in events if e.kind == "chunk"]
        if pending:
            records = await self._store.load_chunks(self.session_id, pending)
            await session.feed([
                InputChunk(r.sequence_id, r.modality, r.payload, r.format, r.mime_type,  # type: ignore[arg-type]
                           r.sample_rate)
                for r in records
            ])
        for event in events:
            if event.kind == "end":
                timing.input_done_ms = int(event.value)
                await session.end_input()
            elif event.kind == "abort":
                logger.info("session %s: engine work aborted (%s)", self.session_id, event.value)
                await session.abort()

    async def _relay(self, session: EngineSession, record: SessionRecord, timing: _Timing) -> None:
        stored = record.json("request")
        frames = FrameBuilder(self.session_id, record.fields["model"], record.int("created_at") // 1000)
        include_usage = stored.get("include_usage", False)
        audio = AudioOutput(frames, ttl_sec=record.int("result_ttl_ms") / 1000)
        pieces: list[str] = []
        role_sent = False

        def opening() -> list[tuple[str, str, bool]]:
            nonlocal role_sent
            if role_sent:
                return []
            role_sent = True
            return [("", frames.role(), False)]

        async for event in session.events():
            if isinstance(event, TextDelta):
                if not pieces and timing.input_done_ms is not None:
                    self._metrics.ttft.observe(max(0.0, time.time() - timing.input_done_ms / 1000))
                pieces.append(event.text)
                out = [*opening(), ("", frames.content(event.text), False)]
                if await self._store.publish(self.session_id, out) is None:
                    return  # cancelled or expired meanwhile; the finally aborts the engine
            elif isinstance(event, AudioDelta):
                if await self._store.publish(self.session_id, [*opening(), ("", audio.frame(event), False)]) is None:
                    return
            elif isinstance(event, Finished):
                out = [*opening(), ("", frames.finish(event.finish_reason), False)]
                if include_usage:
                    out.append(("", frames.usage(event.usage), False))
                out.append(("", DONE, True))
                completion = audio.complete(frames.completion("".join(pieces), event.finish_reason, event.usage))
                if await self._store.publish(self.session_id, out, completion=completion,
                                           identity=record.fields.get("identity")) is not None:
                    self._metrics.transition(SessionState.GENERATING, SessionState.COMPLETED)
                return
            elif isinstance(event, EngineError):
                self._metrics.engine_errors.labels(event.code).inc()
                await self._fail(errors.GatewayError(event.message), code=event.code)
                return

    async def _fail(self, error: errors.GatewayError, code: str | None = None) -> None:
        envelope = error.envelope()
        if code:
            envelope["error"]["code"] = code
        try:
            before = await self._store.fail(self.session_id, json.dumps(envelope))
        except errors.StoreUnavailable:
            logger.error("session %s: could not record failure, store unavailable", self.session_id)
            return
        if before is not None:
            self._metrics.transition(before, SessionState.FAILED)


class RunnerPool:
    """The runners of this replica, one task per owned session."""

    def __init__(self, make_runner: Callable[[str], SessionRunner]) -> None:
        self._make_runner = make_runner
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, session_id: str) -> None:
        if session_id in self._tasks:
            return
        task = asyncio.create_task(self._make_runner(session_id).run(), name=f"run-{session_id}")
        self._tasks[session_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(session_id, None))

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
