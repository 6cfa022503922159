"""Bounded requests, for every route, before any route code runs.

Headers over ``max_header_bytes`` in total are refused (431): the HTTP server
has already parsed them, but no route or log line will carry them further.

A pure ASGI middleware: a declared ``Content-Length`` over the limit is
refused unread; a body that grows past it while streaming in is refused as
soon as it does (the rest is never read, so a 1 GiB upload costs no more
memory than the limit); a client that stops sending mid-body is timed out;
and a whole body has a deadline: ``body_timeout_sec`` from the request's
start, plus a second for every ``min_bytes_per_sec`` that arrived (a big
body may take longer, a trickle of a byte now and then may not hold a
socket for ever). The limits apply only while the body is arriving:
afterwards ``receive`` is passed through untouched (SSE waits on it for the
disconnect).

A streamed upload (Mode A, ``streamed_paths``) is a session's whole input:
its body has no total cap here (each record is capped as it is read, and the
session's own caps apply) and may pause as long as a session may idle.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import errors
from gateway.web.error_handlers import render_error


class BoundedBodyMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, idle_timeout_sec: float,
                 max_header_bytes: int, streamed_paths: frozenset[str] = frozenset(),
                 streamed_idle_sec: float = 0.0, body_timeout_sec: float = 0.0,
                 min_bytes_per_sec: int = 0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: 0: no deadline for the whole body (only ``idle_timeout_sec`` between its parts).
        self.body_timeout_sec = body_timeout_sec
        self.min_bytes_per_sec = min_bytes_per_sec
        self.max_header_bytes = max_header_bytes
        self.idle_timeout_sec = idle_timeout_sec
        self.streamed_paths = streamed_paths
        self.streamed_idle_sec = streamed_idle_sec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = 0
        declared = b""
        for name, value in scope["headers"]:  # one pass: this runs on every request
            header_bytes += len(name) + len(value)
            if name == b"content-length":
                declared = value
        if header_bytes > self.max_header_bytes:
            await render_error(errors.HeadersTooLarge(
                f"request headers exceed {self.max_header_bytes} bytes"), send)
            return
        streamed = scope["path"] in self.streamed_paths
        max_bytes = 2**63 if streamed else self.max_bytes
        idle_sec = self.streamed_idle_sec if streamed else self.idle_timeout_sec
        if declared.isdigit() and int(declared) > max_bytes:
            await render_error(self._too_large(), send)
            return
        received = 0
        body_done = False
        started = time.monotonic()
        deadline = not streamed and self.body_timeout_sec > 0

        async def bounded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            wait_sec, too_slow = idle_sec, False
            if deadline:
                allowed = self.body_timeout_sec + (received / self.min_bytes_per_sec if self.min_bytes_per_sec else 0)
                left = started + allowed - time.monotonic()
                if left < wait_sec:
                    wait_sec, too_slow = max(0.0, left), True
            try:
                async with asyncio.timeout(wait_sec):
                    message = await receive()
            except TimeoutError:
                if too_slow:
                    raise errors.RequestTimeout(
                        f"the request body arrived too slowly: {received} bytes in "
                        f"{time.monotonic() - started:.0f} s") from None
                raise errors.RequestTimeout(
                    f"the request body stalled for more than {idle_sec:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, bounded_receive, send)
        except ClientDisconnect:
            if body_done:
                raise
            # The client hung up before its body ended: nobody is left to answer.

    def _too_large(self) -> errors.RequestTooLarge:
        return errors.RequestTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
