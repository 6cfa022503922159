"""The Responses API's WebSocket mode (``/v1/responses``): the official SDK's
``responses.connect()`` and a raw socket, real Redis, the scripted engine.

The real engine answers it in the last test here; LiveKit's ``openai.responses.LLM`` uses it in
tests/frameworks/test_livekit.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets
from openai import AsyncOpenAI
from openai.lib.responses_websocket import AsyncResponsesWebSocketSession, ResponsesWebSocketLimits
from openai.types.responses.responses_client_event import ResponseCreate
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from gateway.api.chat import responses_socket
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import live_app, make_settings, state_once_cancelled
from tests.gateway.test_responses import WEATHER, engine, streamed

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(ResponsesServerEvent)
__all__ = ["engine"]  # the POST's tests' scripted engine: it calls get_weather when asked the weather
KEY = "sk-socket"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
async def url(redis_url: str, engine: ScriptedEngine) -> AsyncIterator[str]:
    async with live_app(make_settings(redis_url=redis_url), engine) as served:
        yield served


def sdk(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def ws_url(url: str) -> str:
    return url.replace("http", "ws") + "/v1/responses"


async def until_end(events: AsyncIterator[Any]) -> list[dict[str, Any]]:
    """A response's events (or one ``error``), each checked against the SDK's model of its type."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(30):
        async for event in events:
            got.append(event.to_dict() if hasattr(event, "to_dict") else json.loads(event))
            SERVER_EVENT.validate_python(got[-1])
            if got[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                return got
    raise AssertionError(f"the socket closed after {got}")


def alike(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events without what differs between two runs of the same request (ids, times)."""
    text = json.dumps(events)
    ids = {e["response"]["id"] for e in events if "response" in e}
    for response_id in ids:
        text = text.replace(response_id, "ID")
    found = json.loads(text)
    for event in found:
        if "response" in event:
            event["response"]["created_at"] = 0
    return found


async def test_two_turns_and_a_function_call_round_trip_with_the_sdk(url: str, engine: ScriptedEngine) -> None:
    async with sdk(url).responses.connect() as connection:
        await connection.response.create(model="scripted", input="hello there", store=False, instructions="Be brief.")
        first = await until_end(connection)
        assert first[-1]["type"] == "response.completed"
        answer = first[-1]["response"]
        assert answer["output"][0]["content"][0]["text"] == "echo: hello there"

        # The second turn sends only its new input: the first one's items come before it.
        await connection.response.create(model="scripted", input="what is the weather?", tools=[WEATHER],
                                         tool_choice="required", previous_response_id=answer["id"], store=False)
        second = await until_end(connection)
        called = second[-1]["response"]
        assert called["previous_response_id"] == answer["id"]
        [call] = [item for item in called["output"] if item["type"] == "function_call"]
        assert call["name"] == "get_weather"
        request = engine.sessions[-1].request
        # (The instructions are not carried over, as OpenAI's are not: each response has its own.)
        assert [m["role"] for m in request.messages] == ["user", "assistant"]
        assert request.messages[-1]["content"] == "echo: hello there"

        # Its result goes back as a function_call_output continuing the call's response.
        await connection.response.create(model="scripted", tools=[WEATHER], previous_response_id=called["id"],
                                         input=[{"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "Sunny"}])
        third = await until_end(connection)
        assert third[-1]["type"] == "response.completed"
        request = engine.sessions[-1].request
        assert request.input_role == "tool"
        assert request.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert [m["role"] for m in request.messages] == ["user", "assistant", "user", "assistant"]


async def test_the_events_are_those_of_the_streamed_post(url: str) -> None:
    asked = {"model": "scripted", "input": "what is the weather?", "tools": [WEATHER], "instructions": "Be brief."}
    posted = await streamed(sdk(url), **asked)
    async with websockets.connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"type": "response.create", **asked}))
        sent = await until_end(aiter(ws))
    assert alike(sent) == alike(posted)


async def test_what_cannot_be_taken_is_an_error_event_and_the_connection_goes_on(url: str) -> None:
    async with websockets.connect(ws_url(url)) as ws:
        async def refused(raw: str) -> dict[str, Any]:
            await ws.send(raw)
            [event] = await until_end(aiter(ws))
            assert event["type"] == "error" and set(event["error"]) == {"type", "code", "message", "param"}
            return event

        assert (await refused("{not json"))["error"]["code"] == "invalid_json"
        unknown = await refused(json.dumps({"type": "response.cancel"}))
        assert unknown["status"] == 400 and unknown["error"]["param"] == "type"
        assert "no event type" in (await refused(json.dumps({"input": "hi"})))["error"]["message"]
        hot = await refused(json.dumps({"type": "response.create", "input": "hi", "temperature": 5}))
        assert hot["status"] == 400 and hot["error"]["param"] == "temperature"
        behind = await refused(json.dumps({"type": "response.create", "input": "hi", "background": True}))
        assert behind["error"]["param"] == "background"
        lane = await refused(json.dumps({"type": "response.create", "input": "hi", "stream_id": ""}))
        assert lane["error"]["code"] == "invalid_stream_id" and "stream_id" not in lane
        named = await refused(json.dumps({"type": "response.create", "input": "hi", "stream_id": "main",
                                          "temperature": 5}))
        assert named["stream_id"] == "main" and named["error"]["param"] == "temperature"
        missing = await refused(json.dumps({"type": "response.create", "input": "hi",
                                            "previous_response_id": "resp_nope"}))
        assert missing["error"] == {"type": "invalid_request_error", "code": "previous_response_not_found",
                                    "message": "Previous response with id 'resp_nope' not found.",
                                    "param": "previous_response_id"}

        # ``stream`` is implicit (Codex sends it anyway), and the connection answers after all of that.
        await ws.send(json.dumps({"type": "response.create", "model": "scripted", "input": "hi", "stream": True}))
        assert (await until_end(aiter(ws)))[-1]["type"] == "response.completed"


async def test_only_the_last_response_is_kept_and_a_failed_continuation_drops_it(url: str) -> None:
    async with websockets.connect(ws_url(url)) as ws:
        async def ask(**fields: Any) -> dict[str, Any]:
            await ws.send(json.dumps({"type": "response.create", "model": "scripted", **fields}))
            return (await until_end(aiter(ws)))[-1]

        first = (await ask(input="one"))["response"]["id"]
        second = (await ask(input="two"))["response"]["id"]
        assert (await ask(input="three", previous_response_id=first))["error"]["code"] == "previous_response_not_found"
        assert (await ask(input="three", previous_response_id=second))["type"] == "response.completed"
        third = (await ask(input="four"))["response"]["id"]
        # A continuation that fails evicts the response it named, as OpenAI's cache does.
        assert (await ask(input="five", previous_response_id=third, temperature=5))["type"] == "error"
        assert (await ask(input="five", previous_response_id=third))["error"]["code"] == "previous_response_not_found"


async def test_a_warmup_generates_nothing_and_is_continued_from(url: str, engine: ScriptedEngine) -> None:
    """``generate: false`` (the SDK's documented warmup, Codex's prewarm): a response without output
    whose input the next response starts from."""
    async with sdk(url).responses.connect() as connection:
        # (As the SDK's README has it: its event model, with generate as an extra field.)
        await connection.send(ResponseCreate(type="response.create", model="scripted", generate=False,
                                             input=[{"role": "developer", "content": "Be brief."}]))
        warm = await until_end(connection)
        assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        assert warm[-1]["response"]["output"] == [] and not engine.sessions, "nothing ran"
        await connection.response.create(model="scripted", input="hello", previous_response_id=warm[-1]["response"]["id"])
        assert (await until_end(connection))[-1]["type"] == "response.completed"
        assert engine.sessions[-1].request.messages == ({"role": "system", "content": "Be brief."},)


async def test_responses_asked_at_once_run_one_after_another(url: str) -> None:
    async with websockets.connect(ws_url(url)) as ws:
        for word in ("first", "second", "third"):
            await ws.send(json.dumps({"type": "response.create", "model": "scripted", "input": word}))
        for word in ("first", "second", "third"):
            events = await until_end(aiter(ws))
            assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
            assert events[-1]["response"]["output"][0]["content"][0]["text"] == f"echo: {word}"


async def test_a_client_that_leaves_mid_response_cancels_its_session(redis_url: str) -> None:
    engine = ScriptedEngine(script=Script(hang=True))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, httpx.AsyncClient(base_url=url) as client:
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "hi there"}))
            sid = json.loads(await ws.recv())["response"]["id"]  # (response.created: the session's id)
            while json.loads(await ws.recv())["type"] != "response.output_text.delta":
                pass
        # The socket is closed here, before the response ended.
        assert await state_once_cancelled(client, sid) == "cancelled" and engine.sessions[0].aborted


async def test_named_lanes_each_keep_their_last_response_and_fork(
        url: str, engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stream_id`` lanes through the SDK's own lane helper: each lane's events carry its id, a
    lane continues its own last response, another lane forks it."""
    limits = ResponsesWebSocketLimits(max_lanes=8, max_events_per_lane=256, max_events=1024,
                                      max_bytes_per_lane=1 << 24, max_bytes=1 << 25)
    async with sdk(url).responses.connect() as connection, \
            AsyncResponsesWebSocketSession(connection, limits=limits) as session:
        first, second = session.lane("first"), session.lane("second")
        for lane, word in ((first, "one"), (second, "two")):
            await lane.send({"type": "response.create", "model": "scripted", "input": word})
        one, two = await asyncio.gather(first.get_final_response(), second.get_final_response())
        assert (one.output_text, two.output_text) == ("echo: one", "echo: two")

        await first.send({"type": "response.create", "model": "scripted", "input": "three",
                          "previous_response_id": one.id})
        assert (await first.get_final_response()).status == "completed"
        assert [m["content"] for m in engine.sessions[-1].request.messages] == ["one", "echo: one"]
        fork = session.lane("fork")
        await fork.send({"type": "response.create", "model": "scripted", "input": "four",
                         "previous_response_id": two.id})
        assert (await fork.get_final_response()).status == "completed"
        assert [m["content"] for m in engine.sessions[-1].request.messages] == ["two", "echo: two"]

    monkeypatch.setattr(responses_socket, "MAX_LANES", 1)
    async with websockets.connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "scripted", "input": "a", "stream_id": "a"}))
        answered = await until_end(aiter(ws))
        assert {e.get("stream_id") for e in answered} == {"a"}
        await ws.send(json.dumps({"type": "response.create", "model": "scripted", "input": "b", "stream_id": "b"}))
        [refused] = await until_end(aiter(ws))
        assert refused["stream_id"] == "b" and refused["error"]["code"] == "websocket_stream_limit_reached"


