"""One Realtime WebSocket connection: OpenAI Realtime events in, session calls out.

Transports translate, sessions decide. The conversation is a list of items
(``conversation.py``); every answer is one streaming-input session, the kind
Mode B clients make (Redis, sequence ids, start policy, lease, identity,
limits), whose history is the conversation before it. Two kinds of *run*
(a session and the response it becomes):

* a **turn**: the user's live input. Appended audio and user items go into
  its session as they arrive, so the engine prefills while the user is still
  speaking; ``response.create`` (or the end of speech, with ``server_vad``)
  ends the input, and the session's frames come back as response events.
* an **answer from items**: its input is the conversation's last item (a
  function's output, a user or system message), complete at once. It serves
  ``response.create`` when no turn is open, a response with its own
  ``instructions`` / ``tools`` / ``input``, and out-of-band answers
  (``conversation: none``, which add nothing to the conversation).

An edit of the history (an item placed before the end, a system or assistant
item, a function's output, a delete, a truncate) ends a text-only turn that
has not been answered: its items are in the conversation, and the answer is
made from them. A turn holding audio keeps its session (its audio is in that
session only), and the edit applies from the next answer.

While an answer is in progress, the user's next input (audio, a commit, a
user item) waits and is handled when the answer ends, so speech during an
answer with ``interrupt_response: false`` is answered next; with it, speech
cancels the answer (barge-in). Input after a committed turn that was not
answered (``create_response: false``) opens the next turn: each utterance is an
item of its own, and a later response answers them together.

A **transcription session** (``config.py``) has turns and no answers: a commit (the
client's, or the end of speech with ``server_vad``) ends the turn's input, and the
recognizer's last words end it with ``...input_audio_transcription.completed``; the
next audio opens the next turn meanwhile, so a speaker is never held up by the
transcript before. Events that make or edit answers are refused.

Reconnects: the connection's state (settings, items, the open turn) is saved
in Redis when it changes, never per audio append (the turn's session is its
own cursor: a reconnect reads its next sequence id from it), and the answer
is saved before the input is finished (intent first). Every event's id marks
a position (``resume.py``), so a client that lost its socket reconnects to
any replica with ``?session_id=`` and ``last_event_id=`` and gets exactly the
events after that one: the reader replays the turn's frames, muted up to it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson
from fastapi import WebSocketDisconnect
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chunks import b64decode_in_slices, record_from_json
from gateway.api.realtime import events as ev
from gateway.api.realtime.answer import BYTES_PER_MS, Answer
from gateway.api.realtime.config import (
    RealtimeConfig,
    ServerVad,
    chat_tool_choice,
    chat_tools,
    check_response_fields,
    choice_without_tool,
    output_token_limit,
    parallel_tool_calls,
    tool_choice_fits,
)
from gateway.api.realtime.conversation import ROOT, Conversation, item_text, public, without_oldest
from gateway.api.realtime.resume import (
    EVERYTHING,
    START,
    EventPlace,
    Position,
    connection_tag,
    event_place,
    frame_event_id,
    request_event_id,
)
from gateway.api.realtime.tasks import spawn
from gateway.api.realtime.vad import SpeechDetector
from gateway.domain.policies import StartPolicy
from gateway.domain.states import SessionState
from gateway.metrics import Metrics
from gateway.service.models import (
    ChatMessage,
    ChunkIn,
    CreateSessionRequest,
    StreamOptions,
    lone_surrogate_at,
    not_unicode,
)
from gateway.service.sessions import SessionService
from gateway.settings import Settings
from gateway.store.records import event_id_key
from gateway.store.redis_store import SessionStore
from gateway.web.websocket import EventBudget

logger = logging.getLogger(__name__)

#: OpenAI Realtime's audio: pcm16 mono at 24 kHz, base64 in the events.
RATE = 24_000
#: Appended audio is handled a second at a time (pcm16 bytes).
AUDIO_PIECE_BYTES = RATE * 2
#: Base64 audio from this size on is decoded in a worker thread.
OFF_LOOP_CHARS = 256 * 1024

Send = Callable[[dict[str, Any]], Awaitable[None]]
#: The client events that are the user's input: while an answer runs, they wait for its end.
USER_INPUT = frozenset({"input_audio_buffer.append", "input_audio_buffer.commit", "conversation.item.create"})
#: What the held input may add up to (base64 characters: about a minute of audio).
MAX_HELD_CHARS = 4 * 1024 * 1024
#: The client events a transcription session refuses: it makes no answers, and its items are the
#: recognizer's.
ANSWERING = frozenset({"response.create", "response.cancel", "conversation.item.create",
                       "conversation.item.delete", "conversation.item.truncate"})
#: The longest id a client may give its item (OpenAI's bound).
MAX_ITEM_ID_CHARS = 32
#: The least audio a commit takes (OpenAI's ``input_audio_buffer_commit_empty`` below it).
MIN_COMMIT_MS = 100
#: How long a new turn waits for the words of a turn whose answer was cancelled (barge-in).
UNHEARD_WAIT_SEC = 5.0
#: A transcription session keeps its latest items only (for ``retrieve``): it may run for hours.
TRANSCRIBED_ITEMS_KEPT = 32
#: The latest request events a reconnect may send again (see resume.py), and the largest kept
#: (JSON characters: an item of a long text is not; a client that missed it misses it).
OUTBOX_EVENTS, OUTBOX_EVENT_CHARS = 32, 8192

#: A request event kept for a reconnect: its number, the run and frame event it followed, the event.
Told = tuple[int, int, Position, dict[str, Any]]


@dataclass
class _FrameOrigin:
    """The frame whose events are being sent (set in the reader's task only)."""

    frame_id: str
    #: The run (the conversation's count of answers) the frame is of.
    run: int
    #: Events at or before this place were sent before a reconnect: not again.
    muted_through: EventPlace | None
    #: The open turn's frames: request events after them name their position.
    tracked: bool
    count: int = 0


_FRAME: ContextVar[_FrameOrigin | None] = ContextVar("realtime_frame", default=None)


@dataclass(frozen=True)
class Params:
    """What an answer is made with: the session's settings, and a response's own."""

    instructions: str
    modalities: tuple[str, ...]
    max_output_tokens: int | None
    temperature: float | None
    tools: tuple[str, ...]  # JSON of each, so the whole is comparable
    tool_choice: str
    #: False: at most one function call in the answer.
    parallel_tool_calls: bool = True
    metadata: tuple[tuple[str, str], ...] = ()
    #: How fast its audio is spoken: the session's (a response cannot set it, as in OpenAI's protocol).
    speed: float = 1.0

    def tools_list(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.tools]

    def choice(self) -> str | dict[str, Any]:
        return self.tool_choice if self.tool_choice in ("auto", "none", "required") else json.loads(self.tool_choice)


@dataclass
class Run:
    """A session and the response it becomes (see the module docstring)."""

    session_id: str
    #: True: a turn, its input streamed as it comes; False: an answer from items.
    streaming: bool
    #: Its answer's items join the conversation (False: out of band).
    in_conversation: bool = True
    #: What it was made from; a turn whose basis differs from a response's is not that response.
    basis: tuple[Any, ...] = ()
    next_seq: int = 0
    #: The conversation items that are its input.
    item_ids: list[str] = field(default_factory=list)
    #: The input buffer's item (None: no audio in this turn).
    audio_item_id: str | None = None
    committed: bool = False
    audio_ms: int = 0
    transcript: str = ""
    told_transcript: bool = False
    #: A run being heard out: ``{}`` once its transcript is complete, ``{"error": ...}`` once it
    #: failed; told in commit order (``_tell_heard_in_order``).
    outcome: dict[str, Any] | None = None
    answer: Answer | None = None
    reader: asyncio.Task[None] | None = None
    #: A committed turn set aside unanswered by the user's next input: only its words are wanted.
    set_aside: bool = False
    #: Its place among the conversation's runs (event ids name it: see resume.py).
    index: int = 0
    #: Audio ms and chunks committed before the input buffer's item, in this same session (an
    #: engine that hears audio itself takes the next utterance in the committed turn's session).
    committed_ms: int = 0
    committed_chunks: int = 0

    @property
    def holds_audio(self) -> bool:
        return self.audio_item_id is not None or self.committed_chunks > 0

    @property
    def answering(self) -> bool:
        return self.answer is not None and not self.answer.ended

    def saved(self) -> dict[str, Any]:
        # The transcript and the answer's text are not kept: a reconnect replays them from the frames.
        return {"session_id": self.session_id, "streaming": self.streaming, "basis": list(self.basis),
                "item_ids": self.item_ids, "audio_item_id": self.audio_item_id, "committed": self.committed,
                "audio_ms": self.audio_ms, "answer": None if self.answer is None else self.answer.saved()}


class RealtimeConnection:
    def __init__(self, send: Send, service: SessionService, store: SessionStore, identity: str,
                 config: RealtimeConfig, metrics: Metrics, settings: Settings, budget: EventBudget) -> None:
        self._send_raw = send
        self._service = service
        self._store = store
        self._identity = identity
        self.config = config
        self._metrics = metrics
        self._settings = settings
        self._budget = budget
        self.conversation = Conversation()
        #: Bumped by every edit of the history (not by a turn's own input).
        self._version = 0
        self._turn: Run | None = None
        #: Out-of-band answers, by response id.
        self._side: dict[str, Run] = {}
        #: A transcription session's committed turns whose end is not told yet, by item id, in order.
        self._hearing: dict[str, Run] = {}
        #: Conversation turns whose answer was cancelled before their words were heard, or set
        #: aside unanswered: their session goes on until its transcript is whole (``_hear_rest``),
        #: then is cancelled.
        self._unheard: dict[str, Run] = {}
        #: The last answer in the conversation that ended: a reconnect from inside it replays the rest.
        self._last: Run | None = None
        #: That answer, restored by a reconnect whose last event is in it (``opened`` follows it).
        self._replayed: Run | None = None
        self._telling = asyncio.Lock()
        self._held: deque[dict[str, Any]] = deque()
        self._held_chars = 0
        self._detector: SpeechDetector | None = None
        self._padding = bytearray()
        #: The odd last byte of an append, joined to the next: the buffer is a byte stream, and
        #: a client may cut it anywhere (a file read in odd-sized blocks).
        self._half_sample = b""
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle: asyncio.Task[None] | None = None
        #: Audio received on this connection (pcm16 bytes), and where the last answer ended (ms).
        self._audio_in_bytes = 0
        self._answered_at_ms = 0
        #: The last frame event of the open turn that was sent (see resume.py).
        self._position: Position | None = None
        self._position_frame: str | None = None
        self.id = ev.new_id("sess")
        #: In every event id (resume.py): made once, not per event (a frame event per token).
        self._tag = connection_tag(self.id)
        self._saved = ""
        self._resume_at: EventPlace | None = None
        #: The conversation's runs so far: the latest one's index (a transcription session's stay 0).
        self._runs = 0
        #: Request events sent, counted; the latest kept for a reconnect; those a reconnect sends again.
        self._told = 0
        self._outbox: deque[Told] = deque(maxlen=OUTBOX_EVENTS)
        self._outbox_json: str | None = None
        self._pending: list[Told] = []

    # --- state kept in Redis, for a reconnect ---------------------------------

    def _state(self) -> str:
        return json.dumps({
            "identity": self._identity, "config": self.config.saved(), "items": self.conversation.items,
            "version": self._version, "turn": self._turn.saved() if self._turn else None,
            "hearing": [run.saved() for run in self._hearing.values()],
            "last": self._last.saved() if self._last is not None and self._last is not self._turn else None,
            "told": self._told, "runs": self._runs, "run_index": {
                run.session_id: run.index for run in (self._turn, self._last, *self._hearing.values())
                if run is not None}})[:-1] + f', "outbox": {self._outbox_text()}}}'

    def _outbox_text(self) -> str:
        """The kept request events as JSON, made again only when one is added (the state is
        written after each client event: an audio append must not dump them each time)."""
        if self._outbox_json is None:
            self._outbox_json = json.dumps(list(self._outbox))
        return self._outbox_json

    async def _save(self, *, strict: bool = False) -> None:
        """Write the state if it changed; ``strict``: a failure is the caller's (intent first)."""
        state = self._state()
        if state == self._saved:
            return
        try:
            await self._store.save_conversation(self.id, state, self._settings.session_timeout_sec)
            self._saved = state
        except errors.StoreUnavailable:
            if strict:
                raise
            logger.warning("realtime %s: could not save its state (a reconnect would miss the latest)", self.id)

    async def restore(self, conversation_id: str, last_event_id: str | None) -> None:
        """Take over a connection that broke off: its state, and its open turn after ``last_event_id``."""
        place = event_place(last_event_id)
        if last_event_id and place is None:  # (the sessions API's Last-Event-ID too)
            raise errors.InvalidRequest(f"last_event_id {last_event_id[:64]!r} is not the id of an event this "
                                        "server sent: send the event_id of the last event received",
                                        param="last_event_id")
        if place is not None and place.tag is not None and place.tag != connection_tag(conversation_id):
            raise errors.InvalidRequest(f"last_event_id {str(last_event_id)[:64]!r} is an event of another "
                                        "session: send the event_id of the last event this one sent",
                                        param="last_event_id")
        raw = await self._store.load_conversation(conversation_id)
        state = json.loads(raw) if raw else None
        if state is None or (state["identity"] != self._identity and self._identity_checked):
            raise errors.SessionNotFound(f"no realtime session {conversation_id!r} to resume", param="session_id")
        self.id, self._tag = conversation_id, connection_tag(conversation_id)
        self._told, self._runs = state.get("told", 0), state.get("runs", 0)
        self._outbox.extend((n, run, ((at[0][0], at[0][1]), at[1]), event)
                            for n, run, at, event in state.get("outbox") or ())
        self._outbox_json = None
        if place is not None:
            # What the client missed of the request events: those after its last event (by number, or
            # after the frame event it names: at its place too), each sent again after the frame event
            # it followed.
            self._pending = [told for told in self._outbox if (
                told[0] > place.number if place.number is not None else not place.reached(told[1], told[2])
                or (told[1], told[2]) == (place.run, place.position))]
        indices = state.get("run_index") or {}
        self.config = RealtimeConfig.restored(state["config"], self.config.can_transcribe,
                                              self.config.can_change_speed)
        self.conversation = Conversation(state["items"])
        self._version = state["version"]
        saved = state["turn"]
        if saved is not None:
            self._turn = await self._restored_run(saved)
        for kept in state.get("hearing") or ():
            run = await self._restored_hearing(kept)
            self._hearing[str(run.audio_item_id)] = run
        turn = self._turn
        if turn is not None and self.config.transcribing and turn.committed:
            # Committed, but the connection broke before its state said it was being heard out.
            self._turn = None
            self._hearing[str(turn.audio_item_id)] = turn
            with contextlib.suppress(errors.GatewayError):  # (its input may not have been ended yet)
                await self._service.finish(self._identity, turn.session_id, None)
        if state.get("last") is not None and place is not None:
            # The client's last event may be inside the answer that ended last (its end was in
            # flight when the socket broke): what came after it is replayed, the rest muted.
            self._replayed = self._last = await self._restored_run(state["last"], finished=True)
        for restored in (self._turn, self._replayed, *self._hearing.values()):
            if restored is not None:
                restored.index = indices.get(restored.session_id, 0)
        if saved is not None or self._hearing or self._replayed is not None:
            self._resume_at = place or EventPlace(0, START)  # its reader starts after session.created
        self._saved = self._state()

    async def _restored_run(self, saved: dict[str, Any], *, finished: bool = False) -> Run | None:
        """The open turn as saved, its cursor read from its session (which a crash cannot leave
        behind); ``finished``: the last answer. A failed or expired one is read again too: its
        session's error frame ends it (``response.done`` failed), which the client would
        otherwise wait for forever. A cancelled one is not: its end was the connection's own
        event (sent again from the outbox), and the frames would end it a second time."""
        try:
            record = await self._service.view(self._identity, saved["session_id"])
        except errors.GatewayError:
            return None
        if record.state is SessionState.CANCELLED or (finished and record.state not in (
                SessionState.COMPLETED, SessionState.FAILED, SessionState.EXPIRED)):
            return None
        answer = saved.pop("answer")
        run = Run(**{**saved, "basis": tuple(saved["basis"])}, next_seq=record.next_seq)
        if self.config.transcribing:  # no answer: the transcript ends it
            run.committed = run.committed or record.state in (SessionState.GENERATING, SessionState.COMPLETED)
            return run
        if answer is None and record.state in (SessionState.GENERATING, SessionState.COMPLETED):
            # Finished, but the answer's id never reached the state: it is this turn's answer all the same.
            answer = {"response_id": ev.new_id("resp"), "modalities": self.config.output_modalities,
                      "in_conversation": True, "metadata": None}
        if answer is not None:
            run.answer = Answer(self._emit, answer["modalities"], answer["response_id"],
                                self.conversation if answer["in_conversation"] else None, answer["metadata"])
        return run

    async def _restored_hearing(self, saved: dict[str, Any]) -> Run:
        """A run being heard out, as saved: read again, even failed or gone (its reader tells the
        item's ``...transcription.failed``); one whose input a crash left open is finished now."""
        saved = {k: v for k, v in saved.items() if k != "answer"}
        run = Run(**{**saved, "basis": tuple(saved["basis"])})
        with contextlib.suppress(errors.GatewayError):
            record = await self._service.view(self._identity, run.session_id)
            if record.state in (SessionState.OPEN, SessionState.STREAMING):
                await self._service.finish(self._identity, run.session_id, None)
        return run

    @property
    def _identity_checked(self) -> bool:
        # Open mode has no identities to compare (the id is the secret), as for sessions.
        return not self._identity.startswith("client:")

    async def _emit(self, event: dict[str, Any]) -> None:
        """Send an event with an id that marks its position (``resume.py``)."""
        origin = _FRAME.get()
        tag = self._tag
        if origin is None:
            number, self._told = self._told, self._told + 1
            event["event_id"] = request_event_id(self._position, self._position_frame, self._runs, number, tag)
            # (json, not orjson: an item's fields may hold an integer past 64 bits, a lone surrogate;
            # session.created is each connection's own: a reconnect gets its own)
            if event["type"] != "session.created" and len(json.dumps(event)) <= OUTBOX_EVENT_CHARS:
                self._outbox.append((number, self._runs, self._position or START, event))
                self._outbox_json = None
            await self._send_raw(event)
            return
        index, origin.count = origin.count, origin.count + 1
        event["event_id"] = frame_event_id(origin.frame_id, index, origin.run, tag)
        position = (event_id_key(origin.frame_id), index)
        # A transcription session reads several runs at once: its position only rises.
        if origin.tracked and not (self.config.transcribing and self._position is not None
                                   and position <= self._position):
            self._position, self._position_frame = position, origin.frame_id
        if origin.muted_through is not None and origin.muted_through.reached(origin.run, position):
            return
        if not self._pending:  # (the usual case: only after a reconnect is anything missed)
            await self._send_raw(event)
            return
        at = EventPlace(origin.run, position)
        await self._send_missed(at, before=True)
        await self._send_raw(event)
        await self._send_missed(at)

    async def _send_missed(self, through: EventPlace, *, before: bool = False) -> None:
        """After a reconnect: the request events the client missed that followed frame events up to
        ``through`` (``before``: up to the one before it, about to be sent), as they were sent."""
        while self._pending:
            _, run, position, event = self._pending[0]
            if not through.reached(run, position) or (before and (run, position) == (through.run, through.position)):
                return
            del self._pending[0]
            await self._send_raw(event)

    # --- the client's events --------------------------------------------------

    async def opened(self) -> None:
        await self._emit(ev.event("session.created", session=self.config.session_object(self.id)))
        # The missed request events before any frame to replay; the rest follow their frame events
        # (all of them at once when there is nothing to replay, or at the client's next event).
        await self._send_missed(self._resume_at or EVERYTHING)
        for run in (self._replayed, self._turn, *self._hearing.values()):
            if run is not None and run.reader is None:  # restored: follow it again, muted up to where the client was
                self._follow(run, self._resume_at)
        await self._save()

    async def handle(self, message: dict[str, Any]) -> None:
        """One client event; a bad one gets an ``error`` event and the connection goes on."""
        async with self._lock:
            if self._pending:  # the client goes on: what it missed comes first
                await self._send_missed(EVERYTHING)
            kind = message.get("type")
            if isinstance(kind, str) and kind in USER_INPUT and self._holds(kind, message):
                await self._hold(message)
                return
            await self._dispatch(message)
            await self._save()

    async def _dispatch(self, message: dict[str, Any]) -> None:
        client_event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
        kind = message.get("type")
        handler = self._handlers.get(kind) if isinstance(kind, str) else None
        self._metrics.realtime_event("in", str(kind) if handler else "unknown")
        try:
            if handler is None:
                raise errors.InvalidRequest(f"unknown or missing event type {kind!r}", param="type")
            if self.config.transcribing and kind in ANSWERING:
                raise errors.InvalidRequest(f"a transcription session only hears its audio: {kind} is for "
                                            "realtime sessions", param="type")
            _valid_unicode(message)
            await handler(self, message)
        except errors.GatewayError as exc:
            await self._refused(exc, client_event_id)
        except WebSocketDisconnect:
            raise  # the client left while it was told something: the socket's loop ends
        except Exception:
            # A bug must not take the connection (and its open turn) down with it.
            logger.exception("realtime %s: handling %s failed", self.id, kind)
            await self._emit(ev.error(errors.GatewayError("the server failed to handle this event"), client_event_id))

    async def _refused(self, exc: errors.GatewayError, client_event_id: str | None = None) -> None:
        """An ``error`` event for what could not be done; the connection goes on."""
        if exc.code in ("session_expired", "session_not_found", "session_closed", "session_cancelled"):
            await self._drop_turn(cancel=False)  # its session is gone: the next input opens a new turn
        await self._emit(ev.error(exc, client_event_id))

    async def close(self) -> None:
        """The socket closed: stop reading. The open turn stays for a reconnect (its session's timeout)."""
        tasks = [t for t in (*self._tasks, self._idle) if t is not None]
        for run in (self._turn, self._replayed, *self._side.values(), *self._hearing.values(),
                    *self._unheard.values()):
            if run is not None and run.reader is not None:
                tasks.append(run.reader)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in self._unheard.values():  # answers cancelled already: their sessions stop here
            with contextlib.suppress(errors.GatewayError):
                await self._service.cancel(self._identity, run.session_id)

    # --- held input: the next turn's, while an answer runs ----------------------

    def _holds(self, kind: str, message: dict[str, Any]) -> bool:
        if kind == "conversation.item.create" and not self._is_user_item_at_end(message):
            return False
        if self._held:
            return True  # behind what waits already, in order
        if not (self._turn is not None and self._turn.answering):
            return False
        vad = self.config.server_vad
        # With barge-in the VAD hears the audio at once (speech cancels the answer).
        return not (kind == "input_audio_buffer.append" and vad is not None and vad.interrupt_response)

    def _is_user_item_at_end(self, message: dict[str, Any]) -> bool:
        item = message.get("item")
        previous = message.get("previous_item_id")
        return isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user" \
            and previous in (None, self.conversation.last_id())

    async def _hold(self, message: dict[str, Any]) -> None:
        size = len(str(message.get("audio") or "")) + 256
        if self._held_chars + size > MAX_HELD_CHARS:
            await self._emit(ev.error(errors.RequestTooLarge(
                "input during an answer waits for its end, up to about a minute of audio: this event is dropped"),
                message.get("event_id") if isinstance(message.get("event_id"), str) else None))
            return
        self._held.append(message)
        self._held_chars += size

    def _replay_held_soon(self) -> None:
        if self._held:
            self._spawn(self._replay_held(), "held input")

    async def _replay_held(self) -> None:
        async with self._lock:
            while self._held and not (self._turn is not None and self._turn.answering):
                message = self._held.popleft()
                self._held_chars -= len(str(message.get("audio") or "")) + 256
                await self._dispatch(message)
            await self._save()

    def _spawn(self, work: Awaitable[None], what: str) -> None:
        spawn(self._tasks, work, f"realtime {self.id}: {what}")

    # --- session.update and the audio buffer ------------------------------------

    async def _session_update(self, message: dict[str, Any]) -> None:
        session = message.get("session")
        if not isinstance(session, dict):
            raise errors.ValidationFailed("session.update needs a session object", param="session")
        if session.get("type", self.config.session_type) != self.config.session_type \
                and (self._turn is not None or self._hearing or self.conversation.items):
            raise errors.ValidationFailed("a session's type is chosen before its first input", param="session.type")
        updated = copy.deepcopy(self.config)  # applied whole or not at all, as OpenAI does
        updated.update(session)
        self.config = updated
        self._detector = None  # new turn detection settings apply from the next audio
        await self._emit(ev.event("session.updated", session=self.config.session_object(self.id)))

    async def _audio_append(self, message: dict[str, Any]) -> None:
        audio = message.get("audio")
        if not isinstance(audio, str):
            raise errors.ValidationFailed("input_audio_buffer.append needs audio (base64 pcm16)", param="audio")
        if len(audio) > self._settings.realtime_max_append_chars:
            raise errors.RequestTooLarge(
                f"an append carries at most {self._settings.realtime_max_append_ms} ms of audio "
                "(clients send 20-100 ms per event)", param="audio")
        try:
            pcm = b64decode_in_slices(audio) if len(audio) < OFF_LOOP_CHARS else \
                await asyncio.to_thread(b64decode_in_slices, audio)
        except (binascii.Error, ValueError) as exc:
            raise errors.InvalidPayload("audio is not valid base64", param="audio") from exc
        if self._half_sample or len(pcm) % 2:
            pcm = self._half_sample + pcm
            whole = len(pcm) // 2 * 2
            pcm, self._half_sample = pcm[:whole], pcm[whole:]
        # A long stretch of audio in one event is taken a second at a time, as if the client
        # had sent it so: the event loop gets a turn between pieces (minutes of audio in one
        # event held it for over 0.1 s).
        for start in range(0, len(pcm), AUDIO_PIECE_BYTES):
            if start:
                await asyncio.sleep(0)
            await self._audio_piece(pcm[start:start + AUDIO_PIECE_BYTES])

    async def _audio_piece(self, pcm: bytes) -> None:
        heard_before_ms = self._audio_in_bytes // BYTES_PER_MS
        self._audio_in_bytes += len(pcm)
        vad = self.config.server_vad
        if vad is None:
            self._disarm_idle()
            await self._append_audio(pcm)
            return
        if self._detector is None:
            self._detector = SpeechDetector(RATE, vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms,
                                            origin_ms=heard_before_ms)
        detector = self._detector
        # Each change takes effect where it was heard, so a piece that holds the end of one utterance
        # and the start of the next (a recording sent faster than it plays) puts each in its own item.
        done = 0
        for change in detector.feed(pcm):
            # The detector has heard the whole piece: a change that fails (an answer refused by the
            # rate limit) is told, and the changes after it and their audio still take effect.
            try:
                await self._vad_audio(pcm[done:change.cut], detector, speaking=change.kind == "speech_stopped")
                done = max(done, change.cut)
                if change.kind == "speech_started":
                    self._disarm_idle()
                    await self._speech_started(change.at_ms, vad.interrupt_response)
                else:
                    await self._speech_stopped(change.at_ms, vad)
            except errors.GatewayError as exc:
                done = max(done, change.cut)
                await self._refused(exc)
        await self._vad_audio(pcm[done:], detector, speaking=detector.speaking)

    async def _vad_audio(self, pcm: bytes, detector: SpeechDetector, speaking: bool) -> None:
        """Audio heard by server VAD: the open utterance's, or padding kept for the next one."""
        if speaking:
            self._disarm_idle()
            await self._append_audio(pcm)
        else:
            self._keep_padding(pcm, detector.padding_ms)

    async def _speech_stopped(self, at_ms: int, vad: ServerVad) -> None:
        await self._emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=at_ms,
                                  item_id=self._turn.audio_item_id if self._turn else ""))
        committed = await self._commit()
        if self.config.transcribing:
            await self._hear_out(committed)
        elif vad.create_response:
            await self._respond(self._params({}))
        elif self.config.can_transcribe:
            # The client answers when it chooses, often after reading the transcript: heard now.
            await self._set_aside(committed)

    async def _audio_commit(self, _: dict[str, Any]) -> None:
        self._half_sample = b""  # half a sample at the buffer's end: nothing to hear
        committed = await self._commit()
        # Under server VAD, speech still going on after the client's commit is a new utterance,
        # told (speech_started names its item) and padded as one, as after a clear.
        self._detector = None
        if self.config.transcribing:
            await self._hear_out(committed)

    async def _audio_clear(self, _: dict[str, Any]) -> None:
        """Drop the audio since the last commit; the turn's text items stay in the conversation."""
        turn = self._turn
        clearing = turn is not None and turn.audio_item_id is not None and not turn.committed
        if clearing and turn is not None and turn.committed_chunks:
            raise errors.InvalidRequest("the engine hears the audio itself, in one session with the utterance "
                                        "committed before: the audio since cannot be taken back (commit it)",
                                        param="type")
        self._padding.clear()
        self._half_sample = b""
        # Speech still going on after a clear starts a new utterance, told and padded as one (the
        # detector's state went with the audio: the rest went to an item no speech_started named).
        self._detector = None
        if clearing:
            await self._drop_turn()
        await self._emit(ev.event("input_audio_buffer.cleared"))

    # --- conversation items -------------------------------------------------------

    async def _item_create(self, message: dict[str, Any]) -> None:
        item = message.get("item")
        previous = message.get("previous_item_id")
        if not isinstance(item, dict):
            raise errors.ValidationFailed("conversation.item.create needs an item", param="item")
        if previous is not None and not isinstance(previous, str):
            raise errors.ValidationFailed("previous_item_id is an item id or root", param="previous_item_id")
        if self._is_user_item_at_end(message) and not (self._turn is not None and self._turn.answering):
            await self._user_item(item)
            return
        stored = _item_for_conversation(item)
        if any(part.get("type") == "input_audio" for part in stored.get("content") or ()):
            raise errors.ValidationFailed("a user's audio item is taken at the end of the conversation only "
                                          "(its words are heard in its own turn)", param="previous_item_id")
        if previous not in (None, ROOT) and self.conversation.index(previous) is None:
            raise errors.ItemNotFound(f"no item {previous!r} to place this item after", param="previous_item_id")
        await self._history_changed()
        before = self.conversation.add(stored, previous)
        await self._tell_item(stored, before)

    async def _user_item(self, item: dict[str, Any]) -> None:
        """A user message at the end: the open turn's input (it opens one)."""
        stored = _item_for_conversation(item)
        chunks: list[ChunkIn] = []
        for part in item["content"]:
            if part["type"] == "input_text":
                chunks.append(ChunkIn(sequence_id=0, text=part["text"]))
            else:
                chunks.append(ChunkIn(sequence_id=0, modality="audio", payload=part["audio"], format="pcm16",
                                      sample_rate=RATE))
        turn = await self._streaming_turn()
        for chunk in chunks:
            await self._append(turn, chunk)
        if any(c.modality == "audio" for c in chunks) and turn.audio_item_id is None:
            turn.audio_item_id, turn.committed = stored["id"], True  # an item, not the input buffer
        turn.item_ids.append(stored["id"])
        before = self.conversation.add(stored)
        await self._tell_item(stored, before)

    async def _tell_item(self, item: dict[str, Any], previous: str | None) -> None:
        shown = public(item)
        await self._emit(ev.event("conversation.item.added", previous_item_id=previous, item=shown))
        await self._emit(ev.event("conversation.item.done", previous_item_id=previous, item=shown))

    async def _item_delete(self, message: dict[str, Any]) -> None:
        item_id = _item_id(message)
        self.conversation.get(item_id, errors.ItemDeleteNotFound)
        turn = self._turn
        if turn is not None and not turn.answering and item_id in turn.item_ids:
            await self._drop_turn()  # its input is gone
        await self._history_changed()
        self.conversation.delete(item_id)
        await self._emit(ev.event("conversation.item.deleted", item_id=item_id))

    async def _item_retrieve(self, message: dict[str, Any]) -> None:
        item = self.conversation.get(_item_id(message))
        await self._emit(ev.event("conversation.item.retrieved", item=public(item)))

    async def _item_truncate(self, message: dict[str, Any]) -> None:
        """What the user heard of an answer: the rest of its audio and words leave the history."""
        item_id = _item_id(message)
        content_index, audio_end_ms = message.get("content_index", 0), message.get("audio_end_ms")
        if not isinstance(content_index, int) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise errors.ValidationFailed("truncate takes content_index and audio_end_ms (integers >= 0)",
                                          param="audio_end_ms")
        self.conversation.get(item_id, errors.ItemTruncateNotFound)
        turn = self._turn
        if turn is not None and turn.answering and turn.answer is not None and turn.answer.message_id == item_id:
            await self._cancel_answer(turn, "client_cancelled")  # no more of it will be heard
        await self._history_changed()
        end = self.conversation.truncate(item_id, content_index, audio_end_ms)
        await self._emit(ev.event("conversation.item.truncated", item_id=item_id, content_index=content_index,
                                  audio_end_ms=end))

    async def _history_changed(self) -> None:
        """An edit of the history: an unanswered text-only turn is made again from the items."""
        self._version += 1
        turn = self._turn
        if turn is not None and turn.streaming and turn.answer is None and not turn.holds_audio:
            await self._drop_turn()

    # --- responses -------------------------------------------------------------------

    async def _response_create(self, message: dict[str, Any]) -> None:
        body = message.get("response") or {}
        if not isinstance(body, dict):
            raise errors.ValidationFailed("response is an object", param="response")
        check_response_fields(body, self.config.output_audio_format)
        conversation = body.get("conversation") or "auto"
        if conversation not in ("auto", "none"):
            raise errors.ValidationFailed('conversation is "auto" or "none"', param="response.conversation")
        params = self._params(body)
        given = body.get("input")  # null: not given
        items = None if given is None else self._input_items(given)
        if conversation == "none":
            await self._answer_from_items(items if items is not None else list(self.conversation.items), params,
                                          in_conversation=False)
            return
        if self._turn is not None and self._turn.answering:
            raise errors.ActiveResponse("the conversation already has an active response; wait for "
                                        "response.done or cancel it")
        if items is not None:
            await self._answer_from_items(items, params, in_conversation=True)
            return
        await self._respond(params)

    async def _response_cancel(self, message: dict[str, Any]) -> None:
        wanted = message.get("response_id")
        side = self._side.get(wanted) if isinstance(wanted, str) else None
        if side is not None:
            await self._cancel_answer(side, "client_cancelled")
            return
        turn = self._turn
        if turn is None or not turn.answering:
            raise errors.NoActiveResponse("there is no response in progress to cancel")
        if wanted and turn.answer and turn.answer.response_id != wanted:
            raise errors.NoActiveResponse(f"response {wanted!r} is not in progress (the one in progress is "
                                          f"{turn.answer.response_id!r})", param="response_id")
        await self._cancel_answer(turn, "client_cancelled")

    _handlers: dict[str, Callable[[RealtimeConnection, dict[str, Any]], Awaitable[None]]] = {
        "session.update": _session_update,
        "input_audio_buffer.append": _audio_append,
        "input_audio_buffer.commit": _audio_commit,
        "input_audio_buffer.clear": _audio_clear,
        "conversation.item.create": _item_create,
        "conversation.item.delete": _item_delete,
        "conversation.item.retrieve": _item_retrieve,
        "conversation.item.truncate": _item_truncate,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }

    def _params(self, body: dict[str, Any]) -> Params:
        """The session's settings with a response's own on top (a null field is one not given)."""
        body = {k: v for k, v in body.items() if v is not None}
        c = self.config
        instructions = body.get("instructions", c.instructions)
        if not isinstance(instructions, str):
            raise errors.ValidationFailed("instructions is a string", param="response.instructions")
        modalities = body.get("output_modalities", c.output_modalities)
        if modalities not in (["text"], ["audio"]) or (modalities == ["audio"] and not c.can_speak):
            raise errors.ValidationFailed('output_modalities is ["text"] or ["audio"] (audio if the engine speaks)',
                                          param="response.output_modalities")
        limit = output_token_limit(body["max_output_tokens"], "response.max_output_tokens") \
            if "max_output_tokens" in body else c.max_output_tokens
        tools = chat_tools(body["tools"], "response.tools") if "tools" in body else c.tools
        choice = chat_tool_choice(body["tool_choice"], "response.tool_choice") if "tool_choice" in body \
            else c.tool_choice
        if choice not in ("auto", "none") and not tool_choice_fits(choice, tools):
            raise errors.ValidationFailed(choice_without_tool(choice), param="response.tool_choice")
        parallel = parallel_tool_calls(body["parallel_tool_calls"], "response.parallel_tool_calls") \
            if "parallel_tool_calls" in body else c.parallel_tool_calls
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise errors.ValidationFailed("metadata maps strings to strings", param="response.metadata")
        return Params(instructions, tuple(modalities), limit, c.temperature,
                      tuple(json.dumps(t, sort_keys=True) for t in tools),
                      choice if isinstance(choice, str) else json.dumps(choice, sort_keys=True),
                      parallel is not False, tuple(sorted(metadata.items())), c.speed)

    def _basis(self, params: Params) -> tuple[Any, ...]:
        """What makes two answers' sessions alike (metadata is the response's own)."""
        return (params.instructions, params.modalities, params.max_output_tokens, params.temperature,
                params.tools, params.tool_choice, params.parallel_tool_calls, params.speed, self._version)

    def _input_items(self, given: Any) -> list[dict[str, Any]]:
        """``response.input``: items, or references to the conversation's."""
        if not isinstance(given, list):
            raise errors.ValidationFailed("input is a list of items", param="response.input")
        items = []
        for i, entry in enumerate(given):
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                try:
                    items.append(self.conversation.get(str(entry.get("id"))))
                except errors.ItemNotFound as exc:
                    exc.param = f"response.input.{i}.id"
                    raise
            elif isinstance(entry, dict):
                items.append(_item_for_conversation(entry, where=f"response.input.{i}"))
            else:
                raise errors.ValidationFailed("input is a list of items", param=f"response.input.{i}")
        return items

    async def _respond(self, params: Params) -> None:
        """An answer in the conversation: the open turn's, when it was made as this one would be."""
        turn = self._turn
        if turn is not None and turn.next_seq > 0 and (turn.basis == self._basis(params) or turn.holds_audio):
            await self._finish_turn(turn, params)
            return
        if turn is not None:
            await self._drop_turn()  # made otherwise: answered from its items instead
        await self._answer_from_items(list(self.conversation.items), params, in_conversation=True)

    async def _finish_turn(self, turn: Run, params: Params) -> None:
        await self._charge_turn()
        if turn.audio_item_id is not None and not turn.committed:
            await self._commit()  # the audio so far is this turn's input
        turn.answer = Answer(self._emit, list(params.modalities), ev.new_id("resp"), self.conversation,
                             dict(params.metadata) or None, params.max_output_tokens)
        await self._save(strict=True)  # intent first: a reconnect finds the answer before it exists
        await turn.answer.begin()
        try:
            await self._service.finish(self._identity, turn.session_id, None)
        except errors.GatewayError as exc:
            await self._end_run(turn, "failed", None, {"type": exc.type, "code": exc.code, "message": exc.message})
            raise

    async def _answer_from_items(self, items: list[dict[str, Any]], params: Params, *, in_conversation: bool,
                                 cue: str | None = None) -> Run:
        """A session whose input is the last item (or ``cue``, a system note), complete at once.

        The history is trimmed to fit when it is the conversation's own (not a response's ``input``).
        """
        await self._hear_out_cut_off()  # (the items are the conversation's own dicts: their words join them)
        whole = in_conversation and items == self.conversation.items
        if cue is not None:
            items = [*items, {"id": "", "type": "message", "role": "system",
                              "content": [{"type": "input_text", "text": cue}]}]
        if not items:
            # Nothing said yet (the assistant speaks first): the instructions are the input, as a
            # conversation of the system message alone (an empty one without instructions).
            items = [{"id": "", "type": "message", "role": "system",
                      "content": [{"type": "input_text", "text": params.instructions or " "}]}]
            params = replace(params, instructions="")
        *history, last = items
        role, text, call_id = _input_of(last)
        request = await self._session_request(history, params, trim=whole, streaming=False)
        request.input_role, request.input_tool_call_id = role, call_id
        await self._charge_turn()
        first = record_from_json(ChunkIn(sequence_id=0, text=text, end_of_input=True),
                                 self._settings.max_chunk_bytes)
        record, _ = await self._service.create(self._identity, request, first)
        run = Run(record.session_id, streaming=False, in_conversation=in_conversation,
                  basis=self._basis(params), next_seq=1)
        run.answer = Answer(self._emit, list(params.modalities), ev.new_id("resp"),
                            self.conversation if in_conversation else None, dict(params.metadata) or None,
                            params.max_output_tokens)
        if in_conversation:
            self._turn = run
            self._next_run(run)
        else:  # placed in the conversation's latest run (its frames are compared as time runs)
            run.index = self._runs
            self._side[run.answer.response_id] = run
        await run.answer.begin()
        self._follow(run, None)
        return run

    async def _session_request(self, history_items: list[dict[str, Any]], params: Params, *, trim: bool,
                               streaming: bool) -> CreateSessionRequest:
        messages = await self._history(history_items, params, trim=trim)
        tools = params.tools_list()
        spoken = "audio" in params.modalities
        return CreateSessionRequest(
            messages=messages, modalities=["text", "audio"] if spoken else ["text"],
            speed=params.speed if spoken and params.speed != 1 else None,
            max_tokens=params.max_output_tokens, temperature=params.temperature,
            stream_options=StreamOptions(include_usage=True),
            start_policy=None if streaming else StartPolicy.ON_END_ONLY,
            tools=tools or None, tool_choice=params.choice() if tools else None,
            parallel_tool_calls=None if params.parallel_tool_calls else False)

    async def _history(self, items: list[dict[str, Any]], params: Params, *, trim: bool) -> list[ChatMessage]:
        """The instructions and the items' history; with ``trim`` (the items are the conversation's
        oldest), its oldest items are dropped when the history outgrows its budget."""
        system = [ChatMessage(role="system", content=params.instructions)] if params.instructions else []
        messages = system + self.conversation.messages(items)
        limit = self._service.max_input_tokens
        if not trim or self.config.truncation == "disabled" or limit is None:
            return messages
        budget = self.config.history_budget(limit, params.max_output_tokens)
        tools = params.tools_list()
        if await self._service.prompt_tokens(messages, tools) <= budget:
            return messages
        # Drop down to retention_ratio of the budget at once: the history's start
        # then stays put, and in the engine's prefix cache, for many turns.
        keep_under = int(budget * self.config.retention_ratio)
        low, high = 1, len(items)
        while low < high:  # the fewest oldest items to drop
            middle = (low + high) // 2
            kept = system + self.conversation.messages(without_oldest(items, middle))
            if await self._service.prompt_tokens(kept, tools) <= keep_under:
                high = middle
            else:
                low = middle + 1
        kept_items = without_oldest(items, low)
        self.conversation.keep_only(kept_items, items)
        logger.info("realtime %s: dropped the %d oldest items to fit the context", self.id, len(items) - len(kept_items))
        return system + self.conversation.messages(kept_items)

    async def _charge_turn(self) -> None:
        """A response takes one request of the identity's rate; the input before it (its audio
        frames) takes none, so a refusal is one ``error`` for the response, and the turn stays."""
        if self._settings.rate_limit_rps > 0:
            await self._store.take_token(self._identity, self._settings.rate_limit_rps, self._settings.token_burst)

    # --- turns ------------------------------------------------------------------------

    async def _streaming_turn(self) -> Run:
        turn = self._turn
        if turn is not None and turn.streaming and turn.answer is None:
            if not turn.committed:
                return turn
            if not self.config.can_transcribe:
                # Its words are the engine's only (it hears audio itself): the next utterance is an
                # item of its own in the same session, answered with it.
                turn.committed, turn.audio_item_id = False, None
                turn.committed_ms, turn.committed_chunks = turn.audio_ms, turn.next_seq
                return turn
            await self._set_aside(turn)
        elif turn is not None and turn.answering:
            raise errors.ActiveResponse("a response is in progress; wait for response.done or cancel it")
        params = self._params({})
        await self._hear_out_cut_off()
        request = CreateSessionRequest(modalities=[]) if self.config.transcribing else \
            await self._session_request(list(self.conversation.items), params, trim=True, streaming=True)
        record, _ = await self._service.create(self._identity, request, None)
        turn = Run(record.session_id, streaming=True, basis=self._basis(params))
        self._turn = turn
        if not self.config.transcribing:  # (runs being heard out are still read: their place stays)
            self._next_run(turn)
        self._follow(turn, None)
        return turn

    def _next_run(self, run: Run) -> None:
        """``run`` is the conversation's next: its events' places count from its start."""
        self._runs += 1
        run.index = self._runs
        self._position = self._position_frame = None

    async def _append(self, turn: Run, chunk: ChunkIn) -> None:
        record = record_from_json(chunk.model_copy(update={"sequence_id": turn.next_seq}),
                                  self._settings.max_chunk_bytes)
        try:
            await self._service.append(self._identity, turn.session_id, record)
        except errors.ContextLengthExceeded as exc:
            exc.param = "audio" if chunk.modality == "audio" else "item"  # the event's, not the sessions API's
            raise
        except errors.SequenceConflict:
            # Our count is behind the session's (a reconnect's state was older): the session knows.
            turn.next_seq = (await self._service.view(self._identity, turn.session_id)).next_seq
            record = record_from_json(chunk.model_copy(update={"sequence_id": turn.next_seq}),
                                      self._settings.max_chunk_bytes)
            await self._service.append(self._identity, turn.session_id, record)
        turn.next_seq += 1
        turn.audio_ms += record.audio_ms

    async def _append_audio(self, pcm: bytes) -> None:
        if not pcm:
            return
        turn = await self._streaming_turn()
        await self._append(turn, ChunkIn(sequence_id=0, modality="audio", payload=base64.b64encode(pcm).decode(),
                                         format="pcm16", sample_rate=RATE))
        if turn.audio_item_id is None:
            turn.audio_item_id = ev.new_id("item")

    def _keep_padding(self, pcm: bytes, padding_ms: int) -> None:
        self._padding += pcm
        keep = RATE * 2 * padding_ms // 1000
        del self._padding[:max(0, len(self._padding) - keep)]

    async def _speech_started(self, at_ms: int, interrupt: bool) -> None:
        turn = self._turn
        padding, self._padding = bytes(self._padding), bytearray()
        if turn is not None and turn.streaming and turn.answer is None and not turn.committed:  # it goes on
            if turn.audio_item_id is None:
                turn.audio_item_id = ev.new_id("item")
            await self._emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=at_ms,
                                      item_id=turn.audio_item_id))
            await self._append_audio(padding)
            return
        # A new turn: told first, as OpenAI does, and before the turn opens (which may wait for a
        # cancelled turn's words): a client stops playing the answer at this event.
        item_id = ev.new_id("item")
        await self._emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=at_ms, item_id=item_id))
        if interrupt and turn is not None and turn.answering:
            await self._cancel_answer(turn, "turn_detected")  # barge-in
        turn = await self._streaming_turn()
        turn.audio_item_id = item_id
        await self._append_audio(padding)

    async def _commit(self) -> Run:
        """The input buffer's audio becomes its item; the turn it is in."""
        turn = self._turn
        if turn is None or turn.audio_item_id is None or turn.committed or turn.answer is not None:
            raise errors.EmptyAudioBuffer("the input audio buffer is empty", param="audio")
        # As OpenAI: too little to hear (a few stray bytes); it stays. (Each chunk's ms are rounded
        # down: the chunks' count makes up for it.)
        buffered_ms = turn.audio_ms - turn.committed_ms
        if buffered_ms + turn.next_seq - turn.committed_chunks < MIN_COMMIT_MS:
            raise errors.EmptyAudioBuffer(f"the input audio buffer holds {buffered_ms} ms of audio; a commit "
                                          f"takes at least {MIN_COMMIT_MS} ms", param="audio")
        turn.committed = True
        item = ev.user_item(turn.audio_item_id, [{"type": "input_audio", "transcript": None}])
        turn.item_ids.append(item["id"])
        before = self.conversation.add(item)
        # Saved before the client is told: a replica killed right after the tell leaves the commit
        # for a reconnect (a transcription session's is heard out then), not an open turn.
        await self._save()
        await self._emit(ev.event("input_audio_buffer.committed", previous_item_id=before,
                                  item_id=turn.audio_item_id))
        await self._tell_item(item, before)
        return turn

    async def _hear_out(self, turn: Run) -> None:
        """A transcription session's committed turn: its input ends, and it is heard out while the
        next audio opens the next turn (its transcript ends it: ``_on_frame``). Like a response, it
        takes one request of the identity's rate."""
        if self._turn is turn:
            self._turn = None
        self._hearing[str(turn.audio_item_id)] = turn
        self.conversation.keep_last(TRANSCRIBED_ITEMS_KEPT)
        try:
            if turn.reader is None or turn.reader.done():  # its output could not be read (the log says why)
                raise errors.StoreUnavailable("the transcript could not be read; the audio is not heard")
            await self._charge_turn()
            await self._service.finish(self._identity, turn.session_id, None)
        except errors.GatewayError as exc:
            await self._hearing_failed(turn, exc.envelope()["error"])
            if turn.reader is not None:
                turn.reader.cancel()
            with contextlib.suppress(errors.GatewayError):
                await self._service.cancel(self._identity, turn.session_id)

    async def _hearing_failed(self, run: Run, error: dict[str, Any]) -> None:
        """A transcription session's turn that failed: said of its item, and the session goes on."""
        if self._hearing.get(str(run.audio_item_id)) is run:
            run.outcome = {"error": {k: error.get(k) for k in ("type", "code", "message", "param")}}
            await self._tell_heard_in_order()

    async def _tell_heard_in_order(self) -> None:
        """The ends of the runs being heard out, in the order they were committed: a short
        utterance is heard sooner than a long one before it, and a transcript is read in order."""
        # Told with no frame's position: a run held back behind an earlier one is told by whichever
        # reader frees it, so a position would depend on that, and a replay after a reconnect could
        # mute an end the client never got. What the saved state still lists was not told.
        origin = _FRAME.set(None)
        try:
            async with self._telling:
                while self._hearing:
                    key, run = next(iter(self._hearing.items()))
                    if run.outcome is None:
                        return
                    if "error" in run.outcome:
                        await self._emit(ev.event("conversation.item.input_audio_transcription.failed",
                                                  item_id=key, content_index=0, error=run.outcome["error"]))
                    else:
                        await self._tell_transcript(run)
                    del self._hearing[key]  # after its event: one that could not be sent is told again
                    await self._save()
        finally:
            _FRAME.reset(origin)

    async def _drop_turn(self, *, cancel: bool = True) -> None:
        """End the open turn without an answer: stop reading it and cancel its session."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        if turn.reader is not None:
            turn.reader.cancel()
            await asyncio.gather(turn.reader, return_exceptions=True)
        if cancel:
            with contextlib.suppress(errors.GatewayError):
                await self._service.cancel(self._identity, turn.session_id)

    async def _cancel_answer(self, run: Run, reason: str) -> None:
        # Its words still being heard, it is cancelled once they are (``_hear_rest``): marked before
        # the end is told, since its reader goes on meanwhile and must not drop those frames.
        unheard = run.audio_item_id is not None and not run.told_transcript and run.reader is not None \
            and not run.reader.done()
        if unheard:
            self._unheard[run.session_id] = run
        # Told first, so the reason is this one (the session's own cancel frame follows).
        await self._end_run(run, "cancelled", reason)
        if not unheard:
            with contextlib.suppress(errors.SessionClosed):  # it completed meanwhile
                await self._service.cancel(self._identity, run.session_id)

    async def _set_aside(self, turn: Run) -> None:
        """A committed turn left unanswered (server VAD's ``create_response: false``, or input after
        a commit): its audio is an item of its own, as at OpenAI, answered by a later response with
        what follows it. Its input ends so its words are heard out now (``_hear_rest``: its
        transcript, then its session is cancelled); the next answer's history holds them
        (``_hear_out_cut_off``)."""
        self._turn = None
        turn.set_aside = True
        self._unheard[turn.session_id] = turn
        await self._save()  # before its input ends: a reconnect after a crash must not answer it
        try:
            await self._service.finish(self._identity, turn.session_id, None)
        except errors.GatewayError:
            await self._give_up_hearing(turn)

    async def _hear_out_cut_off(self) -> None:
        """Before a new answer's history is made: the words of turns whose answers were cancelled
        before they were heard (the client was told of the cancels already), or that were set aside
        unanswered (``_set_aside``), ``UNHEARD_WAIT_SEC`` at
        most. What is not heard by then (its session waits for the engine) is given up: its item
        keeps the words heard so far, and its session is cancelled."""
        hearing = {r.reader for r in self._unheard.values() if r.reader is not None and not r.reader.done()}
        if hearing:
            await asyncio.wait(hearing, timeout=UNHEARD_WAIT_SEC)
        for run in list(self._unheard.values()):
            await self._give_up_hearing(run)

    async def _give_up_hearing(self, run: Run) -> None:
        if self._unheard.pop(run.session_id, None) is None:
            return
        if run.reader is not None and run.reader is not asyncio.current_task():
            run.reader.cancel()
        await self._tell_transcript(run)
        await self._save()  # its words are in its item: a reconnect's history has them
        with contextlib.suppress(errors.GatewayError):
            await self._service.cancel(self._identity, run.session_id)

    # --- idle timeout (server_vad idle_timeout_ms) ---------------------------------------

    def _arm_idle(self) -> None:
        vad = self.config.server_vad
        self._disarm_idle()
        if vad is not None and vad.idle_timeout_ms:
            self._idle = asyncio.create_task(self._idle_after(vad.idle_timeout_ms), name=f"realtime-{self.id}-idle")

    def _disarm_idle(self) -> None:
        if self._idle is not None and self._idle is not asyncio.current_task():
            self._idle.cancel()
        self._idle = None

    async def _idle_after(self, timeout_ms: int) -> None:
        await asyncio.sleep(timeout_ms / 1000)
        async with self._lock:
            if self._turn is not None and (self._turn.answering or self._turn.next_seq) \
                    or (self._detector is not None and self._detector.speaking):
                return
            self._idle = None
            item = ev.user_item(ev.new_id("item"), [{"type": "input_audio", "transcript": None}])
            await self._emit(ev.event("input_audio_buffer.timeout_triggered", audio_start_ms=self._answered_at_ms,
                                      audio_end_ms=self._audio_in_bytes // BYTES_PER_MS, item_id=item["id"]))
            # As OpenAI does: the silence is committed as the user's (empty) audio item, then answered.
            self._padding.clear()
            before = self.conversation.add(item)
            await self._emit(ev.event("input_audio_buffer.committed", previous_item_id=before, item_id=item["id"]))
            await self._tell_item(item, before)
            vad = self.config.server_vad
            if vad is not None and vad.create_response:
                try:
                    await self._answer_from_items(list(self.conversation.items), self._params({}),
                                                  in_conversation=True,
                                                  cue=f"The user has said nothing for {timeout_ms // 1000} seconds.")
                except errors.GatewayError as exc:
                    await self._emit(ev.error(exc))
            await self._save()

    # --- the session's output -----------------------------------------------------

    def _follow(self, run: Run, muted_through: EventPlace | None) -> None:
        run.reader = asyncio.create_task(self._read(run, muted_through), name=f"realtime-{run.session_id}")

    async def _read(self, run: Run, muted_through: EventPlace | None) -> None:
        """Read the run's session output from its start; a failure ends only this run."""
        try:
            stream = await self._service.events(self._identity, run.session_id, "0-0")
            if stream is None:  # only after the final frame, and this read starts at the first
                return
            async for frame in stream:
                # Only the latest run's frames place the request events (a replayed earlier one's do not).
                token = _FRAME.set(_FrameOrigin(str(frame.id), run.index, muted_through,
                                                tracked=run.in_conversation and run.index == self._runs))
                try:
                    await self._on_frame(run, frame)
                finally:
                    _FRAME.reset(token)
        except asyncio.CancelledError:
            raise
        except WebSocketDisconnect:  # the client left: the socket's loop closes the connection
            logger.info("realtime %s: the client left while session %s was told", self.id, run.session_id)
        except Exception:
            logger.exception("realtime %s: following session %s failed", self.id, run.session_id)
            if self._hearing.get(str(run.audio_item_id)) is run:
                await self._hearing_failed(run, {"type": "server_error", "code": "internal_error",
                                                 "message": "the transcript broke off"})
            if run.answer is not None:
                await self._end_run(run, "failed", None,
                                    {"type": "server_error", "code": "internal_error", "message": "the answer broke off"})

    async def _on_frame(self, run: Run, frame: ServerSentEvent) -> None:
        if run.set_aside or (run.answer is not None and run.answer.ended):
            if run.session_id in self._unheard:
                await self._hear_rest(run, frame)
            return  # cancelled: what the engine wrote before it stopped is not sent after response.done
        data = str(frame.data)
        if frame.event == "transcript":
            await self._heard(run, json.loads(data)["input_transcript"])
            return
        if frame.event == "error":
            body = json.loads(data)["error"]
            if run.audio_item_id in self._hearing:
                await self._hearing_failed(run, body)
                return
            await self._tell_not_heard(run, body)
            if run.answer is None:
                # The turn failed before its response (e.g. no speech recognized, or it expired).
                await self._emit(ev.error(errors.from_envelope({"error": body})))
                if self._turn is run:
                    self._turn = None
                return
            cancelled = body.get("code") == "session_cancelled"
            await self._end_run(run, "cancelled" if cancelled else "failed", "client_cancelled" if cancelled else None,
                                None if cancelled else {"type": body.get("type"), "code": body.get("code"),
                                                        "message": body.get("message")})
            return
        if data == "[DONE]" or run.answer is None:
            if run.answer is not None:
                await self._tell_transcript(run)
                await self._end_run(run, "completed")
            elif data == "[DONE]" and self._hearing.get(str(run.audio_item_id)) is run:
                run.outcome = {}
                await self._tell_heard_in_order()
            return
        chunk = orjson.loads(data)  # a frame per answer token; written by orjson too (output/frames.py)
        if chunk.get("usage"):
            run.answer.on_usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                await self._tell_transcript(run)
                await run.answer.on_text(delta["content"])
            if delta.get("audio"):
                await run.answer.on_audio(delta["audio"]["data"], delta["audio"].get("transcript") or "")
            for call in delta.get("tool_calls") or ():
                await self._tell_transcript(run)
                await run.answer.on_tool_call(call)
            if choice.get("finish_reason"):
                run.answer.on_finish(choice["finish_reason"])

    async def _hear_rest(self, run: Run, frame: ServerSentEvent) -> None:
        """A cancelled (or set aside) answer's spoken input, heard out: its transcript frames, up to the answer's
        first frame (the transcript is whole before it), then its item's transcript and the cancel."""
        data = str(frame.data)
        if frame.event == "transcript":
            await self._heard(run, json.loads(data)["input_transcript"])
            return
        if frame.event != "error" and data != "[DONE]" and not any(
                c.get("finish_reason") or set(c.get("delta") or {}) - {"role"}
                for c in orjson.loads(data).get("choices") or ()):
            return  # the answer's role frame
        if frame.event == "error" and self.config.transcription is not None and run.session_id in self._unheard:
            run.told_transcript = True
            await self._emit(ev.event("conversation.item.input_audio_transcription.failed", item_id=run.audio_item_id,
                                      content_index=0, error=json.loads(data)["error"]))
        await self._give_up_hearing(run)  # heard: nothing is given up but the answer

    async def _heard(self, run: Run, heard: str) -> None:
        """What the recognizer heard so far; told as it grows when transcription is on."""
        delta = heard[len(run.transcript):] if heard.startswith(run.transcript) else heard
        run.transcript = heard
        if delta and run.audio_item_id and self.config.transcription is not None:
            await self._emit(ev.event("conversation.item.input_audio_transcription.delta",
                                      item_id=run.audio_item_id, content_index=0, delta=delta))

    async def _tell_not_heard(self, run: Run, error: dict[str, Any]) -> None:
        """A turn that failed before its words were told (nothing recognized in its audio, the
        engine failed): its item's ``...transcription.failed``, so a client waiting for each
        item's transcript does not wait forever."""
        if run.told_transcript or run.audio_item_id is None or self.config.transcription is None \
                or self.conversation.index(run.audio_item_id) is None:
            return
        if run.transcript:  # heard, then the answer failed: the words are the item's all the same
            await self._tell_transcript(run)
            return
        run.told_transcript = True
        await self._emit(ev.event("conversation.item.input_audio_transcription.failed", item_id=run.audio_item_id,
                                  content_index=0, error={k: error.get(k) for k in ("type", "code", "message", "param")}))

    async def _tell_transcript(self, run: Run) -> None:
        """The spoken input's words join its item (the history); ``...transcription.completed`` once."""
        if run.told_transcript or run.audio_item_id is None:
            return
        run.told_transcript = True
        index = self.conversation.index(run.audio_item_id)
        if index is not None:
            item = self.conversation.items[index]
            item["_heard"] = run.transcript
            if self.config.transcription is not None:
                item["content"][0]["transcript"] = run.transcript
        if self.config.transcription is not None:
            await self._emit(ev.event("conversation.item.input_audio_transcription.completed",
                                      item_id=run.audio_item_id, content_index=0, transcript=run.transcript,
                                      usage={"type": "duration", "seconds": run.audio_ms / 1000}))

    async def _end_run(self, run: Run, status: str, reason: str | None = None,
                       error: dict[str, Any] | None = None) -> None:
        """The response is over: tell it; its items are already in the conversation."""
        assert run.answer is not None
        if run.answer.ended:
            return
        await run.answer.end(status, reason, error)
        await self._emit(ev.event("rate_limits.updated", rate_limits=[self._budget.rate_limit()]))
        if run.in_conversation:
            self._last = run
            if self._turn is run:
                self._turn = None
            self._answered_at_ms = self._audio_in_bytes // BYTES_PER_MS
            self._arm_idle()
        else:
            self._side.pop(run.answer.response_id, None)
        self._replay_held_soon()
        await self._save()


