"""Load shedding: a saturated replica answers 503 ``overloaded`` at once, and loses nothing.

Saturation is forced for real: Redis paused for writes (``CLIENT PAUSE``)
holds appends in flight, and a blocked event loop runs late.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import redis

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings


def chunk(seq: int) -> dict[str, object]:
    return {"sequence_id": seq, "text": f"chunk {seq} "}


def assert_overloaded(response: httpx.Response, says: str) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "overloaded" and says in error["message"]
    assert response.headers["Retry-After"] == "1"
    assert response.headers["X-Request-Id"]


async def test_calls_past_the_in_flight_cap_are_shed_and_nothing_acknowledged_is_lost(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_in_flight_requests=2)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        with redis.Redis.from_url(redis_url) as admin:
            admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")  # appends (scripts that write) now wait
            held = [asyncio.create_task(client.post(f"{BASE}/{sid}/chunks", json=chunk(seq))) for seq in (0, 1)]
            await asyncio.sleep(0.1)
            assert not any(task.done() for task in held)
            started = time.perf_counter()
            shed = await client.post(f"{BASE}/{sid}/chunks", json=chunk(2))
            assert time.perf_counter() - started < 0.3  # answered at once, not after the pause
            assert_overloaded(shed, "2 calls in flight")
            # Probes and waiting routes are not counted, and ops are never shed.
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get(f"{BASE}/{sid}/result")).status_code == 202
            assert [r.status_code for r in await asyncio.gather(*held)] == [202, 202]
        # The refused chunk was never taken; sent again, it is.
        assert (await client.get(f"{BASE}/{sid}")).json()["next_sequence_id"] == 2
        again = await client.post(f"{BASE}/{sid}/chunks", json=chunk(2))
        assert again.status_code == 202 and again.json()["next_sequence_id"] == 3
        metrics = (await client.get("/metrics")).text
        assert 'omni_gateway_errors_total{code="overloaded"} 1.0' in metrics
        assert "omni_gateway_requests_in_flight 0.0" in metrics


async def test_a_late_event_loop_sheds_every_call_but_the_probes_until_it_catches_up(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_loop_lag_sec=0.05)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        time.sleep(0.3)  # CPU work on the loop: everything else waits  # noqa: ASYNC251
        await asyncio.sleep(0.005)  # the lag sampler's overdue timer fires first
        assert_overloaded(await client.post(f"{BASE}/{sid}/chunks", json=chunk(0)), "event loop")
        assert_overloaded(await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]}), "event loop")
        assert (await client.get("/readyz")).status_code == 200
        assert "omni_gateway_event_loop_lag_seconds" in (await client.get("/metrics")).text
        await asyncio.sleep(0.1)  # the loop is on time again
        accepted = await client.post(f"{BASE}/{sid}/chunks", json=chunk(0))
        assert accepted.status_code == 202 and accepted.json()["next_sequence_id"] == 1
