"""A watch on the test session's event loop, from a thread: when the loop stops turning, say why.

CI once saw every Redis call of the test process time out (10 s) at once
(issue 29, item 12). Three causes fit that: the loop did not run (a call
holding it, or the interpreter lock held by another thread), Redis did not
answer (a slow script, the shared test Redis busy), or the machine gave the
process no CPU. A coroutine cannot tell them apart (it is stalled too); a
thread can. Every ``CHECK_SEC`` it compares the loop's last turn with the
clock, and once the loop is more than ``STALL_SEC`` late it writes, once per
stall: what the loop's thread is doing (its stack), the other threads, how
long a PING to the test Redis takes from here (a thread of its own, a
connection of its own), and how much CPU the process got meanwhile. The
report goes to stderr and to ``$OMNI_GATEWAY_STALL_LOG`` when set.

The cause found (issue 29): the session engine's start ran on the loop,
41 s without a turn; it now runs on a thread (omni_adapter/vllm_engine.py)
and tests/omni_adapter/test_vllm_engine.py holds the loop's lateness during
the start under a second. The watch stays, to name the next one.

Used by tests/conftest.py: it starts the watch on the session's loop (one
loop for the whole session, pyproject's ``asyncio_*_loop_scope``).
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import threading
import time
import traceback

import redis

#: How often the thread looks, and how late the loop must be to be reported.
CHECK_SEC = 0.5
STALL_SEC = 2.0


class StallWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, redis_url: str | None) -> None:
        self._loop = loop
        self._redis_url = redis_url
        self._last_turn = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        #: Stalls seen (a test of this module reads them).
        self.reports: list[str] = []

    def start(self) -> None:
        self._loop.call_soon(self._turn)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _turn(self) -> None:
        self._last_turn = time.monotonic()
        if not self._stop.is_set():
            self._loop.call_later(CHECK_SEC / 2, self._turn)

    def _watch(self) -> None:
        reported_turn = 0.0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        while not self._stop.wait(CHECK_SEC):
            late = time.monotonic() - self._last_turn
            if late < STALL_SEC or reported_turn == self._last_turn or not self._loop.is_running():
                usage = resource.getrusage(resource.RUSAGE_SELF)
                continue
            reported_turn = self._last_turn
            now = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (now.ru_utime - usage.ru_utime) + (now.ru_stime - usage.ru_stime)
            report = self.report(late, cpu)
            self.reports.append(report)
            sys.stderr.write(report)
            if path := os.environ.get("OMNI_GATEWAY_STALL_LOG"):
                with open(path, "a") as log:
                    log.write(report)

    def report(self, late: float, cpu_sec: float) -> str:
        frames = sys._current_frames()
        loop_thread = getattr(self._loop, "_thread_id", None)
        lines = [f"\n=== stall watch: the event loop has not turned for {late:.1f} s "
                 f"(process CPU meanwhile: {cpu_sec:.2f} s; load {os.getloadavg()[0]:.1f}); "
                 f"Redis PING from a thread: {self._ping()}\n"]
        for thread in threading.enumerate():
            frame = frames.get(thread.ident or -1)
            if frame is None or thread is threading.current_thread():
                continue
            mark = " (the event loop's)" if thread.ident == loop_thread else ""
            stack = "".join(traceback.format_list(traceback.extract_stack(frame))[-(16 if mark else 4):])
            lines.append(f"--- thread {thread.name}{mark}\n{stack}")
        return "".join(lines)

    def _ping(self) -> str:
        if not self._redis_url:
            return "no test Redis"
        started = time.monotonic()
        try:
            with redis.Redis.from_url(self._redis_url, socket_timeout=5) as client:
                client.ping()
        except redis.RedisError as exc:
            return f"failed after {time.monotonic() - started:.2f} s ({exc})"
        return f"{(time.monotonic() - started) * 1000:.1f} ms"
