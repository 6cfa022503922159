"""Open the Redis client: a real server when configured, fakeredis otherwise; which of its
errors mean "Redis cannot serve now", and how long callers wait that out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.errors import StoreUnavailable

logger = logging.getLogger(__name__)

#: URL options that change the shape of redis-py's replies (``?protocol=3`` gives
#: XREAD's as a map); the store parses the shapes redis-py gives without them.
REPLY_SHAPE_OPTIONS = frozenset({"protocol", "legacy_responses"})

# New connections skip naming the client library (driver_info=None):
# redis-py otherwise sends CLIENT SETINFO (twice) on each new connection, a
# third of a millisecond of CPU each here, and a burst of calls (a replica
# claiming many sessions at once) opens hundreds of connections.


def _once_more() -> Retry:
    """A call whose pooled connection is found closed runs once more, on a new one.

    After Redis restarts, every connection in the pool is stale, and without
    this each one failed one request with a 503 before it reconnected (seen:
    ``/result`` answered 503 right after the store was back). Only a closed or
    refused connection is retried, at once: the store's scripts are safe to
    repeat (sequence ids, frame ids), and a timeout is not retried, since the
    call may still be running.
    """
    return Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))


@asynccontextmanager
async def open_redis(url: str | None, timeout_sec: float, *, cluster: bool = False, sentinels: str | None = None,
                     sentinel_master: str = "") -> AsyncIterator[aioredis.Redis]:
    """Yield a client for ``url``; without one, an in-process fakeredis server.

    With ``cluster`` the URL names any node of a Redis Cluster; each session
    script touches one slot (one hash tag per session), so it runs as is.
    With ``sentinels`` ("host:port,..."), the primary is the one those
    Sentinels name for ``sentinel_master``, asked again after a failover
    (the URL gives only the password and the database).
    The fake is the embedded default for a single replica: it speaks the
    same commands and runs the same Lua, but lives and dies with the process.
    """
    client: aioredis.Redis
    url = url and store_url(url)
    if sentinels:
        client = _sentinel_primary(url or "redis://", sentinels, sentinel_master, timeout_sec)
    elif url and cluster:
        from redis.asyncio.cluster import RedisCluster

        # A cluster client takes the same calls the store makes (one slot each).
        client = RedisCluster.from_url(  # type: ignore[assignment]
            url,
            socket_timeout=None,  # blocking reads set their own; see the store
            socket_connect_timeout=timeout_sec,
            max_connections=10_000,
            driver_info=None,  # no CLIENT SETINFO (above)
        )
    elif url:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=None,  # blocking reads set their own; see the store
            socket_connect_timeout=timeout_sec,
            health_check_interval=30,
            max_connections=10_000,
            driver_info=None,  # no CLIENT SETINFO (above)
            retry=_once_more(),
        )
    else:
        import fakeredis

        logger.warning("no OMNI_GATEWAY_REDIS_URL: using an in-process store (one replica only)")
        client = fakeredis.FakeAsyncRedis()
    try:
        yield client
    finally:
        await client.aclose()


def _sentinel_primary(url: str, sentinels: str, master: str, timeout_sec: float) -> aioredis.Redis:
    from redis.asyncio.sentinel import Sentinel

    parts = urlsplit(url)
    hosts = [(host, int(port)) for host, _, port in (entry.strip().rpartition(":") for entry in sentinels.split(","))
             if host]
    path = parts.path.lstrip("/")
    sentinel = Sentinel(hosts, sentinel_kwargs={"socket_timeout": timeout_sec})  # type: ignore[no-untyped-call]
    primary: aioredis.Redis = sentinel.master_for(
        master, password=parts.password, db=int(path) if path.isdigit() else 0,
        socket_timeout=None, socket_connect_timeout=timeout_sec, health_check_interval=30,
        max_connections=10_000, driver_info=None, retry=_once_more())
    return primary


def store_url(url: str) -> str:
    """``url`` without the options that change the shape of replies (``REPLY_SHAPE_OPTIONS``).

    redis-py lets a URL's query choose them, and its options win over the
    client's arguments; the store would then misread what Redis answers.
    Without them redis-py speaks RESP3 and gives replies their usual shapes,
    the one way the store is tested.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(name, value) for name, value in query if name not in REPLY_SHAPE_OPTIONS]
    if len(kept) == len(query):
        return url
    dropped = ", ".join(f"{name}={value}" for name, value in query if name in REPLY_SHAPE_OPTIONS)
    logger.warning("the Redis URL's %s is ignored: the store reads replies in redis-py's default shapes", dropped)
    return urlunsplit(parts._replace(query=urlencode(kept)))


