"""An event-loop watchdog for tests: how late does a short timer fire?

CPU work that runs on the event loop (tokenizing, recognizing, synthesizing)
delays every other coroutine; a timer that asks to wake every ``interval``
seconds sees that delay as lateness. Tests wrap the heavy case in
``async with LoopLagMonitor() as lag:`` and assert ``lag.max_sec`` stays
under a bound (100 ms in the issues).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from types import TracebackType


class LoopLagMonitor:
    """Measures the worst lateness of a periodic timer on the running loop."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.max_sec = 0.0
        self.samples = 0
        #: Every lateness seen, for percentiles.
        self.lateness: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval)
            late = time.perf_counter() - before - self.interval
            self.max_sec = max(self.max_sec, late)
            self.samples += 1
            self.lateness.append(late)

    def percentile(self, p: float) -> float:
        """The lateness that ``p`` percent of the timer's wake-ups stayed under."""
        ordered = sorted(self.lateness)
        return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] if ordered else 0.0

    async def __aenter__(self) -> LoopLagMonitor:
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def assert_loop_keeps_up(work: Callable[[], Awaitable[object]], bound_sec: float = 0.1,
                               tries: int = 3) -> float:
    """Run ``work`` under the watchdog until the worst lateness is under ``bound_sec``.

    Up to ``tries`` times: a busy shared machine can starve the whole process
    for a moment, while work that holds the interpreter on the loop (what
    this guards against) stalls it on every try. Returns the best worst case.
    """
    worst: list[float] = []
    for _ in range(tries):
        async with LoopLagMonitor() as lag:
            await work()
        assert lag.samples > 0
        worst.append(lag.max_sec)
        if lag.max_sec < bound_sec:
            return lag.max_sec
    raise AssertionError(f"the event loop stalled for {min(worst) * 1000:.0f} ms at best "
                         f"in {tries} tries (bound {bound_sec * 1000:.0f} ms)")
