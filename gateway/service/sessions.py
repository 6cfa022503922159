"""The session use cases: create, append, finish, view, events, cancel, result.

Routers call these with parsed input and get domain objects or domain
errors back. Every state change is delegated to one store call (one Lua
script); the service adds validation against the engine's capabilities,
start-policy thresholds, metrics, and hands started sessions to the runners
(``gateway.work``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.domain.identities import owner_check
from gateway.domain.policies import StartThresholds
from gateway.domain.states import SessionState
from gateway.metrics import Metrics
from gateway.output.sse import BEFORE_FIRST, not_an_event_id, session_events
from gateway.service.models import ChatMessage, CreateSessionRequest
from gateway.service.token_marks import START, TokenMark, advance, count_update
from gateway.settings import Settings
from gateway.store.records import ChunkRecord, InputOutcome, event_id_key
from gateway.store.redis_store import SessionStore
from gateway.store.session_hash import NewSession, SessionRecord, StoredRequest
from gateway.work.draining import Draining
from gateway.work.pool import RunnerPool
from omni_adapter.port import (
    Capabilities,
    EngineRejectedError,
    EngineRequest,
    EngineUnavailableError,
    PromptCounter,
    RequestChecks,
    SamplingOptions,
)

logger = logging.getLogger(__name__)

#: Upper bound of ``/result?wait=``, so a poll never pins a connection for long.
MAX_RESULT_WAIT_SEC = 60.0
#: Generation is not idle time: a session's keys last at least this long once its input is complete.
GENERATION_TTL_SEC = 3600.0


@dataclass(frozen=True)
class Replacement:
    """A replaced chunk (update mode): the store's outcome and the tokens it keeps."""

    outcome: InputOutcome
    #: Tokens at the start of the streamed input left unchanged; ``None`` when
    #: the engine cannot count them or the input is not all text.
    kept_tokens: int | None
    input_tokens: int | None