#: Waits between tries of a store call while Redis cannot serve (a runner's, the stream reader's).
RETRY_DELAYS_SEC = (0.05, 0.1, 0.2, 0.5, 1.0)


def retry_delay(attempt: int) -> float:
    """The wait after try number ``attempt`` (from 0) failed: growing, then a second each."""
    return RETRY_DELAYS_SEC[min(attempt, len(RETRY_DELAYS_SEC) - 1)]


#: How long a stream a client is reading rides out a store that cannot serve before it gives
#: up and tells its client (an SSE answer, an upload's records). Long enough for what Redis going
#: away and coming back looks like in production: a graceful restart that replays its AOF
#: (seconds: the rolling-deploy probe saw 3 s down), a Sentinel failover (the chart's
#: down-after of 5 s, then the election and the clients finding the new primary), CLUSTERDOWN
#: while a node fails over. Runners ride out the same outage, and past their lease (10 s)
#: another replica goes on with the session, so a stream held this long sees the answer go on.
#: Short against the session's own life (``session_timeout_sec``, 300 s): a Redis down longer
#: is an outage the client should hear of, with its own bounded retries after (the stream's
#: end says how to resume). Meanwhile a stream costs a task and a socket, no Redis
#: connection, and its keep-alive goes on, so proxies keep it open.
STORE_OUTAGE_SEC = 30.0


class StoreOutage:
    """The store calls of one long-lived request (a stream a client reads), through an outage.

    A call that fails with ``StoreUnavailable`` calls ``failed``: it waits
    (``retry_delay``) for the next try, until ``STORE_OUTAGE_SEC`` have passed
    since the first failure that nothing served after; then it raises the
    error. Only for calls safe to repeat (reads; appends, deduplicated by
    their sequence id).
    """

    def __init__(self, what: str) -> None:
        #: For the log: whose calls these are ("session <id>: stream").
        self._what = what
        #: When the calls started failing (``time.monotonic``); None while the store serves.
        self._since: float | None = None
        self._failures = 0

    def served(self) -> None:
        """A call showed the store serving: the next failure starts a new outage."""
        self._since, self._failures = None, 0

    async def failed(self, error: StoreUnavailable) -> None:
        """Wait before the next try; ``error`` is raised instead once the outage has lasted too long."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            logger.warning("%s: the store cannot serve; trying again for up to %g s", self._what, STORE_OUTAGE_SEC)
        elif now - self._since >= STORE_OUTAGE_SEC:
            logger.warning("%s: the store could not serve for %.0f s; giving up", self._what, now - self._since)
            raise error
        await asyncio.sleep(retry_delay(self._failures))
        self._failures += 1


#: Errors that mean "Redis cannot serve now" rather than "this call is wrong":
#: unreachable, out of memory, a replica after a failover, a cluster that is
#: down or re-sharding, loading, a reply we cannot parse. redis-py gives
#: these classes of their own (and strips the reply's prefix); errors raised
#: by ``redis.call`` inside our scripts get the same classes.
_UNAVAILABLE_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                       redis.exceptions.InvalidResponse, redis.exceptions.OutOfMemoryError,
                       redis.exceptions.ReadOnlyError, redis.exceptions.ClusterError,
                       redis.exceptions.TryAgainError, redis.exceptions.AskError, OSError)
#: The same, for replies redis-py has no class for: a busy script, a failing
#: disk, too few replicas, and the classed ones should a parser not map them.
_UNAVAILABLE_REPLIES = ("BUSY", "MISCONF", "NOREPLICAS", "OOM", "READONLY", "LOADING", "MASTERDOWN",
                        "CLUSTERDOWN", "TRYAGAIN")


def is_store_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(_UNAVAILABLE_REPLIES)


@contextmanager
def translate_redis_errors() -> Iterator[None]:
    """Nothing from ``redis.*`` leaves the store: "cannot serve now" becomes a 503.

    So does a call's time bound running out (``asyncio.timeout``: a call's own,
    or its pipeline's). Any other Redis error (a bug in a script, say) stays a
    500 for a request, and background loops log it and carry on.
    """
    try:
        yield
    except TimeoutError as exc:
        raise StoreUnavailable("the session store did not answer in time") from exc
    except Exception as exc:
        if is_store_unavailable(exc):
            raise StoreUnavailable(f"the session store cannot serve now ({_first_word(exc)}); "
                                   "retry shortly") from exc
        raise


def _first_word(exc: BaseException) -> str:
    words = str(exc).split(maxsplit=1)
    return words[0] if words and words[0].isupper() and words[0].isalpha() else type(exc).__name__
