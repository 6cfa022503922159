"""The tender: every replica's background round over the schedule.

Each round expires idle sessions and claims engine work that has no live
owner (a lapsed lease, work nobody had room for) while this replica has
room. The decisions are ``tend.lua``'s, made on each session's own hash;
the schedule is only a hint of when to look.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from gateway import errors
from gateway.domain.scheduling import SchedulePolicy
from gateway.metrics import Metrics
from gateway.store.redis_store import SessionStore
from gateway.work.draining import Draining
from gateway.work.pool import RunnerPool

logger = logging.getLogger(__name__)

#: The tender's waits after consecutive failures, so a sick Redis is not hammered.
TENDER_BACKOFF_SEC = (0.5, 1.0, 2.0, 5.0)
#: How often a round also looks over a stretch of the global cap (``SessionStore.sweep_slots``),
#: and how many entries; each replica starts at a random place, so they share the walk.
SWEEP_EVERY_SEC = 5.0
SWEEP_ENTRIES = 100
#: An entry whose session has no keys is dropped only if it has none this much later still:
#: ``admit`` comes a moment before ``create`` makes them.
GONE_GRACE_SEC = 10.0
#: Entries remembered as seen with no keys, at most.
MAX_GONE_KEPT = 10_000


class Tender:
    def __init__(self, store: SessionStore, runners: RunnerPool, metrics: Metrics, draining: Draining,
                 replica_id: str, policy: SchedulePolicy = SchedulePolicy.FCFS,
                 sheds_new_work: Callable[[], bool] = lambda: False) -> None:
        self._store = store
        #: This process is too busy to start engine work now: claim none this round.
        self._sheds_new_work = sheds_new_work
        self._policy = policy
        self._runners = runners
        self._metrics = metrics
        self._draining = draining
        self._replica_id = replica_id
        #: The sweep of the global cap: where it goes on, when it runs next, entries seen with no keys.
        self._sweep_at = random.randrange(1_000_000)
        self._next_sweep = time.monotonic() + random.uniform(0, SWEEP_EVERY_SEC)
        self._gone_since: dict[str, float] = {}
        self._expired = errors.SessionExpired("the session expired after being idle").envelope_json()
        # tend.lua fills in the ids; it only knows them at that moment.
        self._incomplete = errors.IncompleteInput(
            "input was not complete when the session timed out", missing_sequence_ids="__MISSING__",
        ).envelope_json().replace('"__MISSING__"', "[__MISSING__]")

    async def tend(self) -> None:
        """One round: expire idle sessions; take engine work that has no live owner while there is
        room, in policy order; park listening sessions when answers wait for room."""
        tended = await self._store.tend(self._expired, self._incomplete, self._policy)
        for ended in tended.ended:
            self._metrics.transition(ended.previous_state, ended.state)
        quarantined = list(tended.quarantined)
        answers_waiting = 0
        taking = not self._draining.active and not self._sheds_new_work()
        for work in tended.waiting:
            # Room is held from the decision to the runner's start: calls racing this
            # round (they take room too) can never push the replica past its caps.
            with self._runners.reservation(listening=not work.answering) as held:
                if not (taking and held):
                    answers_waiting += work.answering
                    continue
                try:
                    lease = await self._store.claim(work.session_id, self._replica_id)
                except Exception as exc:
                    quarantined.append(await self._store.quarantine(work.session_id, exc))
                    continue
                if lease is not None:
                    self._runners.start(work.session_id, lease)
        for bad in quarantined:
            self._metrics.sessions_quarantined.labels("dead" if bad.dead else "retry").inc()
            if bad.dead:
                logger.error("tender: session %s failed its script %d times; out of the schedule for good "
                             "(dead letter): %s", bad.session_id, bad.failures, bad.error)
            else:
                logger.warning("tender: session %s failed its script (%d so far); looked at again later: %s",
                               bad.session_id, bad.failures, bad.error)
        self._metrics.answers_waiting.set(answers_waiting)
        if answers_waiting and not self._draining.active:
            self._runners.make_room(answers_waiting)
        listening = self._runners.listening
        self._metrics.engine_sessions.labels("listening").set(listening)
        self._metrics.engine_sessions.labels("answering").set(len(self._runners) - listening)
        if time.monotonic() >= self._next_sweep:
            await self.sweep_slots()

    async def sweep_slots(self) -> None:
        """Free the cap slots that no release freed (``SessionStore.sweep_slots``)."""
        self._next_sweep = time.monotonic() + SWEEP_EVERY_SEC
        sweep = await self._store.sweep_slots(self._sweep_at, SWEEP_ENTRIES)
        self._sweep_at = sweep.next_start
        now = time.monotonic()
        for entry in sweep.live:  # made after all
            self._gone_since.pop(entry, None)
        expired = [entry for entry in sweep.gone if now - self._gone_since.setdefault(entry, now) >= GONE_GRACE_SEC]
        if expired:
            await self._store.drop_slot_entries(expired)
            for entry in expired:
                del self._gone_since[entry]
        while len(self._gone_since) > MAX_GONE_KEPT:  # the oldest suspects go first
            del self._gone_since[next(iter(self._gone_since))]
        if sweep.freed or expired:
            self._metrics.slots_healed.inc(sweep.freed + len(expired))
            logger.info("tender: freed the cap slots of %d ended and %d vanished sessions that no release "
                        "had freed", sweep.freed, len(expired))

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
