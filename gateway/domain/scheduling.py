"""Which waiting engine work a replica takes first (Stream2LLM, seed 002 section 4).

A replica runs at most ``max_engine_sessions`` engine sessions, and at most
``max_listening_sessions`` of them may still be listening (input not
complete); the rest is room kept for answers. Started sessions beyond that
wait in Redis, ownerless, and every tender round ranks the ones that are due
and claims from the top while it has room.

Whatever the policy, work whose input is complete (``generating``) goes
first: it is the work a user is waiting on, and it frees its slot once the
answer is done. Answers go in the order their input completed, oldest first:
the engine's own queue order when input is buffered (``on_end_only``), so no
answer waits longer than it would without streaming because a policy
preferred another (ranking answers by a listening policy starved the first
ones under overload: ``lcas`` put the newest answer first). Among sessions
still listening the policy decides:

- ``fcfs``: by arrival (the session's creation), oldest first;
- ``lcas``: by last chunk arrival, newest first: fresh context is what the
  engine can use now;
- ``mcps``: by most computed prefix (tokens the engine had already taken in
  before the session was parked), most first. Stream2LLM found it the worst
  under pressure; it is here to measure, not as a default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gateway.domain.states import SessionState


class SchedulePolicy(StrEnum):
    FCFS = "fcfs"
    LCAS = "lcas"
    MCPS = "mcps"


@dataclass(frozen=True)
class WaitingWork:
    """A started session whose engine work has no owner, as the tender sees it."""

    session_id: str
    state: SessionState
    #: When the session was created (ms).
    arrived_ms: int
    #: When its last input (chunk, replacement or finish) arrived (ms).
    last_input_ms: int
    #: Input tokens the engine had taken in before the session was parked.
    computed_tokens: int

    @property
    def answering(self) -> bool:
        return self.state is SessionState.GENERATING


def ranked(waiting: Iterable[WaitingWork], policy: SchedulePolicy) -> list[WaitingWork]:
    """``waiting`` in the order a replica should take it."""

    def key(work: WaitingWork) -> tuple[int, int, int]:
        if work.answering:  # the last input of an answer is its finish
            return 0, work.last_input_ms, work.arrived_ms
        if policy is SchedulePolicy.LCAS:
            return 1, -work.last_input_ms, work.arrived_ms
        if policy is SchedulePolicy.MCPS:
            return 1, -work.computed_tokens, work.arrived_ms
        return 1, work.arrived_ms, 0

    return sorted(waiting, key=key)


@dataclass(frozen=True)
class Room:
    """What a replica can still take: engine sessions at all, and listening ones."""

    total: int
    listening: int

    def fits(self, work: WaitingWork) -> bool:
        return self.total > 0 and (work.answering or self.listening > 0)

    def taken(self, work: WaitingWork) -> Room:
        return Room(self.total - 1, self.listening - (0 if work.answering else 1))
