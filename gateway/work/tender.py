"""The tender: every replica's background round over the schedule.

Each round expires idle sessions and claims engine work that has no live
owner (a lapsed lease, work nobody had room for) while this replica has
room. The decisions are ``tend.lua``'s, made on each session's own hash;
the schedule is only a hint of when to look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway import errors
from gateway.domain.scheduling import Room, SchedulePolicy
from gateway.draining import Draining
from gateway.metrics import Metrics
from gateway.store.redis_store import SessionStore
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
        """Background task: tend every ``interval_sec``, and whenever a runner ends.

        It must never die while the replica lives (expiry, claims and failover
        depend on it), so every failure is logged, counted and followed by a
        back-off; the next round starts afresh. ``/readyz`` fails if it ended.
        """
        failures = 0
        while True:
            self._runners.freed.clear()
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
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the
            # cancel that stops this task when the event fires at the same time.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_sec):
                    await self._runners.freed.wait()
