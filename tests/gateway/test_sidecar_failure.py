"""The ``openai-http`` engine dying mid-answer: the client gets an error event, the session fails.

The sidecar is SIGKILLed (process group: API server and engine core) while
the answer streams; the next test that needs it restarts it.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.store.keys import session_keys
from omni_adapter.http_engine import HttpEngine
from tests.gateway.client import BASE, app_client, make_settings, parse_sse
from tests.vllm_sidecar import VllmSidecar

pytestmark = pytest.mark.engine


async def test_sidecar_killed_mid_stream_fails_the_session(
    redis_url: str, http_engine: HttpEngine, vllm_sidecar: VllmSidecar
) -> None:
    async with app_client(make_settings(redis_url=redis_url), http_engine) as client:
        response = await client.post(BASE, json={
            "temperature": 0, "max_tokens": 1000,
            "first_chunk": {"sequence_id": 0, "text": "Write a long story about a lighthouse keeper.",
                            "end_of_input": True}})
        sid = response.json()["session_id"]
        # The in-process transport delivers an SSE body only once it ends, so
        # the kill is timed by the output frames in Redis: the role frame and
        # a few content frames out, most of the 1000 tokens still to come.
        async with aioredis.from_url(redis_url) as redis:
            for _ in range(1200):
                if await redis.xlen(session_keys(sid).output) >= 4:
                    break
                await asyncio.sleep(0.05)
        vllm_sidecar.kill()
        async with asyncio.timeout(60):
            body = (await client.get(f"{BASE}/{sid}/events")).text
        events = parse_sse(body)
        assert any(e.event is None and "content" in e.data for e in events)
        assert events[-1].event == "error", events[-3:]
        assert events[-1].json()["error"]["code"] == "engine_unavailable"
        assert all(e.data != "[DONE]" for e in events)
        view = await client.get(f"{BASE}/{sid}")
        assert view.json()["state"] == "failed"
