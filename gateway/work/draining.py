"""The replica's shutdown flag, flipped by SIGTERM before anything closes.

While draining, ``/readyz`` answers 503 (load balancers stop sending new
calls) and the replica claims no new engine work. Once the server itself
stops (after the drain period), ``closing`` is set, and ``grace_sec`` runs
from that moment: the sessions it runs may finish, and open SSE streams run
on (to ``[DONE]``, most of them); at its end a stream still open ends with
an explicit ``error`` event (``replica_stopping``), never as if the answer
were complete, and the sessions still running are released to other
replicas, where the client resumes the stream with ``Last-Event-ID``.

A replica also stops on its own when it cannot go on (``fail``: its engine
died, gateway/work/engine_death.py): no drain period then, and the process exits
non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Draining:
    def __init__(self, grace_sec: float = 0.0) -> None:
        self.active = False
        #: Set on the event loop when the server stops (``close``).
        self.closing = asyncio.Event()
        #: How long streams and owned sessions go on once ``closing`` is set.
        self.grace_sec = grace_sec
        self._closed_at: float | None = None
        #: Why the replica stopped on its own (``fail``); the process then exits non-zero.
        self.failure: str | None = None
        #: Stops the server (set by the server that serves this replica; none in tests).
        self.stop_server: Callable[[], None] | None = None

    def begin(self) -> None:
        if not self.active:
            self.active = True
            logger.info("draining: not ready, taking no new engine work")

    def close(self) -> None:
        """The server stops now (call on its event loop)."""
        self.begin()
        if self._closed_at is None:
            self._closed_at = time.monotonic()
        self.closing.set()

    def grace_left(self) -> float:
        """Seconds left of the grace period (all of it while the server has not begun to stop)."""
        if self._closed_at is None:
            return self.grace_sec
        return max(0.0, self._closed_at + self.grace_sec - time.monotonic())

    async def grace_over(self) -> None:
        """Returns once the server stops and its grace period has run out."""
        await self.closing.wait()
        await asyncio.sleep(self.grace_left())

    def fail(self, reason: str) -> None:
        """Stop this replica now, for ``reason``: it cannot go on (call on its event loop)."""
        if self.failure is None:
            self.failure = reason
            logger.error("stopping this replica: %s", reason)
        self.begin()
        if self.stop_server is not None:
            self.stop_server()
