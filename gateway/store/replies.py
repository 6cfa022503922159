"""The Lua scripts' replies, read by name.

A script answers with a flat list: a status, then values in an order that
depends on the script and the status. That order is written down once, in
``SHAPES`` (beside each script's own ``Reply:`` comment), and every reply is
read through it, so the store asks for ``reply.number("next_seq")`` and never
for ``reply[4]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import errors
from gateway.domain.states import SessionState

#: create / append / finish, when the input was taken (or was a duplicate).
#: ``started``: 1 when this call started the engine work, 2 when work started
#: earlier has no live owner; ``lease_epoch`` > 0 when the caller took the lease.
_TAKEN = ("state", "previous_state", "started", "next_seq", "lease_epoch", "*missing")

#: Refusals of the input scripts; the store turns each into its error.
_REFUSALS: dict[str, tuple[str, ...]] = {
    "not_found": (), "expired": (), "closed": ("state",), "conflict": (), "exists": (), "empty": (),
    "input_closed": ("final_seq",), "below_received": ("max_seq",), "out_of_window": ("next_seq",), "too_many": (),
    "too_large": ("previous_state", "identity"), "too_long": ("tokens", "max_tokens"),
    "unknown": ("next_seq",), "over_cap": ("max_bytes",),
}

#: Per script, per status: the names of the values after the status, in
#: order. A name starting with ``*`` takes the rest of the list.
SHAPES: dict[str, dict[str, tuple[str, ...]]] = {
    "create": {"accepted": _TAKEN, **_REFUSALS},
    # ``token_mark``: the mark kept for the chunk's sequence id, if any (service/token_marks.py).
    "append": {"accepted": (*_TAKEN[:-1], "token_mark", *_TAKEN[-1:]), "duplicate": _TAKEN, **_REFUSALS},
    "finish": {"accepted": _TAKEN, **_REFUSALS},
    # ``gone``'s identity: set when the session had ended, so its slots are freed again
    # (a release that failed after the end is healed by whoever comes next).
    "cancel": {"accepted": ("state", "previous_state", "identity"), **_REFUSALS},
    "fail": {"failed": ("previous_state", "identity"), "gone": ("state", "identity")},
    "replace": {"replaced": _TAKEN, "unchanged": _TAKEN, **_REFUSALS},
    "tend": {"expired": ("previous_state", "identity"), "failed": ("previous_state", "identity"),
             "waiting": ("state", "look_again_at", "arrived", "last_input", "computed_tokens"),
             "alive": ("state", "look_again_at"), "gone": ("state", "identity")},
    "claim": {"claimed": ("state", "lease_epoch", "lease_until"), "taken": ()},
    "park": {"parked": (), "busy": ()},
    "renew": {"ok": ("lease_until",), "lost": ("state",)},
    "release": {"released": (), "lost": ()},
    "publish": {"ok": ("*ids",), "gone": ("state", "identity")},
    "quarantine": {"retry": ("failures", "due_at"), "dead": ("failures",)},
    "mark_tokens": {"kept": ("written", "more"), "stale": (), "gone": ()},
}


def decoded(value: Any) -> Any:
    """Text for the bytes redis-py returns; anything else as it is."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Reply:
    script: str
    status: str
    values: dict[str, Any]

    @classmethod
    def parse(cls, script: str, raw: list[Any]) -> Reply:
        status = decoded(raw[0])
        shape = SHAPES[script].get(status)
        if shape is None:
            raise errors.GatewayError(f"unexpected reply {status!r} from {script}.lua")
        values: dict[str, Any] = {}
        rest = [decoded(v) for v in raw[1:]]
        for i, name in enumerate(shape):
            if name.startswith("*"):
                values[name[1:]] = rest[i:]
                break
            # Trailing values a script leaves out (e.g. a repeated cancel's identity) are absent.
            if i < len(rest):
                values[name] = rest[i]
        return cls(script, status, values)

    def has(self, name: str) -> bool:
        return self.values.get(name) not in (None, "")

    def text(self, name: str) -> str:
        return str(self.values.get(name) or "")

    def number(self, name: str) -> int:
        return int(self.values[name])

    def state(self, name: str = "state") -> SessionState:
        return SessionState(self.values[name])

    def numbers(self, name: str) -> list[int]:
        return [int(v) for v in self.values[name]]

    def texts(self, name: str) -> list[str]:
        return [str(v) for v in self.values[name]]
