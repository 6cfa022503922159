"""Drive the engine work of the sessions this replica holds a lease on.

A session's runner has three parts that run side by side:

    :in stream ──► feed ──► EngineSession ──► relay ──► :out stream (+ result)
                      heartbeat: renews the lease, stops the rest when lost

``feed`` reads the contiguous input (and the ``end`` / ``abort`` marks) from
Redis from the start of the stream, so input appended on any replica reaches
the engine, and a runner that takes a session over from a dead replica
rebuilds the engine session from Redis alone. ``relay`` turns engine events
into OpenAI frames and publishes them under the lease; a new owner first
reads the frames already published and has the engine continue after that
text, so subscribers see one stream with nothing lost or repeated.

Redis outages do not end a runner: each store call is retried until it
succeeds or the lease turns out to be lost (the publish and fail scripts
refuse a stale lease, so two holders can never both write).

Many sessions share one engine (gateway/domain/scheduling.py). A listening
session (input not complete) that gets no input for ``idle_park_sec``, or
whose slot an answer needs (``park_soon``), is parked: the runner gives up
its lease (``park.lua``) and aborts its engine request, freeing its KV
cache; the next input resumes it on whichever replica has room, which
re-feeds the input from Redis (the prefix cache recovers what survived).
A replaced chunk (update mode) puts a ``restart`` mark in the input: the
runner opens a new engine request and feeds the input again from the start.

An engine that died for good fails no session: the runner tells the replica
to stop and releases its session to another one (gateway/work/engine_death.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

from gateway import errors
from gateway.domain.states import SessionState
from gateway.metrics import Metrics
from gateway.output.audio import AudioOutput
from gateway.output.frames import (
    DONE,
    TRANSCRIPT_EVENT,
    FrameBuilder,
    ToolCalls,
    content_of,
    heard_of,
    logprobs_of,
    openai_logprob,
    tool_call_deltas_of,
    unspoken_end,
)
from gateway.store.connection import retry_delay
from gateway.store.records import ChunkRecord, Frame, Lease, Renewal
from gateway.store.redis_store import InputEvent, SessionStore
from gateway.store.session_hash import SessionRecord
from gateway.store.stream_reader import Subscription
from gateway.work.batcher import OutputBatcher
from gateway.work.engine_death import stop_if_dead
from gateway.work.said_again import SaidAgain, nothing_new
from omni_adapter.port import (
    AudioDelta,
    Engine,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineSession,
    Finished,
    HeardInput,
    InputChunk,
    InputTranscript,
    TextDelta,
    ToolCallDelta,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long one wait for input lasts before looking again (idle parking, park requests).
INPUT_POLL_MS = 5_000


class EngineDied(Exception):
    """The engine is dead for good: the session goes back to Redis for another replica
    (gateway/work/engine_death.py), it does not fail."""


class LeaseLost(Exception):
    """Another replica holds the session's engine work now, or the session ended (``ended``)."""

    def __init__(self, session_id: str, *, ended: bool) -> None:
        super().__init__(session_id)
        self.ended = ended


class _Stop(Enum):
    """Why the feed ended the engine session while the session goes on."""

    #: Parked: the lease is given up until the next input.
    PARKED = "parked"
    #: A chunk the engine took in was replaced: feed it all again.
    RESTART = "restart"