async def test_post_still_refuses_previous_response_id(url: str) -> None:
    with pytest.raises(Exception) as refused:
        await sdk(url).responses.create(model="scripted", input="hi", previous_response_id="resp_x")
    assert getattr(refused.value, "status_code", None) == 400


async def test_the_handshake_authenticates_as_the_http_route_does(redis_url: str) -> None:
    async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), ScriptedEngine()) as url:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url(url)):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url(url), additional_headers={"Authorization": "Bearer sk-wrong"}):
                pass
        assert refused.value.response.status_code == 401
        async with sdk(url, KEY).responses.connect() as connection:
            await connection.response.create(model="scripted", input="hi")
            assert (await until_end(connection))[-1]["type"] == "response.completed"


async def test_a_connection_past_openais_hour_is_told_to_open_another(url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responses_socket, "LIFETIME_SEC", 0)
    async with websockets.connect(ws_url(url)) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "scripted", "input": "hi"}))
        [event] = await until_end(aiter(ws))
        assert event["error"]["code"] == "websocket_connection_limit_reached"


@pytest.mark.engine
async def test_the_real_engine_over_the_sdk_two_turns_then_a_function_call_round_trip(
        redis_url: str, vllm_engine: Any) -> None:
    """SmolLM2 on the CPU: short prompts, few tokens. Each turn sends only its new input."""
    async with live_app(make_settings(redis_url=redis_url), vllm_engine) as served, \
            sdk(served).responses.connect() as connection:
        async def ask(**fields: Any) -> dict[str, Any]:
            await connection.response.create(model=MODEL, temperature=0, store=False, **fields)
            end = (await until_end(connection))[-1]
            assert end["type"] in ("response.completed", "response.incomplete"), end
            return dict(end["response"])

        first = await ask(input="My name is Ada. Say hi.", max_output_tokens=12)
        asked = await ask(input="What is the weather in Paris?", previous_response_id=first["id"], tools=[WEATHER],
                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=40)
        # The first turn's input and answer came before the question.
        assert asked["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        [call] = [item for item in asked["output"] if item["type"] == "function_call"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
        told = await ask(previous_response_id=asked["id"], tools=[WEATHER], max_output_tokens=24, input=[
            {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny and 24 degrees"}])
        assert told["usage"]["input_tokens"] > asked["usage"]["input_tokens"]
        [message] = [item for item in told["output"] if item["type"] == "message"]
        assert message["content"][0]["text"].strip()
