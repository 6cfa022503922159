"""Load shedding: a saturated process answers ``503 overloaded`` at once.

Past its capacity a process's queue only grows: every request waits behind
all the others, latency explodes for everyone, and in the end calls time out
against Redis and are misreported as ``store_unavailable``. Refusing the
excess early, before any work, keeps the accepted calls fast and tells
clients plainly to come back (``Retry-After``). A refused call did nothing,
so nothing acknowledged is ever lost; a client resends with the same
sequence id.

Two signals, both of this process (every API worker has its own):

- **in flight**: the session API's short calls received and not yet
  answered. Calls that wait by design (``/events`` and ``/result`` of a
  session, the chat and upload routes waiting on the engine, WebSockets) are
  not counted: their number says nothing about the CPU.
- **event-loop lag**: how late a timer fires. It covers every kind of work
  (relays, runners, tokenizing threads holding the GIL), counted or not.

Operations routes (``/healthz``, ``/readyz``, ``/metrics``) are never shed:
a probe must see the process, not its load.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.web.error_handlers import render_error

#: How often the loop's lag is sampled.
LAG_SAMPLE_SEC = 0.02
#: The paths that are never shed.
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
#: Counted calls: the session API, but not its waiting routes.
COUNTED_PREFIX = "/v1/streaming_input/sessions"
WAITING_SUFFIXES = ("/events", "/result")


class Admission:
    """This process's load: requests in flight and the event loop's lag."""

    def __init__(self, max_in_flight: int, max_loop_lag_sec: float) -> None:
        #: 0: no cap on requests in flight.
        self.max_in_flight = max_in_flight
        #: 0: lag never sheds.
        self.max_loop_lag_sec = max_loop_lag_sec
        self.in_flight = 0
        #: The last lag measured; ``watch`` keeps it current.
        self.loop_lag_sec = 0.0

    def refusal(self, counted: bool) -> errors.Overloaded | None:
        """Why a new call is refused now, or ``None`` to take it."""
        if self.max_loop_lag_sec and self.loop_lag_sec > self.max_loop_lag_sec:
            return errors.Overloaded(
                f"this replica is overloaded (event loop {self.loop_lag_sec * 1000:.0f} ms behind); retry shortly")
        if counted and self.max_in_flight and self.in_flight >= self.max_in_flight:
            return errors.Overloaded(
                f"this replica is overloaded ({self.in_flight} calls in flight); retry shortly")
        return None

    async def watch(self, sample_sec: float = LAG_SAMPLE_SEC) -> None:
        """Background task (the lifespan's): measure how late a short sleep wakes up."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(sample_sec)
            self.loop_lag_sec = max(0.0, time.perf_counter() - started - sample_sec)


def counted(path: str) -> bool:
    return path.startswith(COUNTED_PREFIX) and not path.endswith(WAITING_SUFFIXES)


class AdmissionMiddleware:
    """Pure ASGI: refuse before the body is read or any route runs; count until the answer starts."""

    def __init__(self, app: ASGIApp, *, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        count = counted(scope["path"])
        refusal = self.admission.refusal(count)
        if refusal is not None:
            await _refuse(refusal, scope, send)
            return
        if not count:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        admission.in_flight += 1
        answered = False

        async def send_counted(message: Message) -> None:
            nonlocal answered
            if not answered and message["type"] == "http.response.start":
                answered = True
                admission.in_flight -= 1
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not answered:
                admission.in_flight -= 1


async def _refuse(error: errors.Overloaded, scope: Scope, send: Send) -> None:
    resources = scope.get("state", {}).get("resources")
    if resources is not None:
        resources.metrics.errors.labels(error.code).inc()
    await render_error(error, send)
