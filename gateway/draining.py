"""The replica's shutdown flag, flipped by SIGTERM before anything closes.

While draining, ``/readyz`` answers 503 (load balancers stop sending new
calls) and the replica claims no new engine work; the sessions it runs get a
grace period to finish and are then released to other replicas. Once the
server itself stops (after the drain period), ``closing`` is set: open SSE
streams end, so their clients reconnect to another replica.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class Draining:
    def __init__(self) -> None:
        self.active = False
        #: Set on the event loop when the server stops (``close``).
        self.closing = asyncio.Event()

    def begin(self) -> None:
        if not self.active:
            self.active = True
            logger.info("draining: not ready, taking no new engine work")

    def close(self) -> None:
        """The server stops now (call on its event loop)."""
        self.begin()
        self.closing.set()
