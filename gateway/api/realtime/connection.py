"""One Realtime WebSocket connection: OpenAI Realtime events in, session calls out.

Transports translate, sessions decide. Each turn of the conversation is one
streaming-input session, the same kind Mode B clients make (Redis, sequence
ids, start policy, lease, identity, limits), whose history is the earlier
turns. Appended audio and user items are appended to the turn's session as
they arrive, so the engine prefills while the user is still speaking;
``response.create`` (or the end of speech, with ``server_vad``) ends the
input, and the session's frames come back as response events (``answer.py``).
A reader per turn follows the session's output from its start, so the
transcript of the spoken input is told while it grows.

Reconnects: the connection's state (settings, history, the open turn) is
saved in Redis after every change, and every event made from a session frame
has an id derived from it (``event_<frame id>_<n>``), so a client that lost
its socket reconnects to any replica with ``?session_id=`` and
``last_event_id=`` and gets exactly the events after that one: the reader
replays the turn's frames from the start, muted up to that point.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chunks import b64decode_in_slices, record_from_json
from gateway.api.realtime import events as ev
from gateway.api.realtime.answer import Answer
from gateway.api.realtime.config import RealtimeConfig
from gateway.api.realtime.vad import SpeechDetector
from gateway.metrics import Metrics
from gateway.service.models import ChatMessage, ChunkIn, CreateSessionRequest, StreamOptions
from gateway.service.sessions import SessionService
from gateway.store.records import event_id_key
from gateway.store.redis_store import SessionStore

logger = logging.getLogger(__name__)

#: OpenAI Realtime's audio: pcm16 mono at 24 kHz, base64 in the events.
RATE = 24_000
#: Appended audio is handled a second at a time (pcm16 bytes).
AUDIO_PIECE_BYTES = RATE * 2
#: Base64 audio from this size on is decoded in a worker thread.
OFF_LOOP_CHARS = 256 * 1024

Send = Callable[[dict[str, Any]], Awaitable[None]]
#: An event's place in a session's output: (frame id as sortable, its index among that frame's events).
Position = tuple[tuple[int, int], int]


@dataclass
class _FrameOrigin:
    """The frame whose events are being sent (set in the reader's task only)."""

    frame_id: str
    #: Events at or before this place were sent before a reconnect: not again.
    muted_through: Position | None
    count: int = 0


_FRAME: ContextVar[_FrameOrigin | None] = ContextVar("realtime_frame", default=None)


def resume_position(last_event_id: str | None) -> Position | None:
    """Where a reconnecting client stopped, from the id of the last event it saw."""
    if not last_event_id or not last_event_id.startswith("event_"):
        return None
    frame_id, _, index = last_event_id[len("event_"):].rpartition("_")
    try:
        return event_id_key(frame_id), int(index)
    except ValueError:
        return None


@dataclass
class Turn:
    """One user turn: its session, and what the conversation keeps of it."""

    session_id: str
    next_seq: int = 0
    texts: list[str] = field(default_factory=list)
    #: The item of the audio since the last commit (None: no audio yet).
    audio_item_id: str | None = None
    committed: bool = False
    audio_ms: int = 0
    transcript: str = ""
    told_transcript: bool = False
    answer: Answer | None = None
    reader: asyncio.Task[None] | None = None

    def saved(self) -> dict[str, Any]:
        # The transcript and the answer's text are not kept: a reconnect replays them from the frames.
        answer = None if self.answer is None else {"response_id": self.answer.response_id,
                                                   "item_id": self.answer.item_id}
        return {"session_id": self.session_id, "next_seq": self.next_seq, "texts": self.texts,
                "audio_item_id": self.audio_item_id, "committed": self.committed, "audio_ms": self.audio_ms,
                "answer": answer}


class RealtimeConnection:
    def __init__(self, send: Send, service: SessionService, store: SessionStore, identity: str,
                 config: RealtimeConfig, metrics: Metrics, max_chunk_bytes: int, keep_sec: float) -> None:
        self._send_raw = send
        self._service = service
        self._store = store
        self._identity = identity
        self.config = config
        self._metrics = metrics
        self._max_chunk_bytes = max_chunk_bytes
        self._keep_sec = keep_sec
        self._history: list[ChatMessage] = []
        self._turn: Turn | None = None
        self._last_item_id: str | None = None
        self._detector: SpeechDetector | None = None
        self._padding = bytearray()
        self.id = ev.new_id("sess")
        self._saved = ""
        self._resume_at: Position | None = None

    # --- state kept in Redis, for a reconnect ---------------------------------

    async def _save(self) -> None:
        state = json.dumps({
            "identity": self._identity, "config": asdict(self.config),
            "history": [m.model_dump(exclude_none=True) for m in self._history],
            "last_item_id": self._last_item_id, "turn": self._turn.saved() if self._turn else None})
        if state == self._saved:
            return
        try:
            await self._store.save_conversation(self.id, state, self._keep_sec)
            self._saved = state
        except errors.StoreUnavailable:
            logger.warning("realtime %s: could not save its state (a reconnect would miss the latest)", self.id)

    async def restore(self, conversation_id: str, last_event_id: str | None) -> None:
        """Take over a connection that broke off: its state, and its open turn after ``last_event_id``."""
        raw = await self._store.load_conversation(conversation_id)
        state = json.loads(raw) if raw else None
        if state is None or (state["identity"] != self._identity and self._identity_checked):
            raise errors.SessionNotFound(f"no realtime session {conversation_id!r} to resume", param="session_id")
        self.id = conversation_id
        self.config = RealtimeConfig.restored(state["config"])
        self._history = [ChatMessage(**m) for m in state["history"]]
        self._last_item_id = state["last_item_id"]
        saved = state["turn"]
        if saved is not None:
            turn = Turn(saved["session_id"], saved["next_seq"], saved["texts"], saved["audio_item_id"],
                        saved["committed"], saved["audio_ms"])
            if saved["answer"] is not None:
                turn.answer = Answer(self._emit, self.config.output_modalities, **saved["answer"])
            self._turn = turn
            self._resume_at = resume_position(last_event_id)  # its reader starts after session.created

    @property
    def _identity_checked(self) -> bool:
        # Open mode has no identities to compare (the id is the secret), as for sessions.
        return not self._identity.startswith("client:")

    async def _emit(self, event: dict[str, Any]) -> None:
        """Send an event; one made from a session frame gets an id a reconnect can resume after."""
        origin = _FRAME.get()
        if origin is not None:
            index, origin.count = origin.count, origin.count + 1
            event["event_id"] = f"event_{origin.frame_id}_{index}"
            if origin.muted_through is not None and (event_id_key(origin.frame_id), index) <= origin.muted_through:
                return
        await self._send_raw(event)

    # --- the client's events --------------------------------------------------

    async def opened(self) -> None:
        await self._emit(ev.event("session.created", session=self.config.session_object(self.id)))
        turn = self._turn
        if turn is not None and turn.reader is None:  # restored: follow it again, muted up to where the client was
            turn.reader = asyncio.create_task(self._follow(turn, self._resume_at), name=f"realtime-{turn.session_id}")
        await self._save()

    async def handle(self, message: dict[str, Any]) -> None:
        """One client event; a bad one gets an ``error`` event and the connection goes on."""
        client_event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
        kind = message.get("type")
        handler = self._handlers.get(kind) if isinstance(kind, str) else None
        self._metrics.realtime_event("in", str(kind) if handler else "unknown")
        try:
            if handler is None:
                raise errors.InvalidRequest(f"unknown or missing event type {kind!r}", param="type")
            await handler(self, message)
        except errors.GatewayError as exc:
            if exc.code in ("session_expired", "session_not_found", "session_closed", "session_cancelled"):
                gone, self._turn = self._turn, None  # its session is gone: the next input opens a new turn
                if gone is not None and gone.reader is not None:
                    gone.reader.cancel()
            await self._emit(ev.error(exc, client_event_id))
        except Exception:
            # A bug must not take the connection (and its open turn) down with it.
            logger.exception("realtime %s: handling %s failed", self.id, kind)
            await self._emit(ev.error(errors.GatewayError("the server failed to handle this event"), client_event_id))
        await self._save()

    async def close(self) -> None:
        """The socket closed: stop reading. The open turn stays for a reconnect (its session's timeout)."""
        turn = self._turn
        if turn is not None and turn.reader is not None:
            turn.reader.cancel()
            await asyncio.gather(turn.reader, return_exceptions=True)

    async def _drop_turn(self) -> None:
        """End the open turn for good: stop reading it and cancel its session."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        if turn.reader is not None:
            turn.reader.cancel()
            await asyncio.gather(turn.reader, return_exceptions=True)
        with contextlib.suppress(errors.GatewayError):
            await self._service.cancel(self._identity, turn.session_id)

    async def _session_update(self, message: dict[str, Any]) -> None:
        session = message.get("session")
        if not isinstance(session, dict):
            raise errors.ValidationFailed("session.update needs a session object", param="session")
        self.config.update(session)
        self._detector = None  # new turn detection settings apply from the next audio
        await self._emit(ev.event("session.updated", session=self.config.session_object(self.id)))

    async def _audio_append(self, message: dict[str, Any]) -> None:
        audio = message.get("audio")
        if not isinstance(audio, str):
            raise errors.ValidationFailed("input_audio_buffer.append needs audio (base64 pcm16)", param="audio")
        try:
            pcm = b64decode_in_slices(audio) if len(audio) < OFF_LOOP_CHARS else \
                await asyncio.to_thread(b64decode_in_slices, audio)
        except (binascii.Error, ValueError) as exc:
            raise errors.InvalidPayload("audio is not valid base64", param="audio") from exc
        # A long stretch of audio in one event is taken a second at a time, as if the client
        # had sent it so: the event loop gets a turn between pieces (minutes of audio in one
        # event held it for over 0.1 s).
        for start in range(0, len(pcm), AUDIO_PIECE_BYTES):
            if start:
                await asyncio.sleep(0)
            await self._audio_piece(pcm[start:start + AUDIO_PIECE_BYTES])

    async def _audio_piece(self, pcm: bytes) -> None:
        vad = self.config.server_vad
        if vad is None:
            await self._append_audio(pcm)
            return
        if self._detector is None:
            self._detector = SpeechDetector(RATE, vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms)
        was_speaking = self._detector.speaking
        changes = self._detector.feed(pcm)
        if not was_speaking and not any(c.kind == "speech_started" for c in changes):
            self._keep_padding(pcm, vad.prefix_padding_ms)
            return
        for change in changes:
            if change.kind == "speech_started":
                await self._speech_started(change.at_ms, vad.interrupt_response)
        await self._append_audio(pcm)
        for change in changes:
            if change.kind == "speech_stopped":
                await self._emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=change.at_ms,
                                          item_id=self._turn.audio_item_id if self._turn else ""))
                await self._commit()
                if vad.create_response:
                    await self._respond()

    async def _audio_commit(self, _: dict[str, Any]) -> None:
        await self._commit()

    async def _audio_clear(self, _: dict[str, Any]) -> None:
        """Drop the audio since the last commit: the turn starts again with its text items."""
        turn = self._turn
        self._padding.clear()
        if turn is not None and turn.audio_item_id is not None and not turn.committed:
            if turn.answer is not None:
                raise errors.ConflictError("a response is in progress; cancel it first")
            await self._drop_turn()
            for text in turn.texts:
                await self._append(ChunkIn(sequence_id=0, text=text))
            if self._turn is not None:
                self._turn.texts = list(turn.texts)
        await self._emit(ev.event("input_audio_buffer.cleared"))

    async def _item_create(self, message: dict[str, Any]) -> None:
        item = message.get("item")
        if not isinstance(item, dict) or item.get("type") != "message" or item.get("role") != "user":
            raise errors.ValidationFailed("conversation.item.create takes a user message item", param="item")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise errors.ValidationFailed("a user message needs content", param="item.content")
        given_id = item.get("id")
        item_id = given_id if isinstance(given_id, str) else ev.new_id("item")
        chunks: list[ChunkIn] = []
        for i, part in enumerate(content):  # all checked before anything is appended
            if isinstance(part, dict) and part.get("type") == "input_text" and isinstance(part.get("text"), str):
                chunks.append(ChunkIn(sequence_id=0, text=part["text"]))
            elif isinstance(part, dict) and part.get("type") == "input_audio" and isinstance(part.get("audio"), str):
                chunks.append(ChunkIn(sequence_id=0, modality="audio", payload=part["audio"], format="pcm16",
                                      sample_rate=RATE))
            else:
                raise errors.ValidationFailed("content parts are input_text (text) or input_audio (audio)",
                                              param=f"item.content.{i}")
        for chunk in chunks:
            turn = await self._append(chunk)
            if chunk.text is not None:
                turn.texts.append(chunk.text)
            elif turn.audio_item_id is None:
                turn.audio_item_id, turn.committed = item_id, True  # an item, not the input buffer
        # The audio itself is not echoed back (it can be megabytes).
        content = [p if p.get("type") == "input_text" else {"type": "input_audio", "transcript": None}
                   for p in content]
        shown = ev.user_item(item_id, content)
        await self._emit(ev.event("conversation.item.added", previous_item_id=self._last_item_id, item=shown))
        await self._emit(ev.event("conversation.item.done", previous_item_id=self._last_item_id, item=shown))
        self._last_item_id = item_id

    async def _response_create(self, _: dict[str, Any]) -> None:
        await self._respond()

    async def _response_cancel(self, _: dict[str, Any]) -> None:
        turn = self._turn
        if turn is None or turn.answer is None or turn.answer.ended:
            raise errors.ConflictError("there is no response in progress to cancel")
        await self._cancel_answer(turn, "client_cancelled")

    _handlers: dict[str, Callable[[RealtimeConnection, dict[str, Any]], Awaitable[None]]] = {
        "session.update": _session_update,
        "input_audio_buffer.append": _audio_append,
        "input_audio_buffer.commit": _audio_commit,
        "input_audio_buffer.clear": _audio_clear,
        "conversation.item.create": _item_create,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }

    # --- turns ------------------------------------------------------------------

    async def _open_turn(self) -> Turn:
        if self._turn is not None and self._turn.answer is None:
            return self._turn
        if self._turn is not None and not self._turn.answer.ended:  # type: ignore[union-attr]
            raise errors.ConflictError("a response is in progress; wait for response.done or cancel it")
        c = self.config
        messages = ([ChatMessage(role="system", content=c.instructions)] if c.instructions else []) + self._history
        request = CreateSessionRequest(
            messages=messages, modalities=c.session_modalities, max_tokens=c.max_output_tokens,
            temperature=c.temperature, stream_options=StreamOptions(include_usage=True))
        record, _ = await self._service.create(self._identity, request, None)
        turn = Turn(record.session_id)
        turn.reader = asyncio.create_task(self._follow(turn, None), name=f"realtime-{record.session_id}")
        self._turn = turn
        return turn

    async def _append(self, chunk: ChunkIn) -> Turn:
        turn = await self._open_turn()
        record = record_from_json(chunk.model_copy(update={"sequence_id": turn.next_seq}), self._max_chunk_bytes)
        await self._service.append(self._identity, turn.session_id, record)
        turn.next_seq += 1
        turn.audio_ms += record.audio_ms
        return turn

    async def _append_audio(self, pcm: bytes) -> None:
        if not pcm:
            return
        turn = await self._append(ChunkIn(sequence_id=0, modality="audio",
                                          payload=base64.b64encode(pcm).decode(), format="pcm16",
                                          sample_rate=RATE))
        if turn.audio_item_id is None:
            turn.audio_item_id = ev.new_id("item")

    def _keep_padding(self, pcm: bytes, padding_ms: int) -> None:
        self._padding += pcm
        keep = RATE * 2 * padding_ms // 1000
        del self._padding[:max(0, len(self._padding) - keep)]

    async def _speech_started(self, at_ms: int, interrupt: bool) -> None:
        if interrupt and self._turn is not None and self._turn.answer is not None and not self._turn.answer.ended:
            await self._cancel_answer(self._turn, "turn_detected")  # barge-in
        padding, self._padding = bytes(self._padding), bytearray()
        await self._append_audio(padding)
        turn = await self._open_turn()
        if turn.audio_item_id is None:
            turn.audio_item_id = ev.new_id("item")
        await self._emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=at_ms,
                                  item_id=turn.audio_item_id))

    async def _commit(self) -> None:
        turn = self._turn
        if turn is None or turn.audio_item_id is None or turn.committed or turn.answer is not None:
            raise errors.EmptyInput("the input audio buffer is empty", param="audio")
        turn.committed = True
        await self._emit(ev.event("input_audio_buffer.committed", previous_item_id=self._last_item_id,
                                  item_id=turn.audio_item_id))
        item = ev.user_item(turn.audio_item_id, [{"type": "input_audio", "transcript": None}])
        await self._emit(ev.event("conversation.item.added", previous_item_id=self._last_item_id, item=item))
        await self._emit(ev.event("conversation.item.done", previous_item_id=self._last_item_id, item=item))
        self._last_item_id = turn.audio_item_id

    async def _respond(self) -> None:
        turn = self._turn
        if turn is not None and turn.answer is not None and not turn.answer.ended:
            raise errors.ConflictError("the conversation already has an active response")
        if turn is None or turn.answer is not None or turn.next_seq == 0:
            raise errors.EmptyInput("no new input to respond to: append audio or create a user item first")
        if turn.audio_item_id is not None and not turn.committed:
            await self._commit()  # the audio so far is this turn's input
        turn.answer = Answer(self._emit, self.config.output_modalities, ev.new_id("resp"), ev.new_id("item"))
        await turn.answer.begin()
        await self._service.finish(self._identity, turn.session_id, None)

    async def _cancel_answer(self, turn: Turn, reason: str) -> None:
        # Told first, so the reason is this one (the session's own cancel frame follows).
        await self._end_turn(turn, "cancelled", reason)
        with contextlib.suppress(errors.SessionClosed):  # it completed meanwhile
            await self._service.cancel(self._identity, turn.session_id)

    # --- the session's output -----------------------------------------------------

    async def _follow(self, turn: Turn, muted_through: Position | None) -> None:
        """Read the turn's session output from its start; a failure ends only this turn."""
        try:
            stream = await self._service.events(self._identity, turn.session_id, "0-0")
            if stream is None:  # only after the final frame, and this read starts at the first
                return
            async for frame in stream:
                token = _FRAME.set(_FrameOrigin(str(frame.id), muted_through))
                try:
                    await self._on_frame(turn, frame)
                finally:
                    _FRAME.reset(token)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("realtime %s: following session %s failed", self.id, turn.session_id)
            if turn.answer is not None:
                await self._end_turn(turn, "failed", None,
                                     {"type": "server_error", "code": "internal_error", "message": "the answer broke off"})

    async def _on_frame(self, turn: Turn, frame: ServerSentEvent) -> None:
        if turn.answer is not None and turn.answer.ended:
            return  # cancelled: what the engine wrote before it stopped is not sent after response.done
        data = str(frame.data)
        if frame.event == "transcript":
            heard = json.loads(data)["input_transcript"]
            delta = heard[len(turn.transcript):] if heard.startswith(turn.transcript) else heard
            turn.transcript = heard
            if delta and turn.audio_item_id:
                await self._emit(ev.event("conversation.item.input_audio_transcription.delta",
                                          item_id=turn.audio_item_id, content_index=0, delta=delta))
            return
        if frame.event == "error":
            body = json.loads(data)["error"]
            if turn.answer is None:
                # The turn failed before its response (e.g. no speech recognized, or it expired).
                await self._emit(ev.error(errors.from_envelope({"error": body})))
                if self._turn is turn:
                    self._turn = None
                return
            cancelled = body.get("code") == "session_cancelled"
            await self._end_turn(turn, "cancelled" if cancelled else "failed", "client_cancelled" if cancelled else None,
                                 None if cancelled else {"type": body.get("type"), "code": body.get("code"),
                                                         "message": body.get("message")})
            return
        if data == "[DONE]" or turn.answer is None:
            if turn.answer is not None:
                await self._tell_transcript(turn)
                await self._end_turn(turn, "completed")
            return
        chunk = orjson.loads(data)  # a frame per answer token; written by orjson too (output/frames.py)
        if chunk.get("usage"):
            turn.answer.on_usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                await self._tell_transcript(turn)
                await turn.answer.on_text(delta["content"])
            if delta.get("audio"):
                await turn.answer.on_audio(delta["audio"]["data"])

    async def _tell_transcript(self, turn: Turn) -> None:
        """``...transcription.completed`` once, before the answer, for a turn that was spoken."""
        if turn.told_transcript or turn.audio_item_id is None:
            return
        turn.told_transcript = True
        await self._emit(ev.event("conversation.item.input_audio_transcription.completed",
                                  item_id=turn.audio_item_id, content_index=0, transcript=turn.transcript,
                                  usage={"type": "duration", "seconds": turn.audio_ms / 1000}))

    async def _end_turn(self, turn: Turn, status: str, reason: str | None = None,
                        error: dict[str, Any] | None = None) -> None:
        """The response is over: tell it, and keep the turn in the conversation's history."""
        assert turn.answer is not None
        if turn.answer.ended:
            return
        await turn.answer.end(status, reason, error)
        self._last_item_id = turn.answer.item_id
        said = " ".join(part for part in [*turn.texts, turn.transcript] if part)
        if said:
            self._history.append(ChatMessage(role="user", content=said))
            if turn.answer.text:
                self._history.append(ChatMessage(role="assistant", content=turn.answer.text))
        if self._turn is turn:
            self._turn = None
        await self._save()
