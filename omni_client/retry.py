"""When a call may be repeated, and how long to wait first (no I/O here).

Appends and ``finish`` are safe to repeat: the gateway dedupes a chunk by
its sequence id and bytes (a repeat is ``200 duplicate``, never a second
copy) and ``finish`` is idempotent; reads and cancels change nothing twice.
Creating a session is safe with an ``Idempotency-Key`` (the client sends
one): a repeat returns the session the first try made. A call that is not
safe to repeat is repeated only when it certainly did nothing: no
connection, a 429, or a 503 that refused it before any work (overloaded, at
capacity). A ``store_unavailable`` may come after the work was done.

A ``store_unavailable`` says the gateway's Redis is away (restarting,
failing over), which passes by itself within seconds: calls that may be
repeated are, while it lasts, for up to ``store_outage_sec`` however many
tries that takes; other failures count against ``attempts``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

#: Answers worth another try: overload, an edge that lost its replica, a replica going away.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: The code of a 503 whose cause passes by itself: the gateway's Redis is away for a while.
STORE_UNAVAILABLE = "store_unavailable"
#: The answers that say a request was refused before it did anything: any 429, and
#: these 503s (a ``store_unavailable`` may come after the work was done).
REFUSED_503_CODES = frozenset({"overloaded", "capacity_exhausted", "streaming_input_disabled"})


@dataclass(frozen=True)
class RetryPolicy:
    #: Tries in all, the first one included.
    attempts: int = 6
    #: The first pause; each next one doubles, up to ``max_backoff_sec``, with jitter.
    backoff_sec: float = 0.2
    max_backoff_sec: float = 5.0
    #: The longest ``Retry-After`` honoured; a server asking for more gets the error instead.
    max_retry_after_sec: float = 60.0
    #: How long tries go on, past ``attempts``, while the gateway answers ``store_unavailable``
    #: (0: those count as any failure). Its streams wait 30 s for Redis before they end; this
    #: covers a Redis that takes longer to come back (an AOF to replay, a failover).
    store_outage_sec: float = 60.0

    def delay(self, attempt: int, retry_after: float | None = None, *,
              store_outage_for: float | None = None) -> float | None:
        """Seconds before try ``attempt + 1`` (0-based), or ``None``: give up.

        ``store_outage_for``: how long the gateway has answered ``store_unavailable``
        in a row (``Outage.seen``), ``None`` if the last failure was another."""
        waiting_out = store_outage_for is not None and store_outage_for < self.store_outage_sec
        if attempt + 1 >= self.attempts and not waiting_out:
            return None
        if retry_after is not None:
            return retry_after if retry_after <= self.max_retry_after_sec else None
        pause = min(self.max_backoff_sec, self.backoff_sec * 2.0 ** min(attempt, 32))
        return pause * random.uniform(0.5, 1.0)  # jitter: clients that failed together retry apart


@dataclass
class Outage:
    """How long the failures in a row have been ``store_unavailable`` (the gateway's Redis away)."""

    #: When the first of them came (the caller's clock); None: the last failure was another.
    since: float | None = None

    def seen(self, code: str, now: float) -> float | None:
        """Take the latest failure's code; how long the outage has lasted so far (None: not one)."""
        if code != STORE_UNAVAILABLE:
            self.since = None
            return None
        if self.since is None:
            self.since = now
        return now - self.since


def retryable_status(status: int, idempotent: bool, code: str = "") -> bool:
    """``code``: the error envelope's, which tells a 503 that did nothing from one that may have."""
    if idempotent:
        return status in RETRY_STATUSES
    return status == 429 or (status == 503 and code in REFUSED_503_CODES)


def retryable_error(error: httpx.TransportError, idempotent: bool) -> bool:
    """Every transport error for a repeatable call; for the others, only a connection never made."""
    return idempotent or isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)


def retry_after_of(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (the gateway sends seconds; an HTTP date is ignored)."""
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return max(0.0, value)


def describe(error: httpx.TransportError) -> str:
    """A one-line reason a shell user can act on."""
    kind = {httpx.ConnectError: "cannot connect", httpx.ConnectTimeout: "connection timed out",
            httpx.ReadTimeout: "no answer in time", httpx.WriteTimeout: "sending timed out",
            httpx.PoolTimeout: "no free connection in time"}.get(type(error), "connection failed")
    detail = str(error) or type(error).__name__
    return f"{kind} ({detail})"
