"""Server events of the OpenAI Realtime protocol (GA names), as plain dicts.

Only the shapes live here; when to send which is ``connection.py``'s and
``answer.py``'s. Every event gets a fresh ``event_id``; items and responses
get OpenAI-style ids (``item_...``, ``resp_...``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import orjson

from gateway import errors


def new_id(prefix: str) -> str:
    # 80 random bits, as uuid4().hex[:20] gave, in a fifth of the time: every event gets one.
    return f"{prefix}_{os.urandom(10).hex()}"


def encoded(event: dict[str, Any]) -> str:
    """An event as the text of a WebSocket message.

    orjson in a tenth of the time of ``json``: every answer token is an
    event. What orjson refuses and ``json`` writes, the stdlib writes: an
    integer beyond 64 bits or a lone surrogate, from a client's own event
    echoed back (an item's extra fields, an ``event_id``).
    """
    try:
        return orjson.dumps(event).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(event)


def event(type_: str, **fields: Any) -> dict[str, Any]:
    return {"type": type_, "event_id": new_id("event"), **fields}


#: The codes Realtime names otherwise: a refused value is OpenAI's ``invalid_value`` there, the code
#: its clients branch on (the HTTP routes keep the gateway's ``validation_error``).
_REALTIME_CODES = {"validation_error": "invalid_value"}


def error(error: errors.GatewayError, client_event_id: str | None = None) -> dict[str, Any]:
    """OpenAI's error event: the gateway's envelope plus the client event it answers."""
    body = error.envelope()["error"]
    code = _REALTIME_CODES.get(body["code"], body["code"])
    return event("error", error={"type": body["type"], "code": code, "message": body["message"],
                                 "param": body.get("param"), "event_id": client_event_id})


def user_item(item_id: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
            "status": status, "content": content}


def assistant_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": status, "content": content}


def response(response_id: str, status: str, modalities: list[str], output: list[dict[str, Any]] | None = None,
             usage: dict[str, Any] | None = None, status_details: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    body: dict[str, Any] = {"id": response_id, "object": "realtime.response", "status": status,
                            "output_modalities": modalities, "output": output or []}
    if usage is not None:
        body["usage"] = usage
    if status_details is not None:
        body["status_details"] = status_details
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
