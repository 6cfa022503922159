"""A Realtime connection's own event budget, kept in the process.

A voice client sends an audio event every 20-100 ms; charging each to the
identity's REST bucket in Redis cost a store call per frame and closed the
sockets of a second voice user on the same key. Instead the identity's
bucket is charged per connection and per turn (the calls that start engine
work), and each connection has this budget for its events, sized for 50
audio frames a second plus the rest; an event over it gets an ``error``
event and the socket stays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class EventBudget:
    """A token bucket: ``rate`` events a second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self) -> bool:
        """One event's worth, if there is one."""
        if self.rate <= 0:
            return True
        self._refill()
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def rate_limit(self) -> dict[str, float | int | str]:
        """OpenAI's ``rate_limits.updated`` entry for it."""
        self._refill()
        missing = self.burst - self._tokens
        return {"name": "requests", "limit": self.burst, "remaining": math.floor(self._tokens),
                "reset_seconds": round(missing / self.rate, 3) if self.rate > 0 else 0.0}
