"""HTTP routes of the session API: parse, call the service, shape the response.

Three routes are hot (append, finish, the SSE events): each is declared here,
for the OpenAPI document, and marked ``@served_by(<handler>)``, the plain ASGI
handler in ``hot_routes.py`` that serves it. ``create_app`` swaps the
handler in (``hot_routes.install``); the declaration's body never runs.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status

from gateway import errors
from gateway.api.chunks import read_chunk, record_from_json
from gateway.api.sessions import hot_routes
from gateway.api.sessions.hot_routes import served_by
from gateway.service.models import (
    ChunkAccepted,
    ChunkReplaced,
    CreatedSession,
    CreateSessionRequest,
    FinishAccepted,
    FinishRequest,
    SessionResult,
    SessionView,
)
from gateway.service.sessions import SessionService
from gateway.settings import Settings
from gateway.store.session_hash import SessionRecord
from gateway.web.event_stream import EVENT_STREAM_CONTENT, EventStream
from gateway.web.resources import get_identity, get_service, get_settings
from gateway.web.validation import IdempotencyKey

router = APIRouter(prefix="/v1/streaming_input/sessions", tags=["sessions"])

Service = Annotated[SessionService, Depends(get_service)]
Identity = Annotated[str, Depends(get_identity)]

_COMMON = (errors.Unauthorized, errors.TooManyRequests, errors.SessionNotFound, errors.SessionExpired,
           errors.StoreUnavailable, errors.Overloaded)
_INPUT = (*_COMMON, errors.InvalidJson, errors.ValidationFailed, errors.SessionClosed)


def session_view(record: SessionRecord) -> SessionView:
    return SessionView(
        session_id=record.session_id,
        state=record.state,
        start_policy=record.policy,
        model=record.model,
        created_at=record.created_at_ms / 1000,
        expires_at=record.expires_at_or_gone_ms / 1000,
        expires_in=max(0.0, record.expires_at_or_gone_ms / 1000 - time.time()),
        next_sequence_id=record.next_seq,
        received_chunks=record.received,
        buffered_bytes=record.bytes,
        missing_sequence_ids=record.missing_sequence_ids,
        owner=record.owner,
        input_transcript=record.input_transcript,
        parked=record.parked,
        parks=record.parks,
        resumes=record.resumes,
        replaced_chunks=record.replaced,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=CreatedSession,
             responses=errors.error_responses(errors.InvalidJson, errors.ValidationFailed,
                                              errors.ModelNotFound, errors.ChunkTooLarge,
                                              errors.SequenceOutOfWindow, errors.SessionPayloadTooLarge,
                                              errors.StoreUnavailable, errors.Overloaded, errors.StreamingInputDisabled,
                                              errors.Unauthorized, errors.TooManySessions,
                                              errors.CapacityExhausted, errors.IdempotencyKeyReused,
                                              # a retry (same Idempotency-Key) after the session expired
                                              errors.SessionExpired))
async def create_session(body: CreateSessionRequest, service: Service, identity: Identity,
                         settings: Annotated[Settings, Depends(get_settings)],
                         idempotency_key: IdempotencyKey = None) -> CreatedSession:
    first = record_from_json(body.first_chunk, settings.max_chunk_bytes) if body.first_chunk else None
    record, started = await service.create(identity, body, first, idempotency_key)
    return CreatedSession(**session_view(record).model_dump(), started=started)


_CHUNK_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ChunkIn"}},
            "application/octet-stream": {
                "schema": {
                    "type": "string", "format": "binary",
                    "description": "raw payload; X-Sequence-Id (required), X-Modality, X-End-Of-Input, "
                                   "X-Format, X-Sample-Rate, X-Mime-Type headers describe it",
                },
            },
        },
    }
}


@router.post("/{session_id}/chunks", status_code=status.HTTP_202_ACCEPTED, response_model=ChunkAccepted,
             openapi_extra=_CHUNK_BODY,
             responses={200: {"model": ChunkAccepted, "description": "exact duplicate, nothing changed"},
                        **errors.error_responses(*_INPUT, errors.UnsupportedModality, errors.SequenceConflict,
                                                 errors.SequenceOutOfWindow, errors.InputClosed,
                                                 errors.TooManyChunks, errors.ChunkTooLarge,
                                                 errors.SessionPayloadTooLarge)})
@served_by(hot_routes.append_chunk)
async def append_chunk(session_id: str, request: Request, response: Response, service: Service, identity: Identity,
                       settings: Annotated[Settings, Depends(get_settings)]) -> ChunkAccepted:
    # No docstring: it would become the operation's description.
    raise hot_routes.declared_only(append_chunk)


@router.put("/{session_id}/chunks/{sequence_id}", response_model=ChunkReplaced, openapi_extra=_CHUNK_BODY,
            summary="Replace a chunk already sent (update mode)",
            responses=errors.error_responses(*_INPUT, errors.UnsupportedModality, errors.SequenceConflict,
                                             errors.InputClosed, errors.ChunkTooLarge,
                                             errors.SessionPayloadTooLarge, errors.ContextLengthExceeded))
async def replace_chunk(session_id: str, sequence_id: int, request: Request, service: Service, identity: Identity,
                        settings: Annotated[Settings, Depends(get_settings)]) -> ChunkReplaced:
    """Retrieved context that changes while the user waits (Stream2LLM's update mode).

    The body is a chunk as for an append; its ``sequence_id`` (if given) must
    be the one in the path. While the session is streaming, the engine keeps
    the work on the longest common token prefix of the old and new input and
    recomputes the rest; the answer is that of the new input. Once the input
    is complete (the answer is under way), chunks can no longer change: 409
    ``input_closed``. A chunk never received: 409 ``sequence_conflict``.
    """
    service.check_enabled()
    chunk = await read_chunk(request, settings)
    if chunk.sequence_id != sequence_id:
        raise errors.ValidationFailed(
            f"the body's sequence_id {chunk.sequence_id} is not the path's {sequence_id}", param="sequence_id")
    if chunk.end_of_input:
        raise errors.ValidationFailed("a replacement cannot end the input; use finish", param="end_of_input")
    replaced = await service.replace(identity, session_id, chunk)
    return ChunkReplaced(session_id=session_id, sequence_id=sequence_id, state=replaced.outcome.state,
                         replaced=not replaced.outcome.duplicate, kept_tokens=replaced.kept_tokens,
                         input_tokens=replaced.input_tokens, next_sequence_id=replaced.outcome.next_sequence_id)


@router.post("/{session_id}/finish", status_code=status.HTTP_202_ACCEPTED, response_model=FinishAccepted,
             responses=errors.error_responses(*_INPUT, errors.InputClosed, errors.SequenceOutOfWindow,
                                              errors.EmptyInput))
@served_by(hot_routes.finish_session)
async def finish_session(session_id: str, service: Service, identity: Identity,
                         body: FinishRequest | None = None) -> FinishAccepted:
    raise hot_routes.declared_only(finish_session)


@router.get("/{session_id}", response_model=SessionView, responses=errors.error_responses(*_COMMON))
async def get_session(session_id: str, service: Service, identity: Identity) -> SessionView:
    return session_view(await service.view(identity, session_id))


@router.get("/{session_id}/events",
            response_class=EventStream,
            responses={200: {"content": EVENT_STREAM_CONTENT,
                             "description": "chat.completion.chunk frames, then [DONE]; resumable"},
                       204: {"description": "Last-Event-ID is the stream's final frame: nothing follows "
                                            "(EventSource stops reconnecting)"},
                       **errors.error_responses(*_COMMON, errors.InvalidRequest)})
@served_by(hot_routes.stream_events)
async def stream_events(session_id: str, service: Service, identity: Identity,
                        settings: Annotated[Settings, Depends(get_settings)],
                        last_event_id: Annotated[str | None, Header()] = None) -> Response:
    raise hot_routes.declared_only(stream_events)


@router.get("/{session_id}/result", response_model=SessionResult,
            responses={202: {"model": SessionResult, "description": "still running; poll again"},
                       **errors.error_responses(*_COMMON)})
async def get_result(session_id: str, service: Service, identity: Identity, response: Response,
                     wait: Annotated[float, Query(ge=0, le=60, description="long-poll seconds")] = 0.0,
                     ) -> SessionResult:
    record = await service.result(identity, session_id, wait)
    if not record.state.is_terminal:
        response.status_code = status.HTTP_202_ACCEPTED
        response.headers["Retry-After"] = "1"
    return SessionResult(session_id=session_id, state=record.state, completion=record.result,
                         error=record.error["error"] if record.error else None,
                         input_transcript=record.input_transcript)


@router.delete("/{session_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=errors.error_responses(*_COMMON, errors.SessionClosed))
async def cancel_session(session_id: str, service: Service, identity: Identity) -> Response:
    await service.cancel(identity, session_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
