"""The SSE output stream of a session, read from its Redis output stream.

Every frame carries its stream entry id as the SSE ``id:``, so a client that
reconnects with ``Last-Event-ID`` gets exactly the frames after it, from any
replica. Errors before the first byte are raised (the route checked the
session); errors after it become an ``event: error`` frame, then the end.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.store.redis_store import SessionStore

logger = logging.getLogger(__name__)

#: Redis stream ids: "<ms>-<seq>".
EVENT_ID = re.compile(r"^\d+-\d+$")
#: One blocking read waits this long before checking the session still exists.
READ_BLOCK_MS = 5_000


def parse_last_event_id(value: str | None) -> str:
    if value is None or value == "":
        return "0-0"
    if not EVENT_ID.match(value):
        raise errors.InvalidRequest("Last-Event-ID must be an id received from this stream",
                                    param="Last-Event-ID")
    return value


async def session_events(store: SessionStore, session_id: str, after: str) -> AsyncIterator[ServerSentEvent]:
    try:
        while True:
            frames = await store.read_frames(session_id, after, READ_BLOCK_MS)
            for frame in frames:
                yield ServerSentEvent(data=frame.data, event=frame.event or None, id=frame.id)
                after = frame.id
                if frame.last:
                    return
            if not frames:
                await store.view(session_id)  # raises once the session's keys are gone
    except errors.GatewayError as exc:
        logger.warning("session %s: stream ended early: %s", session_id, exc.code)
        yield ServerSentEvent(data=json.dumps(exc.envelope()), event="error")
