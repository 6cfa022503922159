"""The SSE response of every streaming route: session events, chat completions, uploads.

What sse_starlette's ``EventSourceResponse`` did for these routes, with the
cost per event down to the event itself. That response wrapped every send in
a cancel scope of its own (its per-send timeout): about 6 µs per event here,
some 12% of a replica's CPU relaying 20,000 tokens/s (bench/README.md,
section 2). Here a send is just a send, and one watchdog per stream does the
rest:

- **keep-alive**: a few bytes every ``ping_sec``, so proxies keep an idle
  stream open. In a stream of OpenAI's shape (no ``id:`` lines) an empty line,
  which every SSE parser ignores: vLLM's ``vllm bench serve`` strips each read
  and joins what is left, so a comment sent alone was glued to the next event
  and the rest of the stream lost. Once an ``id:`` was sent, a comment line
  (``: ping - <time>``) with no blank line after it: the openai SDK's decoder
  keeps the last ``id:`` it saw and takes any blank line after one for an
  event, so a blank line became an event with no data, which it failed to
  parse (JSONDecodeError); the comment ends with the next frame's blank line;
- **a client that stopped reading** (a send blocked ``send_timeout_sec`` on
  a full socket buffer) is dropped;
- **the client left** (``http.disconnect``): the stream ends;
- **the server is stopping** (``Draining``): the stream goes on for the
  grace period, most answers reach ``[DONE]``; one still open then ends with
  an ``error`` event (``replica_stopping``, ``resumable``, no ``id``), so no
  client takes the end for a complete answer: it resumes the session's stream
  with ``Last-Event-ID`` from another replica, where the session goes on;
- **the store is away** (Redis restarting): nothing here; the events wait it
  out (gateway/output/sse.py) while the keep-alive goes on.

However it ends, the events' generator is closed, so its ``finally`` runs
(a subscription is left, an abandoned chat is cancelled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

import anyio
from sse_starlette import ServerSentEvent
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway import errors
from gateway.output.sse import FrameEvent
from gateway.work.draining import Draining

logger = logging.getLogger(__name__)

#: How the API document describes an SSE response: one schema per event, as EventSource
#: gives it to a client (and as OpenAPI 3.2's ``itemSchema`` and schemathesis read it).
EVENT_STREAM_CONTENT: dict[str, Any] = {"text/event-stream": {"schema": {
    "type": "object",
    "description": "One server-sent event. `data` is a JSON chat.completion.chunk, or [DONE] at the end; "
                   "a named event carries its own JSON (`transcript`, `error`)",
    "properties": {"event": {"type": "string", "description": "absent (message) for answer frames"},
                   "data": {"type": "string"},
                   "id": {"type": "string", "description": "resume after it with Last-Event-ID"},
                   "retry": {"type": "integer"}},
    "required": ["data"]}}}

#: A subscriber whose socket takes no frame for this long is dropped (it stopped reading).
SEND_TIMEOUT_SEC = 30.0
#: A generator's clean-up (its ``finally``) gets this long once the stream has ended.
CLEANUP_TIMEOUT_SEC = 5.0
#: What a stream still open when its replica stops is told to do: read on from another replica.
RESUME_ELSEWHERE = ("the session goes on: resume its stream (GET /v1/streaming_input/sessions/{id}/events, "
                    "the id in X-Session-Id) with Last-Event-ID")


class EventStream(Response):
    def __init__(self, events: AsyncIterator[ServerSentEvent], *, ping_sec: float, draining: Draining,
                 headers: Mapping[str, str] | None = None, send_timeout_sec: float = SEND_TIMEOUT_SEC,
                 status_code: int = 200,  # FastAPI's docs read the status from this signature
                 when_stopped: str = RESUME_ELSEWHERE) -> None:
        self.status_code = status_code
        # Set here, not on the class: the API document takes a response class's
        # media type for its error answers too, and those are JSON.
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no",
                           **(headers or {})})
        self._events = events
        self._ping_sec = ping_sec
        self._draining = draining
        self._when_stopped = when_stopped
        self._send_timeout_sec = send_timeout_sec
        #: When the frame being sent started to be (``time.monotonic``); None between frames.
        self._sending_since: float | None = None
        #: The events ran out and the response was ended.
        self._finished = False
        #: A frame with an ``id:`` went out (the ping's form depends on it).
        self._ids_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope.get("method") == "HEAD":  # headers only: a stream that never ends would hang HEAD
            await self._close_events()
            await send({"type": "http.response.body", "body": b""})
            return
        failure: BaseException | None = None
        async with anyio.create_task_group() as tasks:
            def ending(part: Callable[[], Awaitable[object]]) -> Callable[[], Coroutine[Any, Any, None]]:
                async def run() -> None:
                    nonlocal failure
                    try:
                        await part()
                    except Exception as exc:  # raised below, once the other parts stopped
                        failure = exc
                    tasks.cancel_scope.cancel()
                return run

            tasks.start_soon(ending(lambda: self._stream(send)))
            tasks.start_soon(ending(lambda: self._until_disconnected(receive)))
            tasks.start_soon(ending(self._draining.grace_over))
            tasks.start_soon(ending(lambda: self._watch(send)))
        if failure is not None:
            raise failure
        if not self._finished and self._draining.closing.is_set():
            # The server is stopping before the answer ended: say so, then end. A bare end
            # would read as a complete answer (OpenAI's SDKs take it so).
            stopping = errors.ReplicaStopping(f"this replica is stopping before the answer ended; {self._when_stopped}",
                                              resumable=True)
            with anyio.move_on_after(1):
                await send({"type": "http.response.body", "more_body": True,
                            "body": FrameEvent(data=stopping.envelope_json(), event="error").encode()})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, send: Send) -> None:
        try:
            async for event in self._events:
                self._ids_sent = self._ids_sent or event.id is not None
                await self._send(send, event.encode())
        finally:
            # Cancelled while sending, the generator still waits at its yield:
            # close it, so its clean-up runs (shielded: the stream was cancelled).
            with anyio.move_on_after(CLEANUP_TIMEOUT_SEC, shield=True):
                await self._close_events()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._finished = True

    async def _close_events(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _send(self, send: Send, body: bytes) -> None:
        self._sending_since = time.monotonic()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        self._sending_since = None

    @staticmethod
    async def _until_disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _watch(self, send: Send) -> None:
        """Keep-alive comments, and the end of a stream whose client stopped reading.

        Frames' sends are only timed (two clock reads); this looks at them
        every few seconds. A ping is sent only between frames, and bounded.
        """
        check_sec = min(self._ping_sec, self._send_timeout_sec / 2)
        last_ping = time.monotonic()
        while True:
            await anyio.sleep(check_sec)
            now = time.monotonic()
            if self._sending_since is not None:
                if now - self._sending_since > self._send_timeout_sec:
                    logger.warning("SSE client read nothing for %.0f s: stream closed", now - self._sending_since)
                    return
                continue  # frames are going out, or trying to: no ping needed
            if now - last_ping >= self._ping_sec:
                last_ping = now
                ping = f": ping - {datetime.now(UTC)}\n".encode() if self._ids_sent else b"\n"  # see the docstring
                with anyio.move_on_after(self._send_timeout_sec) as bounded:
                    await send({"type": "http.response.body", "body": ping, "more_body": True})
                if bounded.cancel_called:
                    logger.warning("SSE client read nothing for %.0f s: stream closed", self._send_timeout_sec)
                    return
