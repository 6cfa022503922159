"""Redis that cannot serve for a while: out of memory, read-only, restarted (real server).

Connection loss was always survived; these are the other ways a production
Redis says "not now". Every one must be a 503 ``store_unavailable`` to
clients (never a 500), and every background loop must come through it:
afterwards each replica's tender still expires idle sessions and claims
ownerless work, and no acknowledged chunk is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import redis

from gateway.store.connection import is_store_unavailable
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings
from tests.gateway.test_api import append, assert_error, create, view
from tests.gateway.test_redis_trouble import until_ready
from tests.redis_server import free_port, redis_process

pytestmark = pytest.mark.redis


#: Every write on disk before Redis answers it. With ``everysec`` Redis may
#: delay its AOF write by up to 2 s while an earlier fsync is slow (a busy
#: disk), and a kill then loses writes it had acknowledged.
DURABLE_AOF = ("--appendonly", "yes", "--appendfsync", "always")


@asynccontextmanager
async def replicas(url: str, **per_replica: dict) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    async with AsyncExitStack() as stack:
        clients = {}
        for name, overrides in per_replica.items():
            settings = make_settings(redis_url=url, redis_timeout_sec=0.5, tend_interval_sec=0.05,
                                     replica_id=name, **overrides)
            clients[name] = await stack.enter_async_context(app_client(settings, ScriptedEngine()))
        yield clients


async def append_until_acked(client: httpx.AsyncClient, sid: str, seq: int, text: str, **extra: object) -> None:
    """What a client does with a 503: retry the same sequence id."""
    deadline = time.monotonic() + 15
    while (response := await append(client, sid, seq, text, **extra)).status_code != 202:
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200:
            return  # the earlier attempt was stored after all: a duplicate
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_oom_readonly_and_restart_are_503s_and_nothing_stalls_for_good() -> None:
    with redis_process(extra=DURABLE_AOF) as server:
        admin = redis.Redis(port=server.port)
        async with replicas(server.url, a={"max_engine_sessions": 1, "session_timeout_sec": 120},
                            b={"session_timeout_sec": 1}) as clients:
            a, b = clients["a"], clients["b"]
            streaming = await create(a)  # on_first_chunk: a's only engine slot runs it
            waiting = await create(a, start_policy="on_end_only")
            for seq, word in enumerate(["acked ", "before "]):
                assert (await append(a, streaming, seq, word)).status_code == 202
                assert (await append(a, waiting, seq, word)).status_code == 202

            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)  # every write is refused: OOM
            assert_error(await append(a, waiting, 2, "oom "), 503, "store_unavailable")
            assert_error(await a.post(BASE, json={}), 503, "store_unavailable")
            await asyncio.sleep(0.5)  # tender rounds fail meanwhile
            admin.config_set("maxmemory", 0)
            await append_until_acked(a, waiting, 2, "oom ")
            await append_until_acked(a, streaming, 2, "oom ")

            admin.replicaof("127.0.0.1", free_port())  # a failover made it a replica: READONLY
            assert_error(await append(b, waiting, 3, "readonly "), 503, "store_unavailable")
            await asyncio.sleep(0.5)
            admin.replicaof("NO", "ONE")
            await append_until_acked(b, waiting, 3, "readonly ")
            await append_until_acked(b, streaming, 3, "readonly ")

            server.kill()
            await asyncio.sleep(0.5)
            server.start()  # the AOF is replayed
            for client in (a, b):
                await until_ready(client)
                metrics = (await client.get("/metrics")).text
                assert "omni_gateway_tender_failures_total" in metrics  # it failed, and lives on

            # No acknowledged chunk was lost.
            for sid in (streaming, waiting):
                assert (await view(b, sid))["received_chunks"] == 4
            # Ownerless work is claimed: a has no room, so b's tender must take it.
            await append_until_acked(a, waiting, 4, "end", end_of_input=True)
            await append_until_acked(b, streaming, 4, "end", end_of_input=True)
            for sid in (streaming, waiting):
                response = await b.get(f"{BASE}/{sid}/result", params={"wait": 10})
                assert response.status_code == 200, response.text
                result = response.json()
                assert result["state"] == "completed", result
                assert result["completion"]["choices"][0]["message"]["content"] == \
                    "echo: acked before oom readonly end"
            # Idle sessions still expire.
            idle = await create(b)
            deadline = time.monotonic() + 10
            while (await b.get(f"{BASE}/{idle}")).status_code != 410:
                assert time.monotonic() < deadline, "an idle session did not expire after the chaos"
                await asyncio.sleep(0.1)


def test_which_redis_errors_mean_not_now() -> None:
    for reply in ("OOM command not allowed when used memory > 'maxmemory'.",
                  "READONLY You can't write against a read only replica.",
                  "CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys request during rehashing",
                  "MISCONF Redis is configured to save RDB snapshots", "LOADING Redis is loading",
                  "OOM command not allowed when used memory > 'maxmemory'. script: 8f0e, on @user_script:12."):
        assert is_store_unavailable(redis.exceptions.ResponseError(reply)), reply
    # redis-py's classes, whose messages have lost the prefix.
    assert is_store_unavailable(redis.exceptions.OutOfMemoryError("command not allowed when used memory"))
    assert is_store_unavailable(redis.exceptions.ReadOnlyError("You can't write against a read only replica."))
    assert is_store_unavailable(redis.exceptions.ClusterDownError("The cluster is down"))
    assert is_store_unavailable(redis.exceptions.TryAgainError("Multiple keys request during rehashing"))
    assert is_store_unavailable(redis.exceptions.InvalidResponse("Protocol Error: b'?'"))
    assert not is_store_unavailable(redis.exceptions.ResponseError("ERR user_script:3: attempt to index nil"))
    assert not is_store_unavailable(ValueError("not redis"))


async def test_the_tender_lives_through_any_error_and_readiness_reports_it_dead(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.work.tender import Tender

    real_tend = Tender.tend
    rounds = {"n": 0}

    async def flaky_tend(self: Tender) -> None:
        rounds["n"] += 1
        if rounds["n"] <= 2:  # a reply it cannot parse, a bug: not only connection loss
            raise RuntimeError("unexpected reply from tend.lua")
        await real_tend(self)

    monkeypatch.setattr(Tender, "tend", flaky_tend)
    monkeypatch.setattr("gateway.work.tender.TENDER_BACKOFF_SEC", (0.05,))
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05, session_timeout_sec=0.5)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = await create(client)
        deadline = time.monotonic() + 10
        while (await client.get(f"{BASE}/{sid}")).status_code != 410:  # expiry needs the tender
            assert time.monotonic() < deadline, "the tender died on its first errors"
            await asyncio.sleep(0.05)
        assert 'omni_gateway_tender_failures_total{code="RuntimeError"} 2.0' in (await client.get("/metrics")).text
        assert (await client.get("/readyz")).status_code == 200

        tender = next(t for t in asyncio.all_tasks() if t.get_name() == "tender")
        tender.cancel()
        await asyncio.gather(tender, return_exceptions=True)
        assert_error(await client.get("/readyz"), 503, "service_unavailable")