def _valid_unicode(message: dict[str, Any]) -> None:
    """An event's every text is valid Unicode, as a request's is (``StrictModel``): a lone surrogate
    (JSON's ``\\ud800``) in instructions or an item would fail every answer after it, once taken."""
    within = lone_surrogate_at(message)
    if within is not None:
        raise not_unicode(".".join(map(str, within)) or None)


def _item_id(message: dict[str, Any]) -> str:
    item_id = message.get("item_id")
    if not isinstance(item_id, str):
        raise errors.ValidationFailed("the event needs an item_id", param="item_id")
    return item_id


def _client_item_id(given: Any, param: str) -> str:
    """The id a client gives its item, checked as OpenAI checks it; one left out is made here."""
    if given is None:
        return ev.new_id("item")
    if not isinstance(given, str) or not given:
        raise errors.ValidationFailed("an item's id is a non-empty string (or left out: the server makes one)",
                                      param=param)
    if len(given) > MAX_ITEM_ID_CHARS:
        raise errors.StringAboveMaxLength(f"Invalid '{param}': string too long. Expected a string with maximum "
                                          f"length {MAX_ITEM_ID_CHARS}, but got a string with length "
                                          f"{len(given)} instead.", param=param)
    return given


#: The content parts a message item of each role may carry.
_PARTS = {"user": ("input_text", "input_audio"), "system": ("input_text",),
          "assistant": ("output_text", "text", "output_audio", "audio")}


