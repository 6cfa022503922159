"""The gateway's one error tree; the handler in ``gateway.runtime.app`` renders it.

Every error a client can see is one of these, with a status code and a
stable ``code`` for the envelope ``{"error": {"message", "type", "code",
"param"}}`` (vLLM's / OpenAI's shape). Routes and services raise them; only
the handler knows HTTP.

    GatewayError (500 internal_error)
    ├── RequestTimeout (408 request_timeout)
    ├── HeadersTooLarge (431 headers_too_large)
    ├── InvalidRequest (400 invalid_request)
    │   ├── InvalidJson (400 invalid_json)
    │   ├── ItemNotFound (400 item_retrieve_invalid_item_id)      Realtime: OpenAI's codes
    │   │   ├── ItemDeleteNotFound (400 item_delete_invalid_item_id)
    │   │   └── ItemTruncateNotFound (400 item_truncate_invalid_item_id)
    │   ├── NoActiveResponse (400 response_cancel_not_active)
    │   ├── PreviousResponseNotFound (400 previous_response_not_found)  Responses WebSocket: OpenAI's codes
    │   ├── ConnectionLimitReached (400 websocket_connection_limit_reached)
    │   ├── InvalidStreamId (400 invalid_stream_id)
    │   ├── StreamLimitReached (400 websocket_stream_limit_reached)
    │   └── PromptTooLong (400 context_length_exceeded)  a chat's messages: OpenAI's and vLLM's status
    ├── ValidationFailed (422 validation_error)
    │   ├── InvalidPayload (422 invalid_payload)
    │   ├── UnknownParameter (422 unknown_parameter)  Realtime: OpenAI's GA code
    │   ├── UnsupportedModality (422 unsupported_modality)
    │   ├── EmptyInput (422 empty_input)
    │   │   └── EmptyAudioBuffer (422 input_audio_buffer_commit_empty)
    │   ├── StringAboveMaxLength (422 string_above_max_length)  OpenAI's code
    │   └── IdempotencyKeyReused (422 idempotency_key_reused)  the key came with another request
    ├── Unauthorized (401 missing_credentials)
    │   └── InvalidApiKey (401 invalid_api_key)
    ├── TooManyRequests (429 rate_limit_exceeded)          Retry-After
    │   └── TooManySessions (429 too_many_sessions)       Retry-After
    ├── SessionNotFound (404 session_not_found)
    ├── ModelNotFound (404 model_not_found)
    ├── SessionExpired (410 session_expired)
    ├── ConflictError (409 conflict)
    │   ├── ActiveResponse (409 conversation_already_has_active_response)
    │   ├── SessionExists (409 session_exists)  a create under an id already taken
    │   ├── SequenceConflict (409 sequence_conflict)
    │   ├── SequenceOutOfWindow (409 sequence_out_of_window)
    │   ├── InputClosed (409 input_closed)
    │   ├── SessionClosed (409 session_closed)
    │   │   └── SessionCancelled (409 session_cancelled)
    │   ├── IncompleteInput (409 incomplete_input)  stored when gaps outlive the timeout
    │   └── TooManyChunks (409 too_many_chunks)
    ├── PayloadTooLarge (413)
    │   ├── RequestTooLarge (413 request_too_large)  any body over the request cap
    │   ├── ChunkTooLarge (413 chunk_too_large)
    │   ├── ContextLengthExceeded (413 context_length_exceeded)  the session stays
    │   └── SessionPayloadTooLarge (413 payload_too_large)  closes the session
    ├── ServiceUnavailable (503 service_unavailable)
    │   ├── StreamingInputDisabled (503 streaming_input_disabled)
    │   ├── CapacityExhausted (503 capacity_exhausted)    Retry-After
    │   ├── StoreUnavailable (503 store_unavailable)  a stream's end past an outage: resumable
    │   ├── Overloaded (503 overloaded)                   Retry-After  this replica sheds load
    │   ├── ReplicaStopping (503 replica_stopping)  a stream's end at shutdown: resume it elsewhere
    │   └── EngineUnavailable (503 engine_unavailable)
    └── EngineTimeout (504 engine_timeout)  stored when an answer stops making progress
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class GatewayError(Exception):
    status_code: ClassVar[int] = HTTPStatus.INTERNAL_SERVER_ERROR
    code: ClassVar[str] = "internal_error"
    type: ClassVar[str] = "server_error"

    #: Seconds for a ``Retry-After`` header, for errors a client should retry later.
    retry_after: int | None = None
    #: A failed session's stored envelope may name this code (``from_envelope`` reads it back).
    stored: ClassVar[bool] = True

    def __init__(self, message: str, *, param: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        #: Extra envelope fields (e.g. ``missing_sequence_ids``).
        self.details = details

    def envelope(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "code": self.code,
            "param": self.param,
        }
        body.update(self.details)
        return {"error": body}

    def envelope_json(self) -> str:
        """The envelope as stored in Redis (a session's ``error``, an ``event: error`` frame)."""
        return json.dumps(self.envelope())


class RequestTimeout(GatewayError):
    status_code = HTTPStatus.REQUEST_TIMEOUT
    code = "request_timeout"
    type = "invalid_request_error"


class HeadersTooLarge(GatewayError):
    status_code = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
    code = "headers_too_large"
    type = "invalid_request_error"


class InvalidRequest(GatewayError):
    status_code = HTTPStatus.BAD_REQUEST
    code = "invalid_request"
    type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    """A chat's (or a response's) messages past the model's context: a 400, as OpenAI and vLLM
    answer it and frameworks look for it. A session's chunk past it is ``ContextLengthExceeded``."""

    code = "context_length_exceeded"
    stored = False  # said at once, never stored: a stored one is ContextLengthExceeded


class InvalidJson(InvalidRequest):
    code = "invalid_json"


class PreviousResponseNotFound(InvalidRequest):
    """A Responses WebSocket's ``previous_response_id`` that its connection does not keep."""

    code = "previous_response_not_found"


class ConnectionLimitReached(InvalidRequest):
    """A Responses WebSocket past its lifetime: a new connection goes on."""

    code = "websocket_connection_limit_reached"


class InvalidStreamId(InvalidRequest):
    """A Responses WebSocket lane's name (``stream_id``) that is not one."""

    code = "invalid_stream_id"


class StreamLimitReached(InvalidRequest):
    """A Responses WebSocket's new lane past the lanes a connection takes."""

    code = "websocket_stream_limit_reached"


class ItemNotFound(InvalidRequest):
    """A Realtime event names an item the conversation does not have (OpenAI's code per event)."""

    code = "item_retrieve_invalid_item_id"


class ItemDeleteNotFound(ItemNotFound):
    code = "item_delete_invalid_item_id"


class ItemTruncateNotFound(ItemNotFound):
    code = "item_truncate_invalid_item_id"


class NoActiveResponse(InvalidRequest):
    code = "response_cancel_not_active"


class ValidationFailed(GatewayError):
    status_code = HTTPStatus.UNPROCESSABLE_ENTITY
    code = "validation_error"
    type = "invalid_request_error"


class InvalidPayload(ValidationFailed):
    code = "invalid_payload"


class UnknownParameter(ValidationFailed):
    """A field the protocol does not have (a typo, or a name of another version of it)."""

    code = "unknown_parameter"


class UnsupportedModality(ValidationFailed):
    code = "unsupported_modality"


class EmptyInput(ValidationFailed):
    code = "empty_input"


class EmptyAudioBuffer(EmptyInput):
    code = "input_audio_buffer_commit_empty"


class StringAboveMaxLength(ValidationFailed):
    code = "string_above_max_length"


class IdempotencyKeyReused(ValidationFailed):
    code = "idempotency_key_reused"


class Unauthorized(GatewayError):
    status_code = HTTPStatus.UNAUTHORIZED
    code = "missing_credentials"
    type = "authentication_error"


class InvalidApiKey(Unauthorized):
    code = "invalid_api_key"


class TooManyRequests(GatewayError):
    status_code = HTTPStatus.TOO_MANY_REQUESTS
    code = "rate_limit_exceeded"
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManySessions(TooManyRequests):
    code = "too_many_sessions"


class SessionNotFound(GatewayError):
    status_code = HTTPStatus.NOT_FOUND
    code = "session_not_found"
    type = "invalid_request_error"


class CallNotFound(SessionNotFound):
    """No process holds the caller's WebRTC call (OpenAI's code for a hang-up or a control
    socket naming a call it does not know)."""

    code = "call_id_not_found"


class NoSuchRoute(GatewayError):
    """No route at the path (Starlette's 404, and a WebSocket to a path that has none)."""

    status_code = HTTPStatus.NOT_FOUND
    code = "not_found"
    type = "invalid_request_error"


class ModelNotFound(GatewayError):
    status_code = HTTPStatus.NOT_FOUND
    code = "model_not_found"
    type = "invalid_request_error"


class SessionExpired(GatewayError):
    status_code = HTTPStatus.GONE
    code = "session_expired"
    type = "invalid_request_error"


class ConflictError(GatewayError):
    status_code = HTTPStatus.CONFLICT
    code = "conflict"
    type = "invalid_request_error"


class ActiveResponse(ConflictError):
    """A Realtime conversation has a response running already (OpenAI's code, which SDKs check)."""

    code = "conversation_already_has_active_response"
class SessionExists(ConflictError):
    code = "session_exists"


class SequenceConflict(ConflictError):
    code = "sequence_conflict"


class SequenceOutOfWindow(ConflictError):
    code = "sequence_out_of_window"


class InputClosed(ConflictError):
    code = "input_closed"


class SessionClosed(ConflictError):
    code = "session_closed"


class SessionCancelled(SessionClosed):
    code = "session_cancelled"


class IncompleteInput(ConflictError):
    code = "incomplete_input"


class TooManyChunks(ConflictError):
    code = "too_many_chunks"


class PayloadTooLarge(GatewayError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    code = "payload_too_large"
    type = "invalid_request_error"


class RequestTooLarge(PayloadTooLarge):
    code = "request_too_large"


class ChunkTooLarge(PayloadTooLarge):
    code = "chunk_too_large"


class ContextLengthExceeded(PayloadTooLarge):
    code = "context_length_exceeded"


class SessionPayloadTooLarge(PayloadTooLarge):
    code = "payload_too_large"
    #: The state the session was in before this closed it (for metrics).
    previous_state: Any = None


class ServiceUnavailable(GatewayError):
    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    code = "service_unavailable"
    type = "server_error"
    retry_after = 1


class StreamingInputDisabled(ServiceUnavailable):
    code = "streaming_input_disabled"


class CapacityExhausted(ServiceUnavailable):
    code = "capacity_exhausted"
    retry_after = 5


class StoreUnavailable(ServiceUnavailable):
    """Redis cannot serve now (gateway/store/connection.py decides). A stream waits it out
    for a while first; one that gives up ends with this, ``resumable`` (gateway/output/sse.py)."""

    code = "store_unavailable"


class Overloaded(ServiceUnavailable):
    """The replica is saturated and refused the call before doing anything (gateway/web/middleware/admission.py)."""

    code = "overloaded"


class ReplicaStopping(ServiceUnavailable):
    """The replica serving a stream stopped before the answer ended; the session goes on
    (gateway/work/draining.py): resume the stream with ``Last-Event-ID`` (the event says
    ``resumable``)."""

    code = "replica_stopping"


class EngineUnavailable(ServiceUnavailable):
    code = "engine_unavailable"


class AnswerNotResumable(ServiceUnavailable):
    """A replica stopped mid-answer, and the answer (held to JSON, or calling a function) came out
    differently when another one made it again (``work/said_again.py``): ask again."""

    code = "answer_not_resumable"


class EngineTimeout(GatewayError):
    status_code = HTTPStatus.GATEWAY_TIMEOUT
    code = "engine_timeout"


def from_envelope(envelope: dict[str, Any]) -> GatewayError:
    """The error a stored envelope describes, with the status its code has in this tree.

    A failed session stores its envelope; a synchronous answer (a non-streamed
    chat completion) raises it again. Codes outside the tree (an engine's
    own, e.g. ``engine_error``) keep their code with a 500.
    """
    body = dict(envelope["error"])
    message, code, param = body.pop("message"), body.pop("code"), body.pop("param", None)
    body.pop("type", None)
    error = GatewayError(message, param=param, **body)
    known = next((cls for cls in _subclasses(GatewayError) if cls.code == code and cls.stored), GatewayError)
    # The labels are class constants; this one instance takes those of the
    # code the envelope names, which may belong to no class of ours.
    error.status_code = known.status_code  # type: ignore[misc]
    error.type = known.type  # type: ignore[misc]
    error.code = code  # type: ignore[misc]
    error.retry_after = known.retry_after
    return error


def _subclasses(cls: type[GatewayError]) -> list[type[GatewayError]]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


# The envelope's schema, for the OpenAPI document.


class ErrorDetail(BaseModel):
    #: Some errors carry more, e.g. ``missing_sequence_ids``.
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    code: str
    param: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorDetail



#: Declared on every route (``responses=``) so the OpenAPI document shows the envelope.
def error_responses(*errors: type[GatewayError]) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {}
    for error in errors:
        entry = responses.setdefault(int(error.status_code), {"model": ErrorEnvelope, "description": ""})
        codes = [c for c in entry["description"].split(", ") if c]
        entry["description"] = ", ".join([*codes, error.code])
    return responses