@dataclass
class _Progress:
    """What earlier holders already published: where this runner picks up."""

    #: The data of every frame written so far (their count is where writing resumes).
    frame_data: list[str]
    text: str
    #: The input transcript told last: a new owner must not tell subscribers
    #: what they already read.
    transcript: str = ""
    #: What was heard of the audio input: a new owner feeds it without hearing that audio again.
    heard: HeardInput = HeardInput()
    #: The function calls published so far, in part or whole.
    calls: ToolCalls = field(default_factory=ToolCalls)

    @classmethod
    def of(cls, frames: list[Frame]) -> _Progress:
        data = [f.data for f in frames]
        told = [f.data for f in frames if f.event == TRANSCRIPT_EVENT]
        answer = [f.data for f in frames if not f.event]
        return cls(data, "".join(map(content_of, answer)), json.loads(told[-1])["input_transcript"] if told else "",
                   heard_of(told), ToolCalls(delta for frame in answer for delta in tool_call_deltas_of(frame)))

    def replays(self, record: SessionRecord) -> bool:
        """The answer is made again from its start, not continued after its text
        (``work/said_again.py``): it is held to JSON, or a function call was published."""
        return (bool(self.text) and record.request.sampling.response_format is not None) or bool(self.calls)

    def said_again(self, record: SessionRecord) -> SaidAgain:
        """What a new answer says again before anything new: nothing, if it goes on after the text."""
        return SaidAgain(self.text, self.calls.by_index()) if self.replays(record) else SaidAgain()

    def engine_request(self, record: SessionRecord, request_id: str) -> EngineRequest:
        """The session's request for a new holder: it goes on after the text and the audio so far
        (made again, the answer's text is spoken from where the audio so far ended)."""
        unspoken = unspoken_end(self.text, self.frame_data)
        if self.replays(record):
            request = record.request.engine_request(request_id, record.model)
            return replace(request, heard=self.heard, spoken_chars=len(self.text) - len(unspoken))
        request = record.request.engine_request(request_id, record.model, self.text)
        return replace(request, heard=self.heard, unspoken_prefix=unspoken)


@dataclass
class _Timing:
    created_ms: int
    input_done_ms: int | None = None
    #: When the engine last showed progress on the answer (monotonic seconds):
    #: the end of input, then every event it yields.
    progress_at: float = 0.0


