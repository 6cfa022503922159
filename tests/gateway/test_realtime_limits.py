"""Limits a voice client can live with on /v1/realtime: per connection and turn, not per frame.

Real Redis (its own process where a test kills it), the scripted engine,
raw WebSockets sending 20 ms audio frames as the SDKs do.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import websockets

from omni_adapter.port import Capabilities
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import TEXT_ONLY
from tests.redis_server import redis_process

FRAME_20MS = base64.b64encode(bytes(2 * 24_000 // 50)).decode()
NO_VAD = {"type": "session.update", "session": TEXT_ONLY}


def hearing() -> ScriptedEngine:
    """The scripted engine taking audio as it is (no recognizer: these tests are about limits)."""
    return ScriptedEngine(capabilities=Capabilities(
        input_modalities=frozenset({"text", "audio"}), output_modalities=frozenset({"text"}), incremental=True,
        model_names=("scripted",)))


async def received(ws: Any, within_sec: float = 0.3) -> list[dict[str, Any]]:
    """Every event that arrives until the socket is quiet for ``within_sec``."""
    seen = []
    while True:
        try:
            seen.append(json.loads(await asyncio.wait_for(ws.recv(), within_sec)))
        except TimeoutError:
            return seen


async def test_two_voice_users_on_one_key_stream_20ms_frames_without_being_closed(redis_url: str) -> None:
    """The identity's rate (here 5 requests/s, burst 10) is charged per connection and turn:
    two users sending 50 frames a second each for two seconds use two of it."""
    settings = make_settings(redis_url=redis_url, api_keys="sk-one", rate_limit_rps=5, rate_limit_burst=10)
    async with live_app(settings, hearing()) as url:
        headers = {"Authorization": "Bearer sk-one"}
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime", additional_headers=headers) as a, \
                websockets.connect(url.replace("http", "ws") + "/v1/realtime", additional_headers=headers) as b:
            for ws in (a, b):
                await ws.send(json.dumps(NO_VAD))
            for _ in range(100):
                for ws in (a, b):
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": FRAME_20MS}))
                await asyncio.sleep(0.02)
            for ws in (a, b):
                events = await received(ws)
                assert [e["type"] for e in events if e["type"] == "error"] == [], events[-3:]
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                committed = await received(ws)
                assert "input_audio_buffer.committed" in [e["type"] for e in committed]


async def test_a_flood_beyond_the_connections_budget_gets_error_events_and_the_socket_stays(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, realtime_events_per_sec=10)
    async with live_app(settings, hearing()) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        for _ in range(40):  # the budget holds 20 at once
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        events = await received(ws)
        codes = [e["error"]["code"] for e in events if e["type"] == "error"]
        assert codes and set(codes) == {"rate_limit_exceeded"}
        assert sum(e["type"] == "input_audio_buffer.cleared" for e in events) >= 20
        await asyncio.sleep(0.3)  # the budget refills
        await ws.send(json.dumps(NO_VAD))
        assert (await received(ws))[-1]["type"] == "session.updated"


async def test_an_append_over_the_audio_cap_and_an_event_over_the_size_cap_get_error_events(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, realtime_max_append_ms=100, realtime_max_event_bytes=100_000)
    async with live_app(settings, hearing()) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        await ws.send(json.dumps(NO_VAD))
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(bytes(48 * 200)).decode()}))  # 200 ms
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 150_000}]}}))
        events = await received(ws)
        assert [e["error"]["code"] for e in events if e["type"] == "error"] == \
            ["request_too_large", "request_too_large"]
        for _ in range(5):  # 100 ms: the least a commit takes
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": FRAME_20MS}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        assert "input_audio_buffer.committed" in [e["type"] for e in await received(ws)]


async def test_a_store_error_during_an_event_is_an_error_event_and_the_socket_stays() -> None:
    with redis_process() as redis:
        settings = make_settings(redis_url=redis.url, redis_timeout_sec=0.5)
        async with live_app(settings, hearing()) as url, \
                websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
            await received(ws)
            await ws.send(json.dumps(NO_VAD))
            await received(ws)
            redis.kill()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": FRAME_20MS}))
            events = await received(ws, 2.0)
            assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["store_unavailable"]
            redis.start()
            await asyncio.sleep(0.5)
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "back"}]}}))
            await ws.send(json.dumps({"type": "response.create"}))
            events = await received(ws, 2.0)
            assert events[-1]["type"] == "response.done" or "response.done" in [e["type"] for e in events], events


async def test_a_pcm16_stream_cut_at_odd_byte_counts_reaches_the_engine_sample_for_sample(redis_url: str) -> None:
    """The input buffer is a byte stream: a client that cuts it anywhere (a file read in blocks of
    an odd size) loses nothing, and no piece carries half a sample."""
    engine = hearing()
    stream = bytes(range(1, 201)) * 24  # 4,800 bytes: 2,400 samples, 100 ms (the least a commit takes)
    cuts = [0, 3, 480, 481, 1_000, 1_199, 4_800]
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        await ws.send(json.dumps(NO_VAD))
        for start, end in itertools.pairwise(cuts):
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(stream[start:end]).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = await received(ws)
        assert [e for e in events if e["type"] == "error"] == []
        assert "input_audio_buffer.committed" in [e["type"] for e in events]
        fed = engine.sessions[-1].fed
        assert all(len(chunk.data) % 2 == 0 for chunk in fed)
        assert b"".join(chunk.data for chunk in fed) == stream


async def test_json_events_in_binary_frames_are_taken_and_other_bytes_get_an_error_event(redis_url: str) -> None:
    """Some WebSocket clients send their JSON as bytes; bytes that are not JSON are the client's
    error, said on the socket, which stays."""
    async with live_app(make_settings(redis_url=redis_url), hearing()) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        await ws.send(json.dumps(NO_VAD).encode())
        assert [e["type"] for e in await received(ws)] == ["session.updated"]
        await ws.send(b"\x00\xff\x01")
        assert [e["error"]["code"] for e in await received(ws)] == ["invalid_json"]
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}).encode())
        assert [e["type"] for e in await received(ws)] == ["input_audio_buffer.cleared"]


async def test_an_event_type_or_item_role_that_is_a_list_or_object_gets_an_error_event(redis_url: str) -> None:
    """JSON gives any value anywhere: one that is not a string where a name is expected is the
    client's error, said on the socket, which stays (it was a ``TypeError`` that closed it)."""
    async with live_app(make_settings(redis_url=redis_url), hearing()) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        await ws.send(json.dumps(NO_VAD))
        await received(ws)
        for kind in (["input_audio_buffer.append"], {"a": 1}):
            await ws.send(json.dumps({"type": kind}))
            errors = [e["error"] for e in await received(ws)]
            assert [(e["code"], e["param"]) for e in errors] == [("invalid_request", "type")]
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": ["user"], "content": [{"type": "input_text", "text": "x"}]}}))
        errors = [e["error"] for e in await received(ws)]
        assert [(e["code"], e["param"]) for e in errors] == [("invalid_value", "item.role")]
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert [e["type"] for e in await received(ws)] == ["input_audio_buffer.cleared"]


