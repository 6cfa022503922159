"""Session states and the one table of allowed transitions.

The Lua scripts that change state are generated with this table inlined
(see ``gateway.store.scripts``), so Python and Redis cannot disagree about
what is legal. An illegal transition is refused, never silently applied.

    open ──► streaming ──► generating ──► completed
      │          │             │
      └──────────┴─────────────┴──► failed | cancelled | expired*
      open ─────────────────────► generating       (*expired: open/streaming only)
"""

from __future__ import annotations

from enum import StrEnum


class SessionState(StrEnum):
    #: Receiving input; the engine session is not open yet.
    OPEN = "open"
    #: The engine session is open and prefilling; input still arriving.
    STREAMING = "streaming"
    #: Input is complete; the engine is producing the answer.
    GENERATING = "generating"
    #: The answer is complete.
    COMPLETED = "completed"
    #: Ended by an error (caps, missing chunks, engine failure).
    FAILED = "failed"
    #: Ended by the client (DELETE).
    CANCELLED = "cancelled"
    #: Idle for longer than the session timeout while waiting for input.
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {SessionState.COMPLETED, SessionState.FAILED, SessionState.CANCELLED, SessionState.EXPIRED}
)

S = SessionState
TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    S.OPEN: frozenset({S.STREAMING, S.GENERATING, S.FAILED, S.CANCELLED, S.EXPIRED}),
    S.STREAMING: frozenset({S.GENERATING, S.FAILED, S.CANCELLED, S.EXPIRED}),
    S.GENERATING: frozenset({S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.EXPIRED: frozenset(),
}
del S


def can_transition(current: SessionState, target: SessionState) -> bool:
    return target in TRANSITIONS[current]
