"""Load shedding: a saturated process answers ``503 overloaded`` at once, new work first.

Past its capacity a process's queue only grows: every request waits behind
all the others, latency explodes for everyone, and in the end calls time out
against Redis and are misreported as ``store_unavailable``. Refusing the
excess early, before any work, keeps the accepted calls fast and tells
clients plainly to come back (``Retry-After``). A refused call did nothing,
so nothing acknowledged is ever lost; a client resends with the same
sequence id.

Two signals, both of this process (every API worker has its own):

- **in flight**: the session API's short calls whose body has arrived and
  that are not answered yet. A body still arriving costs nothing but a
  socket (``bounded_body.py`` gives it a deadline), so slow senders never
  fill the count. Calls that wait by design (``/events`` and ``/result`` of
  a session, the chat and upload routes waiting on the engine, WebSockets)
  are not counted: their number says nothing about the CPU.
- **event-loop lag**: how late a timer fires. It covers every kind of work
  (relays, runners, tokenizing threads holding the GIL), counted or not.

What is refused first is **new work**: a new session (create, chat, upload)
and, through ``sheds_new_work``, a new engine start. Calls on a session
that exists (append, finish, replace, reads, cancel) keep it alive and
cost half a millisecond: lag never refuses them (the lag is often that very
session's work: recognizing its audio, relaying its answer), and in-flight
pressure refuses them only at ``SESSION_CALLS_HEADROOM`` times the cap new
work gets. Operations routes (``/healthz``, ``/readyz``, ``/metrics``, vLLM's probes) are
never shed: a probe must see the process, not its load.
"""

from __future__ import annotations

import asyncio
import enum
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.web.error_handlers import render_error

#: How often the loop's lag is sampled.
LAG_SAMPLE_SEC = 0.02
#: The paths that are never shed.
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/health", "/ping", "/version"})
SESSIONS_PATH = "/v1/streaming_input/sessions"
WAITING_SUFFIXES = ("/events", "/result")
#: Calls on existing sessions are refused only past this many times ``max_in_flight``.
SESSION_CALLS_HEADROOM = 2


class Call(enum.Enum):
    """What a request is, for shedding."""

    #: Operations routes: never shed.
    OPS = "ops"
    #: Creates a session (or anything that is not a session's own call): shed first.
    NEW = "new"
    #: A call on a session that exists: shed last, never for lag.
    SESSION = "session"


def classify(path: str) -> Call:
    if path in OPS_PATHS:
        return Call.OPS
    if path.startswith(SESSIONS_PATH + "/"):  # /sessions/{id}...: a session that exists (or a 404)
        return Call.SESSION
    return Call.NEW  # create, chat, upload; /v1/models and the rest are cheap either way


def counted(path: str) -> bool:
    """Short calls of the session API (create, append, finish, view...), not its waiting routes."""
    return path.startswith(SESSIONS_PATH) and not path.endswith(WAITING_SUFFIXES)


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

    @property
    def lagging(self) -> bool:
        return bool(self.max_loop_lag_sec) and self.loop_lag_sec > self.max_loop_lag_sec

    def sheds_new_work(self) -> bool:
        """New sessions and new engine starts wait: the loop runs late or the calls pile up."""
        return self.lagging or bool(self.max_in_flight) and self.in_flight >= self.max_in_flight

    def refusal(self, call: Call, counted: bool = True) -> errors.Overloaded | None:
        """Why a new call is refused now, or ``None`` to take it. ``counted``: the call
        would count in flight (waiting routes do not, and are not refused for it)."""
        if call is Call.OPS:
            return None
        if call is Call.NEW and self.lagging:
            return errors.Overloaded(
                f"this replica is overloaded (event loop {self.loop_lag_sec * 1000:.0f} ms behind); retry shortly")
        cap = self.max_in_flight * (SESSION_CALLS_HEADROOM if call is Call.SESSION else 1)
        if counted and cap and self.in_flight >= cap:
            return errors.Overloaded(
                f"this replica is overloaded ({self.in_flight} calls in flight); retry shortly")
        return None

    async def watch(self, sample_sec: float = LAG_SAMPLE_SEC) -> None:
        """Background task (the lifespan's): measure how late a short sleep wakes up."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(sample_sec)
            self.loop_lag_sec = max(0.0, time.perf_counter() - started - sample_sec)


def has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


class AdmissionMiddleware:
    """Pure ASGI: refuse before the body is read or any route runs; count a call from the
    moment its body has arrived until its answer starts."""

    def __init__(self, app: ASGIApp, *, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        is_counted = counted(path)
        refusal = self.admission.refusal(classify(path), is_counted)
        if refusal is not None:
            await _refuse(refusal, scope, send)
            return
        if not is_counted:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        # 0: not counted yet (its body is arriving); 1: counted; 2: counted and let go.
        state = 0

        def count() -> None:
            nonlocal state
            if state == 0:
                state = 1
                admission.in_flight += 1

        def uncount() -> None:
            nonlocal state
            if state == 1:
                admission.in_flight -= 1
            state = 2

        async def receive_counted() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                count()
            return message

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                uncount()
            await send(message)

        if not has_body(scope):
            count()
        try:
            await self.app(scope, receive_counted, send_counted)
        finally:
            uncount()


async def _refuse(error: errors.Overloaded, scope: Scope, send: Send) -> None:
    resources = scope.get("state", {}).get("resources")
    if resources is not None:
        resources.metrics.errors.labels(error.code).inc()
    await render_error(error, send)
