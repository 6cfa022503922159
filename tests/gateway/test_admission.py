"""Load shedding: a saturated replica answers 503 ``overloaded`` at once, and loses nothing.

Saturation is forced for real: Redis paused for writes (``CLIENT PAUSE``)
holds appends in flight, and a blocked event loop runs late.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

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


async def test_new_sessions_are_shed_at_the_cap_and_session_calls_only_past_twice_it(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_in_flight_requests=2)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        with redis.Redis.from_url(redis_url) as admin:
            admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")  # appends (scripts that write) now wait
            held = [asyncio.create_task(client.post(f"{BASE}/{sid}/chunks", json=chunk(seq))) for seq in (0, 1)]
            await asyncio.sleep(0.1)
            assert not any(task.done() for task in held)
            started = time.perf_counter()
            shed = await client.post(BASE, json={})  # a new session: shed first
            assert time.perf_counter() - started < 0.3  # answered at once, not after the pause
            assert_overloaded(shed, "2 calls in flight")
            # The input of a session that exists is taken up to twice the cap.
            held += [asyncio.create_task(client.post(f"{BASE}/{sid}/chunks", json=chunk(seq))) for seq in (2, 3)]
            await asyncio.sleep(0.1)
            assert not any(task.done() for task in held)
            assert_overloaded(await client.post(f"{BASE}/{sid}/chunks", json=chunk(4)), "4 calls in flight")
            # Probes and waiting routes are not counted, and ops are never shed.
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get(f"{BASE}/{sid}/result")).status_code == 202
            assert [r.status_code for r in await asyncio.gather(*held)] == [202] * 4
        # The refused chunk was never taken; sent again, it is.
        assert (await client.get(f"{BASE}/{sid}")).json()["next_sequence_id"] == 4
        again = await client.post(f"{BASE}/{sid}/chunks", json=chunk(4))
        assert again.status_code == 202 and again.json()["next_sequence_id"] == 5
        metrics = (await client.get("/metrics")).text
        assert 'omni_gateway_errors_total{code="overloaded"} 2.0' in metrics
        assert "omni_gateway_requests_in_flight 0.0" in metrics


async def test_a_late_event_loop_sheds_new_sessions_but_never_the_input_of_running_ones(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_loop_lag_sec=0.05)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={})).json()["session_id"]
        time.sleep(0.3)  # CPU work on the loop (a session's own, say): everything else waits  # noqa: ASYNC251
        await asyncio.sleep(0.005)  # the lag sampler's overdue timer fires first
        assert_overloaded(await client.post(BASE, json={}), "event loop")
        assert_overloaded(await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]}), "event loop")
        # The running session's input, reads and finish go through; its engine work
        # does not start while the loop is late (it waits in Redis), and does once it is not.
        accepted = await client.post(f"{BASE}/{sid}/chunks", json=chunk(0))
        assert accepted.status_code == 202 and accepted.json()["next_sequence_id"] == 1
        assert (await client.get(f"{BASE}/{sid}")).json()["owner"] is None
        assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202
        assert (await client.get("/readyz")).status_code == 200
        assert "omni_gateway_event_loop_lag_seconds" in (await client.get("/metrics")).text
        result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 10})).json()
        assert result["state"] == "completed", result
        assert (await client.post(BASE, json={})).status_code == 201  # the loop is on time again


async def test_a_body_still_arriving_is_not_in_flight(redis_url: str) -> None:
    """Slow senders hold sockets, not the process: only a call whose body arrived counts."""
    settings = make_settings(redis_url=redis_url, max_in_flight_requests=2)
    arrived = asyncio.Event()

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"sequence_id": 0, '
        await arrived.wait()
        yield b'"text": "late"}'

    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        slow = [asyncio.create_task(client.post(f"{BASE}/{sid}/chunks", content=trickle(),
                                                headers={"Content-Type": "application/json"})) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert (await client.post(BASE, json={})).status_code == 201
        assert "omni_gateway_requests_in_flight 0.0" in (await client.get("/metrics")).text
        arrived.set()
        assert sorted(r.status_code for r in await asyncio.gather(*slow)) == [200, 200, 202]