class SessionRunner:
    def __init__(self, session_id: str, lease: Lease, store: SessionStore, engine: Engine,
                 metrics: Metrics, lease_ttl_sec: float, progress_timeout_sec: float = 120.0,
                 idle_park_sec: float = 0.0, coalesce_sec: float = 0.0, *,
                 on_engine_dead: Callable[[str], None]) -> None:
        self.session_id = session_id
        self.lease = lease
        self._store = store
        self._engine = engine
        self._metrics = metrics
        self._lease_ttl_sec = lease_ttl_sec
        self._progress_timeout_sec = progress_timeout_sec
        self._idle_park_sec = idle_park_sec
        self._coalesce_sec = coalesce_sec
        #: Told when the engine turns out to be dead (``Draining.fail``: the replica stops).
        self._on_engine_dead = on_engine_dead
        #: True until the input is known to be complete: a runner that has not
        #: read its session yet counts against the listening cap.
        self.listening = True
        #: When input last arrived (monotonic): the pool parks the longest idle first.
        self.last_input_at = time.monotonic()
        #: An answer needs this slot: park at the next chance.
        self._park_asked = False
        #: The input this runner follows now (``park_soon`` cuts its wait short).
        self._stream: Subscription[InputEvent] | None = None

    @property
    def parking(self) -> bool:
        return self._park_asked

    def park_soon(self) -> None:
        """Park at once if still listening, idle or not: an answer needs this slot."""
        self._park_asked = True
        if self._stream is not None:
            self._stream.interrupt()

    async def run(self) -> None:
        attempt = 0
        while await self._run_engine_session(attempt) is _Stop.RESTART:
            attempt += 1

    async def _run_engine_session(self, attempt: int) -> _Stop | None:
        """One engine request for the session, from what Redis holds; why it stopped early, if it did."""
        try:
            record = await self._retrying(lambda: self._store.view(self.session_id))
        except errors.SessionNotFound:
            return None  # its keys expired before this replica got to it
        if record.state.is_terminal:
            return None
        progress = _Progress.of(await self._retrying(lambda: self._store.read_output(self.session_id)))
        if attempt == 0 and self.lease.epoch > 1:
            # Another holder ran it before (a failover, a release, a parked session's
            # resume, maybe on this replica): say so even before any output, so a
            # takeover can be traced.
            logger.info("session %s: picked up again (lease epoch %d) after %d frames",
                        self.session_id, self.lease.epoch, len(progress.frame_data))
        timing = _Timing(created_ms=record.created_at_ms, input_done_ms=record.input_done_at_ms,
                         progress_at=time.monotonic())
        # vLLM refuses a request id it still knows: a restart gets an id of its own.
        request_id = f"{record.session_id}-{record.lease_epoch}" + (f".{attempt}" if attempt else "")
        try:
            session = self._engine.open_session(progress.engine_request(record, request_id))
        except EngineRejectedError as exc:
            # Nothing else would ever end this session: fail it for the client.
            await self._fail(errors.ValidationFailed(str(exc)))
            return None
        except errors.GatewayError as exc:  # the stored request says why (a release that cannot serve it)
            await self._fail(exc)
            return None
        except Exception:
            if await stop_if_dead(self._engine, self._on_engine_dead):
                await self._release()
                return None
            logger.exception("session %s: the engine could not open it", self.session_id)
            await self._fail(errors.EngineUnavailable("the engine could not take this session"))
            return None
        if attempt == 0 and not record.parks:
            self._metrics.engine_start.observe(max(0.0, time.time() - timing.created_ms / 1000))
        self.listening = timing.input_done_ms is None
        self.last_input_at = time.monotonic()
        parts = [
            asyncio.create_task(self._relay(session, record, progress, timing), name=f"relay-{self.session_id}"),
            asyncio.create_task(self._heartbeat(), name=f"lease-{self.session_id}"),
            asyncio.create_task(self._watch_progress(timing), name=f"progress-{self.session_id}"),
        ]
        feed = asyncio.create_task(self._feed(session, timing, record.replaced), name=f"feed-{self.session_id}")
        stop: _Stop | None = None
        try:
            # The relay ends the work; a lost lease (heartbeat) or an answer
            # that stopped making progress (watch) ends it early, and so does
            # the feed when it parks or restarts the session.
            done, _ = await asyncio.wait([*parts, feed], return_when=asyncio.FIRST_COMPLETED)
            if done == {feed} and feed.result() is None:
                # The input ended with an abort mark: the relay sees the engine stop.
                done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
            for part in done:
                if isinstance(result := part.result(), _Stop):
                    stop = result
        except LeaseLost as exc:
            if exc.ended:
                logger.info("session %s: ended while its engine work ran; stopped", self.session_id)
            else:
                logger.warning("session %s: lease lost; another replica runs it now", self.session_id)
        except EngineDied:
            await self._release()
        except errors.EngineTimeout as exc:
            self._metrics.engine_errors.labels(exc.code).inc()
            await self._fail(exc)
        except asyncio.CancelledError:
            # Shutdown past its grace period: hand the work to another replica,
            # which continues from what is in Redis.
            await self._release()
            raise
        except Exception:
            if await stop_if_dead(self._engine, self._on_engine_dead):
                await self._release()
            else:
                logger.exception("session %s: runner crashed", self.session_id)
                await self._fail(errors.GatewayError("the engine work of this session failed"))
        finally:
            self.listening = False
            for part in [*parts, feed]:
                part.cancel()
            await asyncio.gather(*parts, feed, return_exceptions=True)
            await session.abort()
        if stop is _Stop.PARKED:
            logger.info("session %s: parked (engine request aborted) until its next input", self.session_id)
        return stop

    # --- lease ---------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Renew the lease every third of its time to live; raise LeaseLost when it is gone.

        A renewal refused because the session ended is not a lost lease (a
        renewal races the relay's last frame now and then): the work stops by
        other means, and only if it has not a third later does this stop it.

        The first renewal comes at a random point between a sixth and a third
        of the time to live: work a
        replica claims together (a tender round after a failover, a burst of
        starts) would otherwise renew together forever, hundreds of calls at
        once every few seconds (measured: a 0.3 s stall of every stream
        with 200 sessions).
        """
        period = self._lease_ttl_sec / 3
        await asyncio.sleep(period * random.uniform(0.5, 1.0))
        while True:
            renewal = await self._retrying(lambda: self._store.renew(self.session_id, self.lease))
            if renewal is not Renewal.RENEWED:
                break
            await asyncio.sleep(period)
        if renewal is Renewal.ENDED:
            # Whatever ended it tells the other parts: the relay's own last frame
            # (this renewal raced it), or the abort mark a cancel or expiry writes
            # to the input. They stop the work; this is the backstop.
            await asyncio.sleep(period)
        raise LeaseLost(self.session_id, ended=renewal is Renewal.ENDED)

    async def _watch_progress(self, timing: _Timing) -> None:
        """Raise EngineTimeout once a complete input's answer makes no progress in time.

        Before the input is complete the engine legitimately waits for it
        (idle input is the tender's business: the session timeout).
        """
        check_every = min(1.0, self._progress_timeout_sec / 4)
        while True:
            await asyncio.sleep(check_every)
            if timing.input_done_ms is None:
                continue
            stalled = time.monotonic() - timing.progress_at
            if stalled > self._progress_timeout_sec:
                raise errors.EngineTimeout(
                    f"the engine produced nothing for {stalled:.0f} s after the input was complete "
                    f"(limit {self._progress_timeout_sec:g} s)")

    async def _release(self) -> None:
        # Shielded: a replica whose engine died releases its sessions while its shutdown cancels
        # the runners at once, and a release cut off there left the session to wait out its lease.
        release = asyncio.ensure_future(self._store.release(self.session_id, self.lease))
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            await asyncio.wait([release])  # the cancel stops this runner once the release is done
            self._said_released(release)
            raise
        self._said_released(release)

    def _said_released(self, release: asyncio.Future[Any]) -> None:
        if isinstance(release.exception(), errors.StoreUnavailable):
            # The lease lapses on its own; another replica takes over then.
            logger.warning("session %s: could not release, store unavailable", self.session_id)
        elif release.exception() is None:
            logger.info("session %s: released to another replica", self.session_id)

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a store call, retrying while Redis is unreachable."""
        attempt = 0
        while True:
            try:
                return await call()
            except errors.StoreUnavailable:
                delay = retry_delay(attempt)
                if attempt == 0:
                    logger.warning("session %s: store unavailable, retrying", self.session_id)
                attempt += 1
                await asyncio.sleep(delay)

    # --- input ---------------------------------------------------------------

    async def _feed(self, session: EngineSession, timing: _Timing, replaced: int) -> _Stop | None:
        """Feed input until aborted, parked or restarted; if feeding fails, fail the session and stop the engine."""
        try:
            return await self._feed_until_abort(session, timing, replaced)
        except asyncio.CancelledError:
            raise
        except EngineRejectedError as exc:
            await self._fail(errors.ValidationFailed(str(exc)))
            await session.abort()
        except Exception as exc:
            if await stop_if_dead(self._engine, self._on_engine_dead):
                raise EngineDied(self.session_id) from exc
            logger.exception("session %s: feeding input failed", self.session_id)
            await self._fail(exc if isinstance(exc, errors.GatewayError)
                             else errors.GatewayError("feeding input to the engine failed"))
            await session.abort()
        return None

    async def _feed_until_abort(self, session: EngineSession, timing: _Timing, replaced: int) -> _Stop | None:
        """``replaced``: the session's count of replaced chunks when this engine request
        opened; restart marks up to it are already in the input this request reads."""
        # Followed through the replica's one stream reader: no connection of our own.
        async with self._store.input_stream(self.session_id, "0-0") as stream:
            self._stream = stream
            try:
                return await self._feed_from(stream, session, timing, replaced)
            finally:
                self._stream = None

    async def _feed_from(self, stream: Subscription[InputEvent], session: EngineSession, timing: _Timing,
                         replaced: int) -> _Stop | None:
        after = "0-0"
        while True:
            events = await self._next_input(stream)
            if events is None:
                reason = "room" if self._park_asked else "idle"
                self._park_asked = False
                if await self._retrying(lambda: self._store.park(self.session_id, self.lease, after)):  # noqa: B023
                    self._metrics.parks.labels(reason).inc()
                    return _Stop.PARKED
                continue  # input arrived meanwhile: read it
            if not events:
                continue
            after = events[-1].id
            if any(e.kind == "restart" and int(e.value) > replaced for e in events):
                return _Stop.RESTART
            await self._apply(session, events, timing)
            if events[-1].kind == "abort":
                return None

    async def _next_input(self, stream: Subscription[InputEvent]) -> list[InputEvent] | None:
        """The input after what ``stream`` gave last (empty when none came in a while);
        ``None``: park now (idle too long, or an answer needs the slot)."""
        wait_ms = INPUT_POLL_MS
        if self.listening and self._idle_park_sec > 0:
            idle_left = self.last_input_at + self._idle_park_sec - time.monotonic()
            if idle_left <= 0:
                return None
            wait_ms = min(wait_ms, max(1, int(idle_left * 1000)))
        if self.listening and self._park_asked:
            return None
        # One plain await: no task or event per wait (a started session must cost
        # little while it listens); ``park_soon`` interrupts the wait.
        return await self._retrying(lambda: stream.read(wait_ms))

    async def _apply(self, session: EngineSession, events: list[InputEvent], timing: _Timing) -> None:
        pending = [e.sequence_id for e in events if e.kind == "chunk"]
        # An aborted session's input is not fed: its chunks went when it ended (lua/lib.lua refresh_ttl).
        if pending and events[-1].kind != "abort":
            self.last_input_at = time.monotonic()
            records = await self._load_chunks(pending)
            if records is None:
                logger.info("session %s: ended before its input was fed", self.session_id)
                return  # its abort mark comes next (or, its keys gone, the heartbeat stops the work)
            await session.feed([
                InputChunk(r.sequence_id, r.modality, r.payload, r.format, r.mime_type, r.sample_rate)
                for r in records
            ])
        for event in events:
            if event.kind == "end":
                self.listening = False
                timing.progress_at = time.monotonic()
                timing.input_done_ms = int(event.value)
                await session.end_input()
            elif event.kind == "abort":
                logger.info("session %s: engine work aborted (%s)", self.session_id, event.value)
                await session.abort()

    async def _load_chunks(self, pending: list[int]) -> list[ChunkRecord] | None:
        """The chunks to feed; ``None`` when the session ended since its input was read."""
        try:
            return await self._retrying(lambda: self._store.load_chunks(self.session_id, pending))
        except errors.SessionNotFound:
            state = await self._retrying(lambda: self._store.state(self.session_id))
            if state is not None and not state.is_terminal:
                raise  # a live session that lost its input: fail it (``_feed``)
            return None

    # --- output --------------------------------------------------------------

    async def _relay(self, session: EngineSession, record: SessionRecord, progress: _Progress,
                     timing: _Timing) -> None:
        frames = FrameBuilder(record.session_id, record.model, record.created_at_ms // 1000)
        audio = AudioOutput(frames, ttl_sec=record.result_ttl_ms / 1000)
        audio.replay(progress.frame_data)
        pieces: list[str] = [progress.text] if progress.text else []
        again = progress.said_again(record)
        calls = progress.calls  # the completion lists each call whole, whoever made which part
        written = emitted = len(progress.frame_data)
        began = bool(pieces)
        # The answer's token log probabilities, when asked for: those published before, then these.
        logprobs = None if record.request.sampling.logprobs is None else \
            [entry for data in progress.frame_data for entry in logprobs_of(data)]

        async def publish(out: list[tuple[str, str, bool]], completion: dict[str, Any] | None = None) -> bool:
            nonlocal written
            first = written
            ids = await self._retrying(lambda: self._store.publish(
                self.session_id, self.lease, first, out, completion, record.identity))
            written = first + len(out)
            return ids is not None

        # Deltas go out in batches (one Redis call each); the end waits for them.
        batcher = OutputBatcher(publish, self._coalesce_sec)

        async def emit(frame: tuple[str, str, bool] | None) -> None:
            """``frame`` after the role frame, which goes first (alone, for ``None``)."""
            nonlocal emitted
            out = [("", frames.role(), False)] if emitted == 0 else []
            out += [frame] if frame is not None else []
            if out:
                emitted += len(out)
                await batcher.add(out)

        try:
            async for event in session.events():
                timing.progress_at = time.monotonic()
                if again.checks(event):
                    new = again.after(event)
                    if new is None:
                        await batcher.close()
                        await self._fail(errors.AnswerNotResumable(
                            "the replica making this answer stopped, and the answer (held to response_format, "
                            "or calling a function) came out differently when made again; ask again"))
                        return
                    if nothing_new(new):
                        continue
                    event = new
                if isinstance(event, TextDelta):
                    if not began and timing.input_done_ms is not None:
                        self._metrics.ttft.observe(max(0.0, time.time() - timing.input_done_ms / 1000))
                    began = True
                    scored = [openai_logprob(token) for token in event.logprobs]
                    if logprobs is not None:
                        logprobs += scored
                    if event.text or scored:
                        pieces.append(event.text)
                        await emit(("", frames.content(event.text, scored), False))
                    else:  # the answer began with nothing to say yet: its role frame
                        await emit(None)
                elif isinstance(event, AudioDelta):
                    await emit(("", audio.frame(event), False))
                elif isinstance(event, ToolCallDelta):
                    calls.add(event)
                    await emit(("", frames.tool_call(event), False))
                elif isinstance(event, InputTranscript):
                    if progress.transcript.startswith(event.text):
                        continue  # told already, before a hand-off
                    progress.transcript = event.text
                    await emit((TRANSCRIPT_EVENT, frames.transcript(event.text, event.heard), False))
                elif isinstance(event, Finished):
                    if (tail := audio.flush_frame()) is not None:
                        await emit(("", tail, False))
                    if not await batcher.close():
                        return
                    out = [("", frames.role(), False)] if emitted == 0 else []
                    out.append(("", frames.finish(event.finish_reason), False))
                    if record.request.include_usage:
                        out.append(("", frames.usage(event.usage), False))
                    out.append(("", DONE, True))
                    completion = audio.complete(frames.completion("".join(pieces), event.finish_reason, event.usage,
                                                                  calls.listed(), logprobs))
                    if await publish(out, completion):
                        self._metrics.transition(SessionState.GENERATING, SessionState.COMPLETED)
                    return
                elif isinstance(event, EngineError):
                    if await batcher.close():  # what came before the error, as before
                        if await stop_if_dead(self._engine, self._on_engine_dead):
                            raise EngineDied(self.session_id)  # the next holder goes on after it
                        self._metrics.engine_errors.labels(event.code).inc()
                        # By its code's class: an engine's refusal (invalid_request) is the client's error.
                        await self._fail(errors.from_envelope({"error": {"message": event.message,
                                                                         "code": event.code}}))
                    return
                if not batcher.ok:
                    await batcher.close()  # raises what a publish raised
                    return  # cancelled, expired or taken over; the caller aborts the engine
            await batcher.close()  # the engine stopped without an end (aborted): what it said still counts
        finally:
            batcher.cancel()

    async def _fail(self, error: errors.GatewayError, code: str | None = None) -> None:
        envelope = error.envelope()
        if code:
            envelope["error"]["code"] = code
        # Whatever failed it, the replica's log says so (an engine's error event left no trace).
        logger.warning("session %s: failed (%s): %s", self.session_id, envelope["error"]["code"], error.message)
        try:
            before = await self._store.fail(self.session_id, json.dumps(envelope), self.lease)
        except errors.StoreUnavailable:
            logger.error("session %s: could not record failure, store unavailable", self.session_id)
            return
        if before is not None:
            self._metrics.transition(before, SessionState.FAILED)
