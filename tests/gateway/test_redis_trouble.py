"""Redis going away, hanging, coming back, and Redis Cluster (real servers).

While Redis is unreachable every endpoint answers fast with 503 and the
envelope, /readyz fails, and the service recovers by itself. With AOF
persistence every acknowledged chunk survives a Redis crash. The same
scripts run on a 3-node Redis Cluster (one hash tag per session).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse
from tests.gateway.test_api import append, assert_error, create, view
from tests.redis_server import redis_cluster, redis_process

#: What the chart configures for its Redis (helm/omni-gateway/templates/redis.yaml).
AOF = ("--appendonly", "yes", "--appendfsync", "everysec")
TIMEOUT_SEC = 0.5


async def every_endpoint(client: httpx.AsyncClient, sid: str) -> list[tuple[str, httpx.Response]]:
    return [
        ("create", await client.post(BASE, json={})),
        ("append", await append(client, sid, 9, "x")),
        ("view", await client.get(f"{BASE}/{sid}")),
        ("finish", await client.post(f"{BASE}/{sid}/finish")),
        ("result", await client.get(f"{BASE}/{sid}/result")),
        ("events", await client.get(f"{BASE}/{sid}/events")),
        ("cancel", await client.delete(f"{BASE}/{sid}")),
        ("readyz", await client.get("/readyz")),
    ]


async def until_ready(client: httpx.AsyncClient, within_sec: float = 10.0) -> None:
    deadline = time.monotonic() + within_sec
    while (await client.get("/readyz")).status_code != 200:
        assert time.monotonic() < deadline, "the service did not recover when Redis came back"
        await asyncio.sleep(0.1)


async def test_redis_crash_gives_fast_503s_keeps_acked_chunks_and_recovers() -> None:
    with redis_process(extra=AOF) as redis:
        settings = make_settings(redis_url=redis.url, redis_timeout_sec=TIMEOUT_SEC, tend_interval_sec=0.05)
        engine = ScriptedEngine()
        async with app_client(settings, engine) as client:
            waiting = await create(client, start_policy="on_end_only")
            running = await create(client)  # on_first_chunk: its runner reads input through the outage
            for seq, word in enumerate(["acked", "before", "the", "crash"]):
                assert (await append(client, waiting, seq, f"{word} ")).status_code == 202
                assert (await append(client, running, seq, f"{word} ")).status_code == 202

            redis.kill()
            for name, response in await every_endpoint(client, waiting):
                assert_error(response, 503, "store_unavailable")
                assert float(response.elapsed.total_seconds()) < TIMEOUT_SEC + 1.5, name
            assert (await client.get("/healthz")).status_code == 200

            redis.start()  # same data folder: the AOF is replayed
            await until_ready(client)
            for sid in (waiting, running):
                assert (await view(client, sid))["received_chunks"] == 4
                assert (await append(client, sid, 4, "end", end_of_input=True)).status_code == 202
                result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 5})).json()
                assert result["completion"]["choices"][0]["message"]["content"] == "echo: acked before the crash end"


async def test_a_hanging_redis_gives_503_within_the_timeout_not_a_hang() -> None:
    with redis_process() as redis:
        settings = make_settings(redis_url=redis.url, redis_timeout_sec=TIMEOUT_SEC)
        async with app_client(settings, ScriptedEngine()) as client:
            sid = await create(client, start_policy="on_end_only")
            redis.freeze()
            try:
                for name, response in await every_endpoint(client, sid):
                    assert_error(response, 503, "store_unavailable")
                    assert float(response.elapsed.total_seconds()) < TIMEOUT_SEC + 1.5, name
            finally:
                redis.thaw()
            await until_ready(client)
            assert (await view(client, sid))["state"] == "open"


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with redis_cluster(3) as url:
        yield url


async def test_sessions_run_on_a_redis_cluster(cluster_url: str) -> None:
    # Limits on (their keys live in slots of their own) and little capacity,
    # so most work waits in the schedule for a tender to claim it.
    settings = make_settings(redis_url=cluster_url, redis_cluster=True, tend_interval_sec=0.05,
                             max_engine_sessions=2, max_sessions_per_identity=50, rate_limit_rps=1000)
    async with app_client(settings, ScriptedEngine(Script(word_delay_sec=0.01))) as a, \
            app_client(settings, ScriptedEngine()) as b:
        # Enough sessions to land in every node's slots.
        sids = [await create(a) for _ in range(9)]
        for i, sid in enumerate(sids):
            assert (await append(b, sid, 1, f"world{i}", end_of_input=True)).status_code == 202
            assert (await append(a, sid, 0, "hello ")).status_code == 202
        for i, sid in enumerate(sids):
            body = (await b.get(f"{BASE}/{sid}/events")).text
            assert content_of(parse_sse(body)) == f"echo: hello world{i}"
        assert (await a.delete(f"{BASE}/{sids[0]}")).status_code == 409  # completed: nothing to cancel
