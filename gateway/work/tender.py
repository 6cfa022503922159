"""The tender: every replica's background round over the schedule.

Each round expires idle sessions and claims engine work that has no live
owner (a lapsed lease, work nobody had room for) while this replica has
room. The decisions are ``tend.lua``'s, made on each session's own hash;
the schedule is only a hint of when to look.
"""

from __future__ import annotations

import asyncio
import logging

from gateway import errors
from gateway.domain.scheduling import Room, SchedulePolicy
from gateway.metrics import Metrics
from gateway.store.redis_store import SessionStore
from gateway.work.draining import Draining
from gateway.work.pool import RunnerPool

logger = logging.getLogger(__name__)

#: The tender's waits after consecutive failures, so a sick Redis is not hammered.
TENDER_BACKOFF_SEC = (0.5, 1.0, 2.0, 5.0)


class Tender:
    def __init__(self, store: SessionStore, runners: RunnerPool, metrics: Metrics, draining: Draining,
                 replica_id: str, policy: SchedulePolicy = SchedulePolicy.FCFS) -> None:
        self._store = store
        self._policy = policy
        self._runners = runners
        self._metrics = metrics
        self._draining = draining
        self._replica_id = replica_id
        self._expired = errors.SessionExpired("the session expired after being idle").envelope_json()
        # tend.lua fills in the ids; it only knows them at that moment.
        self._incomplete = errors.IncompleteInput(
            "input was not complete when the session timed out", missing_sequence_ids="__MISSING__",
        ).envelope_json().replace('"__MISSING__"', "[__MISSING__]")

    async def tend(self) -> None:
        """One round: expire idle sessions; take engine work that has no live owner while there is
        room, in policy order; park listening sessions when answers wait for room."""
        room = Room(0, 0) if self._draining.active else self._runners.room
        tended = await self._store.tend(self._expired, self._incomplete, self._replica_id, room, self._policy)
        for outcome in tended.outcomes:
            if outcome.lease is not None:
                self._runners.start(outcome.session_id, outcome.lease)
            else:
                self._metrics.transition(outcome.previous_state, outcome.state)
        self._metrics.answers_waiting.set(tended.answers_waiting)
        if tended.answers_waiting and not self._draining.active:
            self._runners.make_room(tended.answers_waiting)
        listening = self._runners.listening
        self._metrics.engine_sessions.labels("listening").set(listening)
        self._metrics.engine_sessions.labels("answering").set(len(self._runners) - listening)

    async def run(self, interval_sec: float) -> None:
        """Background task: tend every ``interval_sec``, whenever a runner ends,
        and whenever another process announces work waiting for an owner.

        It must never die while the replica lives (expiry, claims and failover
        depend on it), so every failure is logged, counted and followed by a
        back-off; the next round starts afresh. ``/readyz`` fails if it ended.
        """
        announced = asyncio.Event()
        listener = asyncio.create_task(self._listen(announced), name="tender-listener")
        try:
            await self._rounds(interval_sec, announced)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _rounds(self, interval_sec: float, announced: asyncio.Event) -> None:
        failures = 0
        while True:
            self._runners.freed.clear()
            announced.clear()
            try:
                await self.tend()
            except Exception as exc:
                backoff = max(interval_sec, TENDER_BACKOFF_SEC[min(failures, len(TENDER_BACKOFF_SEC) - 1)])
                failures += 1
                self._metrics.tender_failures.labels(getattr(exc, "code", type(exc).__name__)).inc()
                if isinstance(exc, errors.StoreUnavailable):
                    logger.warning("tender: %s; retrying in %.1f s", exc.message, backoff)
                else:
                    logger.exception("tender: a round failed; retrying in %.1f s", backoff)
                await asyncio.sleep(backoff)
                continue
            if failures:
                logger.info("tender: tending again after %d failed rounds", failures)
                failures = 0
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow the
            # cancel that stops this task when an event fires at the same time.
            waiters = [asyncio.ensure_future(self._runners.freed.wait()), asyncio.ensure_future(announced.wait())]
            try:
                await asyncio.wait(waiters, timeout=interval_sec, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    async def _listen(self, announced: asyncio.Event) -> None:
        """Set ``announced`` when any process announces work waiting for an owner.

        Only a shortcut: a round every ``interval_sec`` finds the same work in
        the schedule, so a broken subscription is retried after a back-off
        and never fails the tender.
        """
        failures = 0
        while True:
            reason = "the subscription ended"
            try:
                async for _ in self._store.work_waiting():
                    failures = 0
                    if not self._draining.active:
                        announced.set()
            except Exception as exc:
                reason = str(getattr(exc, "message", exc))
            backoff = TENDER_BACKOFF_SEC[min(failures, len(TENDER_BACKOFF_SEC) - 1)]
            failures += 1
            logger.warning("tender: the work announcements stopped (%s); again in %.1f s", reason, backoff)
            await asyncio.sleep(backoff)
