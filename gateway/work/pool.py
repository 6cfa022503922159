"""The runners of this replica: one task per session whose lease it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.store.records import Lease
from gateway.work.runner import SessionRunner


class RunnerPool:
    """The runners of this replica, one task per session it holds the lease on.

    ``capacity`` bounds the engine sessions this replica runs at once; work
    beyond it waits in Redis for any replica with room.
    """

    def __init__(self, make_runner: Callable[[str, Lease], SessionRunner], capacity: int) -> None:
        self._make_runner = make_runner
        self._capacity = capacity
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set whenever a runner ends: room for waiting work.
        self.freed = asyncio.Event()

    @property
    def room(self) -> int:
        return max(0, self._capacity - len(self._tasks))

    def start(self, session_id: str, lease: Lease) -> None:
        if session_id in self._tasks:
            return
        task = asyncio.create_task(self._make_runner(session_id, lease).run(), name=f"run-{session_id}")
        self._tasks[session_id] = task
        task.add_done_callback(lambda _: self._ended(session_id))

    def _ended(self, session_id: str) -> None:
        self._tasks.pop(session_id, None)
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
