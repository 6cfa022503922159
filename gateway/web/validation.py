"""Reading request bodies safely and turning validation errors into ours."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Header
from starlette.requests import Request

from gateway import errors

#: The ``Idempotency-Key`` header of the routes that make a session (create, chat).
IdempotencyKey = Annotated[str | None, Header(
    min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
    description="a key of the client's choosing (a UUID): a repeat of the same request with it answers from "
                "the session the first made, so a create whose answer was lost can be retried")]


async def read_body_capped(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes.

    It is read as it streams in, so an oversized upload never sits whole in
    memory; a declared ``Content-Length`` over the limit is refused unread.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.ChunkTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise errors.ChunkTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def validation_error(details: Sequence[Any]) -> errors.GatewayError:
    """One envelope for pydantic / FastAPI validation errors: the first problem, located."""
    first = dict(details[0]) if details else {}
    if first.get("type") == "json_invalid":
        return errors.InvalidJson("request body is not valid JSON")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request")
    param = ".".join(loc) or None
    if param:
        message = f"{param}: {message}"
    return errors.ValidationFailed(message, param=param)
