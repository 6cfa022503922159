"""``POST /v1/streaming_input/upload``: Mode A, one streamed request in, the SSE answer out.

The body is NDJSON: the first record is the session to create (the body of
``POST /v1/streaming_input/sessions``), every further record a chunk (the
body of ``POST .../chunks``). The session is created as soon as the first
record arrives, and each chunk is appended as it arrives, so the start
policy fires while the upload is still running (``curl -T -`` or any client
that streams a request body). The response is the session's SSE stream; its
id comes first, in the ``X-Session-Id`` header, so an upload that breaks off
leaves a session that Mode B calls continue (``GET .../{id}`` says which
sequence id comes next). A record the session refuses ends the stream with
an ``error`` event naming the line; the session stays as it was. A store
that cannot serve is not a refusal: the record is appended again, for as
long as the answer's stream waits for the store too (``STORE_OUTAGE_SEC``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError
from sse_starlette import ServerSentEvent
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from gateway import errors
from gateway.api.chunks import record_from_json
from gateway.api.upload.lines import NdjsonReader
from gateway.output.sse import FrameEvent
from gateway.service.models import ChunkIn, CreateSessionRequest
from gateway.service.sessions import SessionService
from gateway.settings import Settings
from gateway.store.connection import StoreOutage
from gateway.web.event_stream import EVENT_STREAM_CONTENT, EventStream
from gateway.web.resources import get_identity, get_resources, get_service, get_settings
from gateway.web.validation import validation_error
from gateway.work.draining import Draining

UPLOAD_PATH = "/v1/streaming_input/upload"
router = APIRouter(tags=["sessions"])

_BODY = {"requestBody": {"required": True, "content": {"application/x-ndjson": {"schema": {
    "type": "string", "description": "line 1: a CreateSessionRequest; every further line: a ChunkIn"}}}}}


@router.post(UPLOAD_PATH, response_class=EventStream, openapi_extra=_BODY,
             responses={200: {"content": EVENT_STREAM_CONTENT,
                              "description": "the session's SSE stream; its id is the X-Session-Id header"},
                        **errors.error_responses(errors.InvalidJson, errors.ValidationFailed, errors.EmptyInput,
                                                 errors.RequestTooLarge, errors.StoreUnavailable, errors.Overloaded,
                                                 errors.Unauthorized, errors.TooManySessions,
                                                 errors.CapacityExhausted)})
async def upload(request: Request, service: Annotated[SessionService, Depends(get_service)],
                 identity: Annotated[str, Depends(get_identity)],
                 settings: Annotated[Settings, Depends(get_settings)]) -> Response:
    service.check_enabled()
    reader = NdjsonReader(request.receive, settings.max_request_bytes)
    first = await reader.next_line()
    if first is None:
        raise errors.EmptyInput("the first line of an upload is the session to create", param="line 1")
    try:
        body = CreateSessionRequest.model_validate_json(first)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
    first_chunk = record_from_json(body.first_chunk, settings.max_chunk_bytes) if body.first_chunk else None
    record, _ = await service.create(identity, body, first_chunk)
    return _UploadResponse(service, identity, record.session_id, reader, settings, get_resources(request).draining)


class _UploadResponse(Response):
    """Reads the rest of the body into the session while it streams the answer back.

    The body and the SSE response share one ``receive``: the upload reads
    it, and the response only learns of the disconnect (its own listener
    would swallow the body otherwise).
    """

    def __init__(self, service: SessionService, identity: str, session_id: str, reader: NdjsonReader,
                 settings: Settings, draining: Draining) -> None:
        super().__init__()
        self._service, self._identity, self._session_id = service, identity, session_id
        self._reader, self._settings, self._draining = reader, settings, draining
        self._outage = StoreOutage(f"session {session_id}: upload")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()
        refused: asyncio.Future[errors.GatewayError] = asyncio.get_running_loop().create_future()
        feeder = asyncio.create_task(self._feed(receive, disconnected, refused))

        async def disconnect_only() -> Message:
            await disconnected.wait()
            return {"type": "http.disconnect"}

        try:
            events = self._service.events(self._identity, self._session_id, "0-0")
            response = EventStream(_until_refused(events, refused), ping_sec=self._settings.sse_ping_sec,
                                   draining=self._draining, headers={"X-Session-Id": self._session_id})
            await response(scope, disconnect_only, send)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    async def _feed(self, receive: Receive, disconnected: asyncio.Event,
                    refused: asyncio.Future[errors.GatewayError]) -> None:
        """Append each record as it arrives; then wait for the client to go."""
        try:
            while (line := await self._reader.next_line()) is not None:
                await self._append(line)
            while (await receive())["type"] != "http.disconnect":
                pass
        except ClientDisconnect:
            pass  # the session stays: Mode B continues it
        except errors.GatewayError as exc:
            refused.set_result(exc)
            return
        disconnected.set()

    async def _append(self, line: bytes) -> None:
        where = f"line {self._reader.line}"
        try:
            chunk = ChunkIn.model_validate_json(line)
        except ValidationError as exc:
            error = validation_error(exc.errors())
            error.param = f"{where}: {error.param}" if error.param else where
            raise error from exc
        try:
            record = record_from_json(chunk, self._settings.max_chunk_bytes)
            while True:
                try:
                    await self._service.append(self._identity, self._session_id, record)
                    break
                except errors.StoreUnavailable as exc:
                    # As a client of the sessions API would: the same record again (stored
                    # once), while the answer's stream waits the same outage out.
                    await self._outage.failed(exc)
            self._outage.served()
        except errors.GatewayError as exc:
            exc.param = f"{where}: {exc.param}" if exc.param else where
            raise


async def _until_refused(opening: Awaitable[AsyncIterator[ServerSentEvent] | None],
                         refused: asyncio.Future[errors.GatewayError]) -> AsyncIterator[ServerSentEvent]:
    """The session's frames, until the upload has a record refused: then its error, and the end.

    The stream is opened here, after the headers (the session id) went out, so
    a store that fails at that moment is an ``error`` event, not a 500.
    """
    try:
        events = await opening
    except errors.GatewayError as exc:
        yield FrameEvent(data=json.dumps(exc.envelope()), event="error")
        return
    if events is None:
        return
    while True:
        following = asyncio.ensure_future(anext(events, None))
        either: set[asyncio.Future[Any]] = {following, refused}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if refused.done() and not following.done():
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await following
            yield FrameEvent(data=json.dumps(refused.result().envelope()), event="error")
            return
        frame = following.result()
        if frame is None:
            return
        yield frame
