"""Store fixtures: every store test runs against a real redis-server and fakeredis."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from gateway.store.connection import open_redis
from gateway.store.redis_store import SessionStore
from tests.redis_server import redis_server


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """A real Redis: CI's (``OMNI_GATEWAY_TEST_REDIS_URL``) or one started here."""
    if url := os.environ.get("OMNI_GATEWAY_TEST_REDIS_URL"):
        yield url
        return
    with redis_server() as url:
        yield url


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The shared real Redis, emptied: work an earlier test left ownerless
    would otherwise be claimed (correctly) by the next test's replica."""
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushdb()
    return redis_server_url


@pytest.fixture(params=["real", "fake"])
async def redis_client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    url = request.getfixturevalue("redis_url") if request.param == "real" else None
    async with open_redis(url, timeout_sec=2.0) as client:
        await client.flushdb()
        yield client


@pytest.fixture
def store(redis_client: aioredis.Redis) -> SessionStore:
    return SessionStore(redis_client, timeout_sec=2.0)