@contextmanager
def server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """The ERROR records the gateway and uvicorn (its "Exception in ASGI application") log meanwhile."""
    loggers = [logging.getLogger(name) for name in ("gateway", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    found: list[logging.LogRecord] = []
    try:
        yield found
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
        found += [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_client_that_leaves_while_it_is_told_something_is_a_quiet_close(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A client gone while its events are sent (an answer streaming, replies to events it sent
    before it left) is a normal end of the connection, not a server error."""
    engine = ScriptedEngine(Script(word_delay_sec=0.02))
    words = " ".join(f"w{i}" for i in range(200))
    with server_errors(caplog) as found:
        async with live_app(make_settings(redis_url=redis_url), engine) as url:
            for leave_after in ("response.output_text.delta", None):
                ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime")
                await received(ws)
                await ws.send(json.dumps(NO_VAD))
                await received(ws)
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}}))
                await ws.send(json.dumps({"type": "response.create"}))
                if leave_after is not None:  # mid-answer
                    while json.loads(await ws.recv())["type"] != leave_after:
                        pass
                else:  # with its events still to answer
                    for _ in range(50):
                        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
                ws.transport.abort()
                await asyncio.sleep(0.5)
    assert [r.getMessage() for r in found] == []


async def test_settings_and_item_ids_out_of_openais_bounds_get_error_events(redis_url: str) -> None:
    """``max_output_tokens`` is 1-4096 or "inf", a transcription model is named by a string, and a
    client's item id is a string of 1-32 characters, as OpenAI checks them; the socket stays."""
    def update(session: dict[str, Any]) -> str:
        return json.dumps({"type": "session.update", "session": {"type": "realtime", **session}})

    def item(item_id: Any) -> str:
        return json.dumps({"type": "conversation.item.create", "item": {
            "id": item_id, "type": "message", "role": "system", "content": [{"type": "input_text", "text": "x"}]}})

    async with live_app(make_settings(redis_url=redis_url), hearing()) as url, \
            websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        await received(ws)
        await ws.send(json.dumps(NO_VAD))
        await received(ws)
        refused = [(update({"max_output_tokens": 10**4000}), "session.max_output_tokens"),
                   (update({"max_output_tokens": 4097}), "session.max_output_tokens"),
                   (update({"audio": {"input": {"transcription": {"model": ["x"]}}}}),
                    "session.audio.input.transcription.model"),
                   *((item(bad), "item.id") for bad in (["a"], {"a": 1}, "", 5))]
        for event, param in refused:
            await ws.send(event)
            errors = [e["error"] for e in await received(ws)]
            assert [(e["code"], e["param"]) for e in errors] == [("invalid_value", param)], event[:80]
        await ws.send(item("x" * 2000))
        [error] = [e["error"] for e in await received(ws)]
        assert (error["code"], error["param"]) == ("string_above_max_length", "item.id")
        assert "maximum length 32, but got a string with length 2000" in error["message"]
        await ws.send(update({"max_output_tokens": 4096}))
        [updated] = await received(ws)
        assert updated["session"]["max_output_tokens"] == 4096
        await ws.send(item("i" * 32))
        assert [e["item"]["id"] for e in await received(ws)] == ["i" * 32] * 2