def _item_for_conversation(item: dict[str, Any], where: str = "item") -> dict[str, Any]:
    """A client's item, checked, as the conversation keeps it (audio bytes left out)."""
    kind = item.get("type", "message")
    item_id = _client_item_id(item.get("id"), f"{where}.id")
    base = {"id": item_id, "object": "realtime.item", "status": "completed"}
    if kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
            raise errors.ValidationFailed("a function_call item has a name and arguments (a JSON string)",
                                          param=where)
        return {**base, "type": kind, "name": item["name"], "arguments": item.get("arguments", ""),
                "call_id": item.get("call_id") or ev.new_id("call")}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise errors.ValidationFailed("a function_call_output item has a call_id and an output (a string)",
                                          param=where)
        return {**base, "type": kind, "call_id": item["call_id"], "output": item["output"]}
    role = item.get("role")
    if kind == "message" and not (isinstance(role, str) and role in _PARTS):
        raise errors.ValidationFailed("a message's role is user, system or assistant", param=f"{where}.role")
    if kind != "message" or role not in _PARTS:
        raise errors.ValidationFailed("items are messages (user, system, assistant), function_call or "
                                      "function_call_output", param=f"{where}.type")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise errors.ValidationFailed("a message needs content", param=f"{where}.content")
    kept = []
    for i, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type not in _PARTS[role]:
            raise errors.ValidationFailed(f"a {role} message's parts are {', '.join(_PARTS[role])}",
                                          param=f"{where}.content.{i}")
        if part_type in ("input_audio", "audio", "output_audio"):
            if part_type == "input_audio" and not isinstance(part.get("audio"), str):
                raise errors.ValidationFailed("an input_audio part needs audio (base64 pcm16)",
                                              param=f"{where}.content.{i}.audio")
            shown_type = "input_audio" if role == "user" else "output_audio"
            kept.append({**{k: v for k, v in part.items() if k != "audio"}, "type": shown_type,
                         "transcript": part.get("transcript")})
        else:
            if not isinstance(part.get("text"), str):
                raise errors.ValidationFailed("a text part needs text", param=f"{where}.content.{i}.text")
            # The client's other fields stay, as sent (an item is echoed back as it came).
            kept.append({**part, "type": "output_text" if role == "assistant" else "input_text"})
    return {**base, "type": "message", "role": role, "content": kept}


def _input_of(item: dict[str, Any]) -> tuple[Literal["user", "tool", "system", "assistant"], str, str | None]:
    """(role, text, call id) of the item an answer from items responds to: whoever's it is, as
    vLLM renders a conversation (after an assistant's message, the assistant takes a new turn)."""
    if item["type"] == "function_call_output":
        return "tool", item["output"] or " ", item["call_id"]
    if item["type"] == "function_call":
        raise errors.EmptyInput("the conversation ends with a function call: add its function_call_output "
                                "item first", param="response.input")
    text = item_text(item)
    if not text:
        raise errors.EmptyInput("the last item says nothing (spoken input is answered in its own turn)",
                                param="response.input")
    return item["role"], text, None
