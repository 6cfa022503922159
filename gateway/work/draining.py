"""The replica's shutdown flag, flipped by SIGTERM before anything closes.

While draining, ``/readyz`` answers 503 (load balancers stop sending new
calls) and the replica claims no new engine work; the sessions it runs get a
grace period to finish and are then released to other replicas. Once the
server itself stops (after the drain period), ``closing`` is set: open SSE
streams end, so their clients reconnect to another replica.

A replica also stops on its own when it cannot go on (``fail``: its engine
died, gateway/work/engine_death.py): no drain period then, and the process exits
non-zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Draining:
    def __init__(self) -> None:
        self.active = False
        #: Set on the event loop when the server stops (``close``).
        self.closing = asyncio.Event()
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
        self.closing.set()

    def fail(self, reason: str) -> None:
        """Stop this replica now, for ``reason``: it cannot go on (call on its event loop)."""
        if self.failure is None:
            self.failure = reason
            logger.error("stopping this replica: %s", reason)
        self.begin()
        if self.stop_server is not None:
            self.stop_server()
