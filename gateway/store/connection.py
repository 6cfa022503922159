"""Open the Redis client: a real server when configured, fakeredis otherwise."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import redis.asyncio as aioredis
import redis.exceptions

from gateway.errors import StoreUnavailable

logger = logging.getLogger(__name__)


@asynccontextmanager
async def open_redis(url: str | None, timeout_sec: float, *, cluster: bool = False) -> AsyncIterator[aioredis.Redis]:
    """Yield a client for ``url``; without one, an in-process fakeredis server.

    With ``cluster`` the URL names any node of a Redis Cluster; each session
    script touches one slot (one hash tag per session), so it runs as is.
    The fake is the embedded default for a single replica: it speaks the
    same commands and runs the same Lua, but lives and dies with the process.
    """
    if url and cluster:
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster.from_url(
            url,
            socket_timeout=None,  # blocking reads set their own; see the store
            socket_connect_timeout=timeout_sec,
            max_connections=10_000,
        )
    elif url:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=None,  # blocking reads set their own; see the store
            socket_connect_timeout=timeout_sec,
            health_check_interval=30,
            max_connections=10_000,
        )
    else:
        import fakeredis

        logger.warning("no OMNI_GATEWAY_REDIS_URL: using an in-process store (one replica only)")
        client = fakeredis.FakeAsyncRedis()
    try:
        yield client
    finally:
        await client.aclose()


@contextmanager
def translate_redis_errors() -> Iterator[None]:
    """Nothing from ``redis.*`` leaves the store: outages become a 503."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
            redis.exceptions.BusyLoadingError, OSError) as exc:
        raise StoreUnavailable("the session store is unreachable; retry shortly") from exc
