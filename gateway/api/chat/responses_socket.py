"""``/v1/responses`` over a WebSocket: OpenAI's Responses API WebSocket mode.

A client sends ``{"type": "response.create", ...}`` with the fields of ``POST /v1/responses``
(``stream`` is implicit; ``background`` is refused) and gets the events the streamed POST
sends, the same JSON, one text message each. A response runs as the POST's does
(``responses.py``: the same request model, translation, session, checks and events); this
module only carries them and keeps what OpenAI's connection keeps:

- Responses run one after another in the order they were asked, on each lane: a
  ``response.create`` while one runs on its lane waits for it (OpenAI's lanes are first
  in, first out, without overlap). A ``stream_id`` names a lane of its own, whose
  responses run beside the other lanes' (16 at once; 32 named lanes a connection), and
  whose events and errors carry its ``stream_id``; without one, the default lane's carry none.
- Each lane's last response is kept in memory, as OpenAI's connection-local cache keeps
  a lane's latest response: ``previous_response_id`` naming one (another lane's too: a
  fork) puts its input and output items before the new input, with ``store: false``
  too; any other id is OpenAI's ``previous_response_not_found``. A continuation that
  fails (an ``error`` event, or ``response.failed``) drops the response it named from its
  lane, as OpenAI evicts it (a fork's failure leaves the other lane's). Nothing outlives
  the connection; over HTTP ``previous_response_id`` stays refused.
- ``generate: false`` (a warmup) answers at once with a response that has no output and
  keeps its input, for the next response to continue from (``previous_response_id``).
- An event that cannot be taken (not JSON, an unknown type, a refused field) is an
  ``error`` event with OpenAI's shape (``status`` and ``error``: type, code, message,
  param) and the connection goes on.

Limits: the handshake authenticates as the HTTP route does (an API key in
``Authorization``; OpenAI documents no browser way for this socket) and is charged one
request of the identity's rate; each response is one more. Events share
Realtime's per-connection budget and size cap (``web/websocket.py``); a connection with
nothing to do for the session timeout is closed; after OpenAI's 60 minutes a
``response.create`` is ``websocket_connection_limit_reached``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from gateway import errors
from gateway.api.chat.responses import start_response
from gateway.api.chat.responses_models import InputItem, ResponsesRequest
from gateway.api.chat.responses_out import ResponseShape, response_events, warmup_events
from gateway.api.chat.router import chat_service
from gateway.web.resources import Resources, authenticate
from gateway.web.validation import validation_error
from gateway.web.websocket import (
    NORMAL,
    EventBudget,
    handshake,
    read_event,
    receive_frame,
    refuse,
    send_text,
)

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

#: OpenAI's connection lifetime: a ``response.create`` after it is refused (open another).
LIFETIME_SEC = 60 * 60
#: OpenAI's: named lanes (``stream_id``) a connection takes, the default lane aside; responses
#: running at once across the lanes (more wait for room).
MAX_LANES, MAX_RUNNING = 32, 16
#: ``response.create`` events a lane holds behind its running one.
MAX_WAITING = 16
_STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")
#: A response's last event; its ``response`` is the whole answer.
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket, model: str | None = None) -> None:
    """``model``: what a ``response.create`` that names none gets (gateways route on it: LiveKit
    puts it in the URL); a ``response.create`` names its own."""
    resources: Resources = websocket.state.resources
    _, headers = handshake(websocket)
    try:
        caller = await authenticate(resources, headers, websocket.client.host if websocket.client else None)
        resources.service.check_enabled()
    except errors.GatewayError as exc:
        await refuse(websocket, exc)
        return
    await websocket.accept()
    connection = ResponsesConnection(websocket, resources, caller.identity,
                                     model or resources.engine.capabilities.model_names[0])
    logger.info("responses socket: opened for %s", caller.identity)
    try:
        await connection.serve()
    finally:
        logger.info("responses socket: closed for %s", caller.identity)


def error_event(exc: errors.GatewayError, stream_id: str | None = None) -> dict[str, Any]:
    """OpenAI's WebSocket ``error`` event: the envelope's fields and the HTTP status (a request
    OpenAI's doors cannot take is a 400, as the HTTP route answers it); a named lane's names it."""
    body = exc.envelope()["error"]
    status = 400 if exc.status_code == 422 else int(exc.status_code)
    return {"type": "error", "status": status, **({"stream_id": stream_id} if stream_id is not None else {}),
            "error": {"type": body["type"], "code": body["code"], "message": body["message"],
                      "param": body.get("param")}}


@dataclass(frozen=True)
class Kept:
    """A lane's last response: its id, and what a continuation of it starts from."""

    response_id: str
    #: Its input (with what it continued) and its output, as input items.
    items: list[InputItem]


class Lane:
    """A ``stream_id``'s responses (``None``: the default lane's), first in, first out."""

    def __init__(self, stream_id: str | None) -> None:
        self.stream_id = stream_id
        self.waiting: asyncio.Queue[dict[str, Any]] = asyncio.Queue(MAX_WAITING)
        self.running = False
        self.kept: Kept | None = None

    @property
    def busy(self) -> bool:
        return self.running or not self.waiting.empty()

    def labelled(self, text: str) -> str:
        """An event's JSON with the lane's ``stream_id``, as OpenAI labels a named lane's events."""
        return text if self.stream_id is None else f'{{"stream_id":{orjson.dumps(self.stream_id).decode()},{text[1:]}'


class ResponsesConnection:
    """One socket: a reader of client events, and a runner per lane that answers its events in order."""

    def __init__(self, websocket: WebSocket, resources: Resources, identity: str, model: str) -> None:
        self._websocket = websocket
        self._resources = resources
        self._identity = identity
        self._model = model
        self._chat = chat_service(resources)
        self.lanes: dict[str | None, Lane] = {}
        self._runners: list[asyncio.Task[None]] = []
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room = asyncio.Semaphore(MAX_RUNNING)
        self._sending = asyncio.Lock()
        self._opened = time.monotonic()

    async def serve(self) -> None:
        """Until the client leaves (its running responses are cancelled) or stays idle."""
        reader = asyncio.create_task(self._read(), name="responses socket: client events")
        try:
            await asyncio.wait([reader, self._failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, *self._runners):
                task.cancel()
            await asyncio.gather(reader, *self._runners, return_exceptions=True)
        for failed in (reader, self._failed):
            failure = None if not failed.done() or failed.cancelled() else failed.exception()
            if failure is not None and not isinstance(failure, WebSocketDisconnect):
                raise failure  # a bug or the store: the server's error, as on any socket

    def lane(self, stream_id: str | None) -> Lane:
        """The lane of ``stream_id``, begun (its runner started) on its first event."""
        lane = self.lanes.get(stream_id)
        if lane is None:
            lane = self.lanes[stream_id] = Lane(stream_id)
            runner = asyncio.create_task(self._run(lane), name=f"responses socket: lane {stream_id}")
            runner.add_done_callback(self._ended)
            self._runners.append(runner)
        return lane

    def _ended(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and not self._failed.done():
            self._failed.set_exception(runner.exception() or RuntimeError("a lane's runner returned"))

    async def _read(self) -> None:
        settings = self._resources.settings
        budget = EventBudget.of(settings)
        while True:
            try:
                async with asyncio.timeout(settings.session_timeout_sec):
                    raw = await receive_frame(self._websocket)
            except TimeoutError:
                if any(lane.busy for lane in self.lanes.values()):
                    continue  # the client waits for its answers
                await self._websocket.close(NORMAL, "idle for longer than the session timeout")
                return
            stream_id = None
            try:
                event = await read_event(raw, settings, budget)
                stream_id = self._stream_id(event)
                self.lane(stream_id).waiting.put_nowait(event)
            except errors.GatewayError as exc:  # (a lane past the limit is named in its error)
                await self._send(error_event(exc, stream_id or exc.details.get("stream_id")))
            except asyncio.QueueFull:
                await self._send(error_event(errors.TooManyRequests(
                    f"{MAX_WAITING} response.create events already wait on this lane; this one is dropped",
                    retry_after=1), stream_id))

    def _stream_id(self, event: dict[str, Any]) -> str | None:
        """The lane a ``response.create`` names (any other event goes to the default lane, in its turn)."""
        if event.get("type") != "response.create" or event.get("stream_id") is None:  # (null: left out)
            return None
        stream_id = event["stream_id"]
        if not isinstance(stream_id, str) or not _STREAM_ID.fullmatch(stream_id):
            raise errors.InvalidStreamId(
                "The 'stream_id' field must be a non-empty string with at most 256 characters and may only "
                "contain letters, numbers, underscores, hyphens, and periods.", param="stream_id")
        if stream_id not in self.lanes and sum(name is not None for name in self.lanes) >= MAX_LANES:
            raise errors.StreamLimitReached(
                f"This WebSocket connection has reached its maximum number of distinct stream IDs ({MAX_LANES}). "
                "Reuse an existing stream_id or open a new WebSocket connection.", param="stream_id",
                stream_id=stream_id)
        return stream_id

    async def _run(self, lane: Lane) -> None:
        while True:
            event = await lane.waiting.get()
            lane.running = True
            try:
                await self.handle(lane, event)
            finally:
                lane.running = False

    async def handle(self, lane: Lane, event: dict[str, Any]) -> None:
        """One client event, to its end: a response's events, or an ``error`` event."""
        continued = event.get("previous_response_id")
        try:
            if event.get("type") != "response.create":
                told = "no event type" if event.get("type") is None else \
                    f"unknown event type {str(event.get('type'))[:64]!r}"
                raise errors.InvalidRequest(f"{told}: this connection takes response.create", param="type")
            if time.monotonic() - self._opened > LIFETIME_SEC:
                raise errors.ConnectionLimitReached(
                    f"Responses websocket connection limit reached ({LIFETIME_SEC // 60} minutes). Create a new "
                    "websocket connection to continue.")
            async with self._room:
                await self._respond(lane, event)
        except errors.GatewayError as exc:
            self._forget(lane, continued)
            await self._send(error_event(exc, lane.stream_id))

    async def _respond(self, lane: Lane, event: dict[str, Any]) -> None:
        # (stream: implicit, Codex sends it anyway; stream_id: the lane's)
        fields = {k: v for k, v in event.items() if k not in ("type", "stream", "stream_id")}
        generate = fields.pop("generate", True)
        if not isinstance(generate, bool):
            raise errors.ValidationFailed("generate: a boolean (false: a warmup that generates nothing)",
                                          param="generate")
        try:
            body = ResponsesRequest.model_validate({**fields, "stream": True})
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        continued = body.previous_response_id
        history: list[InputItem] = []
        if continued is not None:  # any lane's last response: another lane's is a fork of it
            kept = next((other.kept for other in self.lanes.values()
                         if other.kept is not None and other.kept.response_id == continued), None)
            if kept is None:
                raise errors.PreviousResponseNotFound(f"Previous response with id '{continued}' not found.",
                                                      param="previous_response_id")
            history = kept.items
        body = body.model_copy(update={"input": [*history, *body.input], "previous_response_id": None,
                                       "model": body.model or self._model})
        if not generate:  # a warmup: nothing to run, its input kept for the next response to continue
            response_id = f"resp_{uuid.uuid4().hex}"
            for frame in warmup_events(ResponseShape.of(body, body.model or self._model, continued), response_id):
                await self._send_text(lane.labelled(str(frame.data)))
            lane.kept = Kept(response_id, body.input)
            return
        settings = self._resources.settings
        if settings.rate_limit_rps > 0:  # each response is a request of the identity's rate, as over HTTP
            await self._resources.store.take_token(self._identity, settings.rate_limit_rps, settings.token_burst)
        session_id, shape = await start_response(self._chat, self._identity, body, self._model,
                                                 previous_response_id=continued)
        end: dict[str, Any] | None = None
        # Closed with this task (a client that left): its end cancels the session at once.
        async with contextlib.aclosing(response_events(self._chat.stream(self._identity, session_id), shape,
                                                       session_id)) as events:
            async for frame in events:
                await self._send_text(lane.labelled(str(frame.data)))
                if frame.event in TERMINAL:
                    end = orjson.loads(str(frame.data))["response"]
        if end is None or end["status"] == "failed":  # not a whole answer: nothing to continue from
            self._forget(lane, continued)
            return
        lane.kept = Kept(session_id, [*body.input, *_ITEMS.validate_python(end["output"])])

    @staticmethod
    def _forget(lane: Lane, response_id: Any) -> None:
        """A continuation that failed drops the response it named from its lane (OpenAI evicts it;
        a fork from another lane that failed leaves that lane's)."""
        if response_id is not None and lane.kept is not None and lane.kept.response_id == response_id:
            lane.kept = None

    async def _send(self, event: dict[str, Any]) -> None:
        await self._send_text(orjson.dumps(event).decode())

    async def _send_text(self, text: str) -> None:
        async with self._sending:
            await send_text(self._websocket, text)
