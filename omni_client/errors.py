"""The client's one error tree: every failure a caller sees is one of these.

    OmniError
    ├── TransportFailed          the gateway could not be reached or answered no
    │                            status, after every retry (``cause`` is httpx's error)
    └── APIError                 the gateway answered with its error envelope
        │                        (``status``, ``code``, ``message``, ``type``, ``param``)
        ├── BadRequest           400 / 422: the request itself is wrong
        ├── AuthenticationFailed 401
        ├── NotFound             404 (a route, an item)
        │   ├── SessionNotFound  404 session_not_found
        │   └── ModelNotFound    404 model_not_found
        ├── Conflict             409: sequence_conflict, input_closed, ...
        ├── SessionExpired       410
        ├── PayloadTooLarge      413
        ├── RateLimited          429 (after the retries; ``retry_after``)
        ├── ServerError          5xx (after the retries; ``retry_after``)
        └── SessionFailed        the session ended in error: an SSE ``error`` event
                                 or a failed result (``status`` is the envelope's, if known)

A chunk whose send gave up carries its ``sequence_id``, so the caller can
send the same data again under that id (a duplicate if it did arrive).
"""

from __future__ import annotations

import json
from typing import Any


class OmniError(Exception):
    """Anything the client raises; ``sequence_id`` is set when a chunk's send failed."""

    sequence_id: int | None = None


class TransportFailed(OmniError):
    """No HTTP answer: refused, reset, timed out, after every retry."""

    def __init__(self, message: str, cause: Exception | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause


class APIError(OmniError):
    """An answer in the gateway's envelope ``{"error": {"message","type","code","param"}}``."""

    def __init__(self, status: int, code: str, message: str, *, type: str = "", param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.type, self.param, self.retry_after = type, param, retry_after

    @property
    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


class BadRequest(APIError):
    pass


class AuthenticationFailed(APIError):
    pass


class NotFound(APIError):
    """A 404 that is not a session's: a model not served, a route, an item."""


class SessionNotFound(NotFound):
    pass


class ModelNotFound(NotFound):
    pass


class Conflict(APIError):
    pass


class SessionExpired(APIError):
    pass


class PayloadTooLarge(APIError):
    pass


class RateLimited(APIError):
    pass


class ServerError(APIError):
    pass


class SessionFailed(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {400: BadRequest, 422: BadRequest, 401: AuthenticationFailed,
                                         409: Conflict, 410: SessionExpired,
                                         413: PayloadTooLarge, 429: RateLimited}


#: 404s by their code: only a session's is ``SessionNotFound`` (code that recreates a vanished
#: session must not loop on a misspelled model).
_NOT_FOUND_BY_CODE: dict[str, type[APIError]] = {"session_not_found": SessionNotFound,
                                                 "model_not_found": ModelNotFound}


def api_error(status: int, body: bytes, retry_after: float | None = None) -> APIError:
    """The typed error for an answer; a body that is not our envelope (a load
    balancer's own 502 page) keeps its status and a ``http_<status>`` code."""
    envelope = _envelope(body)
    error_class = _BY_STATUS.get(status, ServerError if status >= 500 else APIError)
    if status == 404:
        detail = envelope.get("error") if isinstance(envelope, dict) else None
        code = detail.get("code") if isinstance(detail, dict) else None
        error_class = _NOT_FOUND_BY_CODE.get(str(code), NotFound)
    return from_envelope(error_class, status, envelope, retry_after)


def from_envelope(error_class: type[APIError], status: int, envelope: dict[str, Any] | None,
                  retry_after: float | None = None) -> APIError:
    detail = envelope.get("error") if isinstance(envelope, dict) else None
    if not isinstance(detail, dict):
        return error_class(status, f"http_{status}", "the server answered without an error envelope",
                           retry_after=retry_after)
    return error_class(status, str(detail.get("code") or f"http_{status}"), str(detail.get("message") or ""),
                       type=str(detail.get("type") or ""), param=detail.get("param"), retry_after=retry_after)


def _envelope(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
