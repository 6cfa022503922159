"""Bounded reads: big, slow and deeply nested bodies are refused, cheaply."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator

from openai.types.chat import ChatCompletionMessage

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings

MiB = 1024 * 1024


async def gib_of_zeros() -> AsyncIterator[bytes]:
    block = bytes(MiB)  # one buffer, sent 1024 times: the client side allocates nothing more
    for _ in range(1024):
        yield block


async def test_a_1_gib_body_is_refused_without_buffering_it(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_chunk_bytes=MiB)
    async with app_client(settings, ScriptedEngine()) as client:
        sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
        tracemalloc.start()
        try:
            raw = await client.post(f"{BASE}/{sid}/chunks", content=gib_of_zeros(), headers={
                "Content-Type": "application/octet-stream", "X-Sequence-Id": "0"})
            json_body = await client.post(f"{BASE}/{sid}/chunks", content=gib_of_zeros(),
                                          headers={"Content-Type": "application/json"})
            create = await client.post(BASE, content=gib_of_zeros(), headers={"Content-Type": "application/json"})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Whichever cap the stream crosses first: the chunk cap or the request cap.
        assert raw.status_code == 413
        assert raw.json()["error"]["code"] in ("chunk_too_large", "request_too_large")
        assert json_body.status_code == 413 and json_body.json()["error"]["code"] == "request_too_large"
        assert create.status_code == 413 and create.json()["error"]["code"] == "request_too_large"
        # The cap is 1 MiB of payload (about 1.4 MiB of JSON); 1 GiB came in.
        assert peak < 8 * MiB, f"peak traced memory {peak / MiB:.1f} MiB"
        assert (await client.get(f"{BASE}/{sid}")).json()["state"] == "open"


async def test_a_declared_oversized_body_is_refused_unread(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_chunk_bytes=MiB)
    async with app_client(settings, ScriptedEngine()) as client:
        response = await client.post(BASE, content=b"{}", headers={
            "Content-Type": "application/json", "Content-Length": str(1024 * MiB)})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


async def test_a_stalled_body_times_out(redis_url: str) -> None:
    async def stalls() -> AsyncIterator[bytes]:
        yield b'{"start_policy": '
        await asyncio.sleep(2)
        yield b'"on_end_only"}'

    settings = make_settings(redis_url=redis_url, body_idle_timeout_sec=0.3)
    async with app_client(settings, ScriptedEngine()) as client:
        response = await client.post(BASE, content=stalls(), headers={"Content-Type": "application/json"})
        assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"


async def test_deeply_nested_json_is_a_clean_400(redis_url: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as client:
        create = await client.post(BASE, content=b'{"metadata": ' + deep + b"}",
                                   headers={"Content-Type": "application/json"})
        assert create.status_code in (400, 422), create.text
        sid = (await client.post(BASE, json={})).json()["session_id"]
        chunk = await client.post(f"{BASE}/{sid}/chunks", content=b'{"sequence_id": 0, "text": ' + deep + b"}",
                                  headers={"Content-Type": "application/json"})
        assert chunk.status_code in (400, 422), chunk.text
        for response in (create, chunk):
            assert response.json()["error"]["code"] in ("invalid_json", "validation_error")


async def test_messages_take_only_chat_turns(redis_url: str) -> None:
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as client:
        bad = await client.post(BASE, json={"messages": [{"role": "tool", "content": "x"}]})
        assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("messages.0")
        nested = await client.post(BASE, json={"messages": [{"role": "user", "content": {"deep": [1]}}]})
        assert nested.status_code == 422
        ok = await client.post(BASE, json={"messages": [{"role": "system", "content": "be brief"}]})
        assert ok.status_code == 201


async def test_history_is_taken_as_chat_completions_take_it(redis_url: str) -> None:
    """A developer message (OpenAI's newer name for system), text parts, and answers sent back
    as the openai SDK dumps them: the engine gets the same text history."""
    answer = ChatCompletionMessage(role="assistant", content="hello").model_dump()
    refused = ChatCompletionMessage(role="assistant", content=None, refusal="I can't.").model_dump()
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        created = await client.post(BASE, json={"start_policy": "on_first_chunk", "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
            answer, {"role": "user", "content": "something rude"}, refused]})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "bye", "end_of_input": True})
        result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 10})).json()
        assert result["state"] == "completed", result
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        refusal_of_user = {"role": "user", "content": "x", "refusal": "no"}
        for bad in ({"role": "user", "content": [image]}, refusal_of_user, {**answer, "function_call": {"name": "f"}}):
            refused_create = await client.post(BASE, json={"messages": [bad]})
            assert refused_create.status_code == 422, bad
            assert refused_create.json()["error"]["param"].startswith("messages.0"), bad
    assert engine.sessions[-1].request.messages == (
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "something rude"},
        {"role": "assistant", "content": "I can't."})




async def test_oversized_headers_are_refused(redis_url: str) -> None:
    async with app_client(make_settings(redis_url=redis_url, max_header_bytes=4096), ScriptedEngine()) as client:
        response = await client.post(BASE, json={}, headers={"X-Filler": "x" * 8192})
        assert response.status_code == 431 and response.json()["error"]["code"] == "headers_too_large"
        assert (await client.post(BASE, json={})).status_code == 201
