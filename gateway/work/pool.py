"""The runners of this replica: one task per session whose lease it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gateway.domain.scheduling import Room
from gateway.store.records import Lease
from gateway.work.runner import SessionRunner


class RunnerPool:
    """The runners of this replica, one task per session it holds the lease on.

    ``capacity`` bounds the engine sessions this replica runs at once, and
    ``listening_cap`` those of them still listening (input not complete):
    the difference is kept for answers. Work beyond either waits in Redis
    for any replica with room (the tender takes it in policy order).

    Room is taken synchronously (``reservation``) before the store call that
    may take a lease, and held until the runner is registered: otherwise a
    burst of calls all saw room while the first of them was still waiting on
    Redis (200 chats at once started 200 engine sessions against a cap of 64).
    """

    def __init__(self, make_runner: Callable[[str, Lease], SessionRunner], capacity: int,
                 listening_cap: int | None = None) -> None:
        self._make_runner = make_runner
        self._capacity = capacity
        self._listening_cap = capacity if listening_cap is None else min(listening_cap, capacity)
        self._runners: dict[str, SessionRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Leases taken while the session's previous runner was still ending
        #: (a parked session resumed at once): started when it has ended.
        self._next_lease: dict[str, Lease] = {}
        #: Set whenever a runner ends: room for waiting work.
        self.freed = asyncio.Event()
        #: Room held by calls (and tender claims) between deciding to take work and starting its runner.
        self._reserved = 0
        self._reserved_listening = 0

    @property
    def room(self) -> Room:
        return Room(total=max(0, self._capacity - len(self._tasks) - self._reserved),
                    listening=max(0, self._listening_cap - self.listening - self._reserved_listening))

    @contextmanager
    def reservation(self, *, listening: bool) -> Iterator[bool]:
        """Hold one slot (a listening one too, if ``listening``) while a claim is under way.

        Yields whether there was room. Start the runner inside the block: the
        slot then passes from the reservation to the runner with no gap.
        """
        room = self.room
        held = room.total > 0 and (not listening or room.listening > 0)
        if held:
            self._reserved += 1
            self._reserved_listening += listening
        try:
            yield held
        finally:
            if held:
                self._reserved -= 1
                self._reserved_listening -= listening

    @property
    def listening(self) -> int:
        return sum(1 for runner in self._runners.values() if runner.listening)

    def start(self, session_id: str, lease: Lease) -> None:
        if session_id in self._tasks:
            if lease.epoch > self._runners[session_id].lease.epoch:
                self._next_lease[session_id] = lease
            return
        runner = self._make_runner(session_id, lease)
        task = asyncio.create_task(runner.run(), name=f"run-{session_id}")
        self._runners[session_id] = runner
        self._tasks[session_id] = task
        task.add_done_callback(lambda _: self._ended(session_id))

    def make_room(self, answers: int) -> int:
        """Park up to ``answers`` listening sessions, the longest idle first, so
        input-complete work that waits can run. Returns how many were asked."""
        if answers <= 0 or self.room.total > 0:
            return 0
        idle = sorted((r for r in self._runners.values() if r.listening and not r.parking),
                      key=lambda r: r.last_input_at)
        for runner in idle[:answers]:
            runner.park_soon()
        return len(idle[:answers])

    def _ended(self, session_id: str) -> None:
        self._tasks.pop(session_id, None)
        self._runners.pop(session_id, None)
        if (lease := self._next_lease.pop(session_id, None)) is not None:
            self.start(session_id, lease)
        self.freed.set()

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self, grace_sec: float = 0.0) -> None:
        """Let runners finish for up to ``grace_sec``, then hand the rest to other replicas."""
        tasks = list(self._tasks.values())
        if tasks and grace_sec > 0:
            await asyncio.wait(tasks, timeout=grace_sec)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
