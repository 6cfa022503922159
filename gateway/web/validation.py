"""Reading request bodies safely and turning validation errors into ours."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Header
from starlette.requests import Request

from gateway import errors
from gateway.service.models import LONE_SURROGATE, not_unicode

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
    """One envelope for pydantic / FastAPI validation errors: the problem that went deepest (of a
    value several shapes may take, the shape it was meant as: a content part's bad field, not
    "should be a valid string"), located by the request's own field names."""
    if not details:
        return errors.ValidationFailed("invalid request")
    first: dict[str, Any] = dict(max(details, key=lambda d: len(param_path(dict(d).get("loc", ())))))
    if first.get("type") == "json_invalid":
        return errors.InvalidJson("request body is not valid JSON")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = ".".join(param_path(first.get("loc", ()))) or None
    if first.get("type") in (LONE_SURROGATE, "string_unicode"):  # StrictModel's check, or pydantic's own
        return not_unicode(".".join(filter(None, (param, (first.get("ctx") or {}).get("within")))) or None)
    if param:
        message = f"{param}: {message}"
    return errors.ValidationFailed(message, param=param)


def param_path(loc: Sequence[Any]) -> list[str]:
    """A pydantic error location as the request's path: without ``body``, the shapes pydantic
    tried (``str``, ``list[...]``, ``literal[...]``) and the tag of a tagged union, which repeats
    the field it names (``json_schema.json_schema``)."""
    path: list[str] = []
    for part in map(str, loc):
        # (A model's name, capitalized, is the branch of a union it tried; field names are lowercase.)
        if part == "body" or part in _SHAPES or "[" in part or "(" in part or part[:1].isupper():
            continue
        if path and path[-1] == part:
            continue
        path.append(part)
    return path


#: Names pydantic gives the branches of a union it tried.
_SHAPES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before",
                     "function-wrap", "function-plain", "json-or-python", "chain", "lax-or-strict", "nullable"})