class SessionService:
    def __init__(self, settings: Settings, store: SessionStore, capabilities: Capabilities,
                 runners: RunnerPool, metrics: Metrics, draining: Draining,
                 checks: RequestChecks | None = None, sheds_new_work: Callable[[], bool] = lambda: False,
                 counter: PromptCounter | None = None) -> None:
        self._settings = settings
        self._store = store
        self._capabilities = capabilities
        self._runners = runners
        self._metrics = metrics
        self._draining = draining
        #: The engine's own checks, when it can make them before anything is stored.
        self._checks = checks
        #: How big a prompt is, as the engine counts it (its checks', or a sidecar's own count).
        self._counter = counter
        #: True while this process is too busy to start engine work (``web/middleware/admission.py``):
        #: work a call starts then waits in Redis for a tender with room, on any replica.
        self._sheds_new_work = sheds_new_work

    # --- validation shared by create and append ----------------------------

    def check_enabled(self) -> None:
        if not self._settings.enabled:
            raise errors.StreamingInputDisabled("streaming input is disabled on this service")

    async def _checked(self, new: NewSession) -> NewSession:
        """422 for a request the engine would refuse; its prompt so far counts against the context."""
        if self._checks is None:
            return new
        request = new.request.engine_request("check", new.model)
        try:
            # Rendering and tokenizing the history is CPU work: off the event loop.
            frame_tokens = await asyncio.to_thread(self._checks.check_request, request)
        except EngineRejectedError as exc:
            raise errors.ValidationFailed(str(exc), param=exc.param) from exc
        limit = self._checks.max_input_tokens
        if frame_tokens >= limit:
            raise errors.ContextLengthExceeded(
                f"the messages alone take {frame_tokens} tokens; the model's context leaves {limit} "
                "for the input", param="messages", prompt_tokens=frame_tokens, max_input_tokens=limit)
        return dataclasses.replace(new, max_input_tokens=limit, input_tokens=frame_tokens)

    async def _counted(self, chunk: ChunkRecord) -> ChunkRecord:
        """The chunk with the fewest tokens it adds, so the store can refuse what overflows."""
        if self._checks is None or chunk.modality != "text":
            return chunk
        text = chunk.payload.decode("utf-8", errors="replace")
        return dataclasses.replace(chunk, min_tokens=await asyncio.to_thread(self._checks.input_tokens_at_least, text))

    @property
    def max_input_tokens(self) -> int | None:
        """The most prompt tokens a request may take; ``None`` when the engine cannot count."""
        return None if self._counter is None else self._counter.max_input_tokens

    async def prompt_tokens(self, messages: list[ChatMessage], tools: list[dict[str, Any]]) -> int:
        """The tokens ``messages`` take before a turn's input (template included), counted as the
        engine counts them (by its tokenizer in a worker thread, or by the sidecar: a round trip)."""
        if self._counter is None:
            return 0
        request = EngineRequest("count", self._capabilities.model_names[0],
                                tuple(m.as_history() for m in messages), SamplingOptions(),
                                tools=tuple(tools))
        try:
            return await self._counter.prompt_tokens(request)
        except EngineRejectedError as exc:
            raise errors.ValidationFailed(str(exc)) from exc
        except EngineUnavailableError as exc:
            raise errors.EngineUnavailable(str(exc)) from exc

    def check_input_modality(self, chunk: ChunkRecord, param: str = "modality") -> None:
        """422 for input the engine cannot take, before anything is stored."""
        if chunk.modality not in self._capabilities.input_modalities:
            accepted = ", ".join(sorted(self._capabilities.input_modalities))
            raise errors.UnsupportedModality(
                f"the engine does not take {chunk.modality} input (it takes: {accepted})", param=param)

    @functools.cached_property
    def _too_large_json(self) -> str:
        """The failure a session gets when its input outgrows the cap (the Lua scripts store it)."""
        return errors.SessionPayloadTooLarge(
            f"the session's input exceeds {self._settings.max_payload_per_session} bytes; session closed",
        ).envelope_json()

    # --- use cases -----------------------------------------------------------

    async def create(self, identity: str, body: CreateSessionRequest, first: ChunkRecord | None,
                     idempotency_key: str | None = None) -> tuple[SessionRecord, bool]:
        """The new session, and whether its engine work started.

        With ``idempotency_key`` a repeat of the same request by the same
        identity returns the session the first made (not started by this call),
        so a client may retry a create whose answer it never got.
        """
        self.check_enabled()
        if idempotency_key is None:
            return await self._create(identity, body, first, f"sis-{uuid.uuid4().hex}")
        request = hashlib.sha256(body.model_dump_json(exclude=body.unset_since_digests).encode())
        request.update(first.digest_record().encode() if first is not None else b"")
        session_id = f"sis-{uuid.uuid4().hex}"
        # As long as a session can be read: its idle timeout, its generation budget, its result's life.
        s = self._settings
        ttl_ms = int((s.session_timeout_sec + max(s.session_timeout_sec, GENERATION_TTL_SEC) + s.result_ttl_sec) * 1000)
        first_made = await self._store.remember_creation(identity, idempotency_key,
                                                         f"{session_id} {request.hexdigest()}", ttl_ms)
        if first_made is not None:
            session_id, digest = first_made.split(" ", 1)
            if digest != request.hexdigest():
                raise errors.IdempotencyKeyReused(
                    "this Idempotency-Key was sent with another request; use a new key for a new session",
                    param="Idempotency-Key")
            try:
                return await self.view(identity, session_id), False
            except errors.SessionNotFound:
                pass  # the first try never got as far as making it: make it now, under its id
        try:
            return await self._create(identity, body, first, session_id)
        except errors.SessionExists:
            return await self.view(identity, session_id), False  # a twin of this call made it meanwhile

    async def _create(self, identity: str, body: CreateSessionRequest, first: ChunkRecord | None,
                      session_id: str) -> tuple[SessionRecord, bool]:
        model = self._resolve_model(body.model)
        unsupported = set(body.modalities) - self._capabilities.output_modalities
        if unsupported:
            produced = ", ".join(sorted(self._capabilities.output_modalities))
            raise errors.UnsupportedModality(
                f"the engine cannot produce {', '.join(sorted(unsupported))} output (it produces: {produced})",
                param="modalities")
        if body.speak_input and not self._capabilities.speech:
            raise errors.UnsupportedModality("the engine cannot speak its input: speak_input needs a Talker stage",
                                             param="speak_input")
        if body.speed not in (None, 1.0) and not self._capabilities.speech_speed:
            raise errors.ValidationFailed("the engine's voice speaks at one speed (its Talker takes none): speed "
                                          "is 1 here", param="speed")
        if body.raw_prompt and not self._capabilities.raw_prompt:
            raise errors.ValidationFailed("the engine takes chat messages only, not a raw prompt", param="raw_prompt")
        if body.logprobs and not self._capabilities.logprobs:
            raise errors.ValidationFailed("the engine does not return log probabilities", param="logprobs")
        if not body.modalities and not self._capabilities.transcription:
            raise errors.UnsupportedModality("the engine cannot hear without answering: modalities [] (only the "
                                             "transcript) needs a Listener stage", param="modalities")
        if body.tools and body.tool_choice != "none" and not self._capabilities.tools:
            raise errors.ValidationFailed("the engine does not call functions: tools are not served here",
                                          param="tools")
        held_to = body.format_constraint()
        if held_to is not None and not self._capabilities.structured_outputs:
            asked = "structured_outputs" if body.structured_outputs is not None else "response_format"
            raise errors.ValidationFailed(f"the engine does not hold an answer to a grammar: {asked} "
                                          f"{held_to['type']} is not served here", param=asked)
        if first is not None:
            self.check_input_modality(first, param="first_chunk.modality")
        new = await self._checked(self._new_session(body, model, identity))
        if first is not None:
            first = await self._counted(first)
        # Counted until it ends, or at most for its idle timeout plus the generation budget.
        until = new.created_at_ms + new.timeout_ms + new.generation_ttl_ms
        await self._store.admit(identity, session_id, per_identity=self._settings.max_sessions_per_identity,
                                overall=self._settings.max_open_sessions, until_ms=until)
        with self._claimant(listening=first is None or not first.end_of_input) as claimant:
            outcome = await self._store.create(session_id, new, claimant, first, self._too_large_json)
            self._metrics.transition(None, SessionState.OPEN)
            if first is not None:
                self._count_chunk(first, outcome)
            self._after_input(session_id, SessionState.OPEN, outcome)
        return await self._store.view(session_id), outcome.started

    async def append(self, identity: str, session_id: str, chunk: ChunkRecord) -> InputOutcome:
        self.check_enabled()
        self.check_input_modality(chunk)
        chunk = await self._counted(chunk)
        started_at = time.perf_counter()
        with self._claimant(listening=not chunk.end_of_input) as claimant:
            try:
                outcome = await self._store.append(session_id, chunk, claimant, self._too_large_json,
                                                   caller=owner_check(identity))
            except errors.SessionPayloadTooLarge as exc:
                self._metrics.transition(exc.previous_state, SessionState.FAILED)
                raise
            self._after_input(session_id, outcome.previous_state, outcome)
        self._metrics.append_latency.observe(time.perf_counter() - started_at)
        self._count_chunk(chunk, outcome)
        await self._mark_appended(session_id, chunk, outcome)
        return outcome

    async def replace(self, identity: str, session_id: str, chunk: ChunkRecord) -> Replacement:
        """Update mode: swap a chunk already received; the runner restarts from the common prefix."""
        self.check_enabled()
        self.check_input_modality(chunk)
        chunk = await self._counted(chunk)
        record = await self.view(identity, session_id)
        counted = await self._count_update(session_id, record.next_seq, chunk)
        kept, total = (counted[0], counted[1]) if counted is not None else (None, None)
        with self._claimant() as claimant:
            outcome = await self._store.replace(session_id, chunk, claimant, kept or 0, caller=owner_check(identity))
            self._after_input(session_id, outcome.previous_state, outcome)
        if counted is not None:
            await self._keep_token_marks(session_id, *counted[2:])
        if not outcome.duplicate:
            self._metrics.replaced_chunks.inc()
        return Replacement(outcome, kept, total)

    async def _count_update(self, session_id: str, next_seq: int, chunk: ChunkRecord,
                            ) -> tuple[int, int, int, str | None, list[tuple[str, TokenMark]]] | None:
        """The streamed input's tokens kept by the replacement and the new total, then the marks
        to keep: from which chunk, counted from which mark, and each. ``None``: not all text.

        Tokenized: the chunks from the replaced one on, and the few bytes before it its mark
        holds (service/token_marks.py); the whole input where no mark is kept for it.
        """
        if self._checks is None or chunk.modality != "text":
            return None
        at = min(chunk.sequence_id, next_seq)
        counted_from = await self._store.token_mark(session_id, at) if at else None
        first, mark = (at, TokenMark.from_field(counted_from)) if counted_from is not None else (0, START)
        stored = await self._store.load_chunks(session_id, range(first, next_seq)) if first < next_seq else []
        if any(c.modality != "text" for c in stored):
            return None
        kept, total, marks = await asyncio.to_thread(count_update, self._checks, mark, stored, chunk)
        return kept, total, first, counted_from, marks

    async def _mark_appended(self, session_id: str, chunk: ChunkRecord, outcome: InputOutcome) -> None:
        """Update mode: once a session's tokens are marked, each appended text chunk marks the next."""
        if self._checks is None or outcome.token_mark is None or chunk.modality != "text":
            return
        after = await asyncio.to_thread(advance, self._checks, TokenMark.from_field(outcome.token_mark),
                                        chunk.payload)
        await self._keep_token_marks(session_id, chunk.sequence_id, outcome.token_mark,
                                     [(chunk.content_digest, after)])

    async def _keep_token_marks(self, session_id: str, first: int, counted_from: str | None,
                                marks: list[tuple[str, TokenMark]]) -> None:
        """Keep marks (hints: a failure costs a later update a longer count, nothing else), then go
        on through chunks that arrived early and found no mark to count from."""
        assert self._checks is not None
        try:
            while kept := list(itertools.takewhile(lambda pair: pair[1].keepable, marks)):
                more = await self._store.keep_token_marks(session_id, first, counted_from,
                                                          [(sha, mark.to_field()) for sha, mark in kept])
                if not more or len(kept) < len(marks):
                    return
                first, last = first + len(kept), kept[-1][1]
                counted_from = last.to_field()
                [early] = await self._store.load_chunks(session_id, [first])
                if early.modality != "text":
                    return
                marks = [(early.content_digest, await asyncio.to_thread(advance, self._checks, last, early.payload))]
        except errors.GatewayError as exc:
            logger.warning("session %s: token marks not kept (%s)", session_id, exc)

    async def finish(self, identity: str, session_id: str, final_sequence_id: int | None) -> InputOutcome:
        with self._claimant(listening=False) as claimant:
            outcome = await self._store.finish(session_id, final_sequence_id, claimant, caller=owner_check(identity))
            self._after_input(session_id, outcome.previous_state, outcome)
        return outcome

    async def view(self, identity: str, session_id: str, *, with_result: bool = False) -> SessionRecord:
        record = await self._store.view(session_id, caller=owner_check(identity), with_result=with_result)
        if record.state is SessionState.EXPIRED:
            raise errors.SessionExpired(f"session {session_id!r} expired after being idle")
        return record

    async def events(self, identity: str, session_id: str, after: str) -> AsyncIterator[ServerSentEvent] | None:
        """The session's frames after ``after``; ``None`` when the client has seen the final one.

        Checked before the first byte, so a missing or expired session is a
        404 / 410. Browsers' ``EventSource`` reconnects with the last id it
        saw, even after ``[DONE]``; answering those with an open stream kept
        one open request per reconnect for the result's lifetime.
        """
        await self.view(identity, session_id)
        final = await self._store.last_frame(session_id)
        if final is not None and final.last and event_id_key(after) >= event_id_key(final.id):
            return None
        if after != BEFORE_FIRST and (final is None or event_id_key(after) > event_id_key(final.id)):
            # Past a live stream's last frame: none of its frames would be sent, not even the final one.
            raise not_an_event_id()
        return session_events(self._store, session_id, after)

    async def cancel(self, identity: str, session_id: str) -> None:
        cancelled = errors.SessionCancelled("the session was cancelled by the client").envelope_json()
        before = await self._store.cancel(session_id, cancelled, caller=owner_check(identity))
        self._metrics.transition(before, SessionState.CANCELLED)

    async def result(self, identity: str, session_id: str, wait_sec: float) -> SessionRecord:
        """The session once terminal, or as it is when ``wait_sec`` runs out."""
        deadline = time.monotonic() + min(max(wait_sec, 0.0), MAX_RESULT_WAIT_SEC)
        while True:
            # Read the last frame id before the state: a terminal frame written
            # in between then wakes the blocking read below at once.
            last = await self._store.last_frame_id(session_id)
            record = await self.view(identity, session_id, with_result=True)
            remaining = deadline - time.monotonic()
            if record.state.is_terminal or remaining <= 0:
                return record
            # Through the replica's one stream reader: a long poll holds no connection of its own.
            async with self._store.output_stream(session_id, last) as frames:
                await frames.read(max(1, int(remaining * 1000)))

    # --- helpers ---------------------------------------------------------------

    def _resolve_model(self, requested: str | None) -> str:
        names = self._capabilities.model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise errors.ModelNotFound(f"model {requested!r} is not served here (served: {', '.join(names)})",
                                       param="model")
        return requested

    def _new_session(self, body: CreateSessionRequest, model: str, identity: str) -> NewSession:
        s = self._settings
        policy = body.start_policy or s.start_policy
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampling = SamplingOptions(
            max_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, stop=tuple(stop),
            # An answer held to JSON, or calling a function, is made again from its start
            # after a hand-off: with the same seed it comes out the same (work/said_again.py).
            seed=body.seed if body.seed is not None or not _made_again(body) else secrets.randbelow(2**31),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_p=body.min_p, logit_bias=body.logit_bias,
            response_format=body.format_constraint(), min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
            logprobs=body.logprobs_asked, stop_token_ids=_tuple(body.stop_token_ids),
            include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens, bad_words=_tuple(body.bad_words))
        request = StoredRequest(
            messages=tuple(m.as_history() for m in body.messages),
            modalities=tuple(body.modalities), sampling=sampling,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            metadata=body.metadata or {},
            tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
            tool_choice=(body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                         else body.tool_choice.model_dump()),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            input_role=body.input_role, input_tool_call_id=body.input_tool_call_id,
            chat_template_kwargs=body.chat_template_kwargs or {}, speak_input=body.speak_input,
            raw_prompt=body.raw_prompt, add_generation_prompt=body.generation_prompt,
            continue_final_message=bool(body.continue_final_message), speech_speed=body.speed or 1.0)
        timeout_ms = int(s.session_timeout_sec * 1000)
        return NewSession(
            policy=policy, model=model, identity=identity, request=request,
            created_at_ms=int(time.time() * 1000),
            start=StartThresholds.for_policy(policy, body.min_length, s.min_length_bytes),
            max_out_of_order=s.max_out_of_order, max_bytes=s.max_payload_per_session,
            max_chunks=s.max_chunks_per_session, timeout_ms=timeout_ms,
            result_ttl_ms=int(s.result_ttl_sec * 1000),
            generation_ttl_ms=int(max(s.session_timeout_sec, GENERATION_TTL_SEC) * 1000),
            lease_ttl_ms=int(s.lease_ttl_sec * 1000))

    def _count_chunk(self, chunk: ChunkRecord, outcome: InputOutcome) -> None:
        self._metrics.chunks.labels(chunk.modality, "duplicate" if outcome.duplicate else "accepted").inc()
        if not outcome.duplicate:
            self._metrics.chunk_bytes.labels(chunk.modality).inc(len(chunk.payload))

    @contextlib.contextmanager
    def _claimant(self, *, listening: bool = True) -> Iterator[str]:
        """This replica's id when it can take engine work that a call starts, else ''.

        ``listening``: the work may still be waiting for input, so it needs
        room among the listening sessions too (input-complete work does not).
        The room is held until the block ends: run the store call and start
        the runner (``_after_input``) inside it.
        """
        if self._draining.active or self._sheds_new_work():
            yield ""
            return
        with self._runners.reservation(listening=listening) as held:
            yield self._settings.replica_id if held else ""

    def _after_input(self, session_id: str, before: SessionState, outcome: InputOutcome) -> None:
        self._metrics.transition(before, outcome.state)
        if outcome.lease is not None:
            self._runners.start(session_id, outcome.lease)


def _tuple(values: list[Any] | None) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def _made_again(body: CreateSessionRequest) -> bool:
    """Whether a hand-off mid-answer makes the answer again from its start (work/said_again.py)."""
    return body.format_constraint() is not None or (bool(body.tools) and body.tool_choice != "none")
