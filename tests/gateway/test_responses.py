"""OpenAI's Responses API with the official ``openai`` client, real Redis, the scripted engine.

A response is a chat completion in another shape: these check the shapes (every
stream event is validated against the SDK's own models of them), the translation
of the input items, and the errors. The real engine and an agent framework use it in
test_real_frontdoor.py and tests/frameworks/test_openai_agents.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.responses_models import ResponsesRequest
from gateway.api.chat.responses_out import ResponseShape, response_events
from gateway.output.frames import DONE, FrameBuilder
from omni_adapter.port import ToolCallDelta, Usage
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import live_app, make_settings, state_once_cancelled

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(Script(calls=lambda request, text: [("get_weather", '{"city": "Paris"}')]
                                 if request.tools and "weather" in text else []))


@pytest.fixture
async def sdk(redis_url: str, engine: ScriptedEngine) -> AsyncIterator[AsyncOpenAI]:
    async with live_app(make_settings(redis_url=redis_url), engine) as url:
        yield AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def streamed(sdk: AsyncOpenAI, **request: Any) -> list[dict[str, Any]]:
    """Every event of a streamed response, each checked against the SDK's model of its type."""
    events = []
    async for event in await sdk.responses.create(stream=True, **request):
        events.append(event.to_dict())
        STREAM_EVENT.validate_python(events[-1])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_parallel_calls_each_end_before_the_next_begins(redis_url: str) -> None:
    """A call's arguments are whole when the next call begins: its ``output_item.done`` comes
    then, as OpenAI streams items one after another, so a client runs it while the next one
    streams (it came with the answer's end before)."""
    two = ScriptedEngine(Script(calls=lambda request, text: [("get_weather", '{"city": "Paris"}'),
                                                             ("get_weather", '{"city": "Oslo"}')]))
    async with live_app(make_settings(redis_url=redis_url), two) as url:
        sdk = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        events = await streamed(sdk, model="scripted", input="weather?", tools=[WEATHER], tool_choice="required")
    order = [(e["type"], e.get("output_index")) for e in events
             if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert order == [(kind, index) for index in range(3)  # the text before the calls, then each call
                     for kind in ("response.output_item.added", "response.output_item.done")], order
    final = events[-1]["response"]
    assert [(item["type"], item["status"]) for item in final["output"]] == [
        ("message", "completed"), ("function_call", "completed"), ("function_call", "completed")]
    assert [item["arguments"] for item in final["output"][1:]] == ['{"city": "Paris"}', '{"city": "Oslo"}']


async def test_a_text_answer_streamed_and_not(sdk: AsyncOpenAI, engine: ScriptedEngine) -> None:
    response = await sdk.responses.create(model="scripted", input="hello world", instructions="Be brief.")
    assert response.status == "completed" and response.output_text == "echo: hello world"
    assert response.usage is not None and response.usage.output_tokens > 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert engine.sessions[-1].request.messages == ({"role": "system", "content": "Be brief."},)
    # With a system item of its own: one system message, which every chat template takes.
    await sdk.responses.create(model="scripted", instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hello"}])
    assert engine.sessions[-1].request.messages == ({"role": "system", "content": "Be brief.\n\nAnswer in French."},)

    events = await streamed(sdk, model="scripted", input="hello world", instructions="Be brief.")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "echo: hello world"
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "echo: hello world"
    assert done["usage"]["output_tokens"] == response.usage.output_tokens
    # The SDK's stream helper builds the same response from the events.
    async with sdk.responses.stream(model="scripted", input="hello world") as stream:
        final = await stream.get_final_response()
    assert final.output_text == "echo: hello world"


async def test_a_function_call_and_its_output_streamed_and_not(sdk: AsyncOpenAI, engine: ScriptedEngine) -> None:
    asked = [{"role": "user", "content": [{"type": "input_text", "text": "the weather in Paris?",
                                           "prompt_cache_breakpoint": {"mode": "explicit"}}]}]  # (taken)
    response = await sdk.responses.create(model="scripted", input=asked, tools=[WEATHER])
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]

    events = await streamed(sdk, model="scripted", input=asked, tools=[WEATHER], tool_choice="required")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"city": "Paris"}'
    [added] = [e["item"] for e in events if e["type"] == "response.output_item.added"
               and e["item"]["type"] == "function_call"]
    assert added["name"] == "get_weather" and added["call_id"]

    # The call and its output go back as input, as an agent framework sends them (with a reasoning
    # model's thoughts before it, as they are copied from another provider's answer: left out).
    thoughts = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look it up."}],
                "encrypted_content": "gAAAA"}
    answered = await sdk.responses.create(model="scripted", tools=[WEATHER], input=[
        *asked, thoughts, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert answered.output_text == "echo: sunny, 21 C"
    history = engine.sessions[-1].request.messages
    assert history[-1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.sessions[-1].request.input_role == "tool"


async def test_what_is_not_served_here_is_said(sdk: AsyncOpenAI, engine: ScriptedEngine) -> None:
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"previous_response_id": "resp_1"}, openai.BadRequestError, "previous_response_id"),
        ({"model": "gpt-9"}, openai.NotFoundError, "model"),
        ({"tools": [{"type": "web_search"}]}, openai.BadRequestError, "tools.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, openai.BadRequestError, "input.0"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]},
         openai.BadRequestError, "input.0"),
        ({"background": True}, openai.BadRequestError, "background"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
         openai.BadRequestError, "tool_choice"),
    ]
    for extra, error, param in cases:
        with pytest.raises(error) as raised:
            await sdk.responses.create(**{"model": "scripted", "input": "hi", **extra})
        assert isinstance(raised.value.body, dict) and str(raised.value.body.get("param")).startswith(param), extra
        assert "response_format" not in str(raised.value.body), "named in this API's terms (text.format)"
    assert not engine.sessions, "nothing ran"


# --- the stream's translation, on chat frames as the relay writes them ---------------------

FRAMES = FrameBuilder("sis-1", "scripted", 1)


async def translated(frames: list[str | Exception], request: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Responses events of these chat frames (an exception: raised where the frames are read)."""

    async def read() -> AsyncIterator[ServerSentEvent]:
        for frame in frames:
            if isinstance(frame, Exception):
                raise frame
            name = "error" if frame.startswith('{"error"') else None
            yield ServerSentEvent(data=frame, event=name)

    body = ResponsesRequest.model_validate({"input": "hi", **(request or {})})
    events = [json.loads(event.data) async for event in response_events(read(), ResponseShape.of(body, "m"), "r")]
    for event in events:
        STREAM_EVENT.validate_python(event)
    return events


def rebuilt(events: list[dict[str, Any]]) -> Any:
    """The final response as the SDK's stream helper puts it together from the events."""
    state: ResponseStreamState[None] = ResponseStreamState(input_tools=[], text_format=omit)
    for event in events:
        state.handle_event(STREAM_EVENT.validate_python(event))
    return state._completed_response  # noqa: SLF001  # what .get_final_response() returns


async def test_a_call_whose_pieces_come_between_text_is_one_item() -> None:
    # vLLM's tool parser may hand text and a call's piece in one step, text first.
    events = await translated([
        FRAMES.role(), FRAMES.tool_call(ToolCallDelta(0, "call_a", "get_weather", '{"city": ')),
        FRAMES.content("\n"), FRAMES.tool_call(ToolCallDelta(0, None, None, '"Paris"}')),
        FRAMES.tool_call(ToolCallDelta(1, "call_b", "get_time", "{}")), FRAMES.finish("tool_calls"),
        FRAMES.usage(Usage(3, 5)), DONE])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in final["output"]] == [
        ("function_call", "get_weather", '{"city": "Paris"}'), ("message", None, None),
        ("function_call", "get_time", "{}")]
    assert final["usage"]["output_tokens"] == 5
    sdk_final = rebuilt(events)
    assert [getattr(item, "arguments", None) for item in sdk_final.output] == ['{"city": "Paris"}', None, "{}"]


async def test_an_answer_cut_at_max_output_tokens_is_incomplete_and_a_failed_one_failed() -> None:
    cut = await translated([FRAMES.role(), FRAMES.content("one two"), FRAMES.finish("length"), DONE])
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut[-1]["response"]["output"][0]["status"] == "incomplete"
    aborted = await translated([FRAMES.role(), FRAMES.content("one"), FRAMES.finish("abort"), DONE])
    assert aborted[-1]["type"] == "response.failed"
    failing = errors.CapacityExhausted("no engine slot was free")
    for frames in ([FRAMES.role(), FRAMES.content("one"), failing.envelope_json()], [failing]):
        failed = await translated(frames)
        assert failed[-1]["type"] == "response.failed", frames
        assert failed[-1]["response"]["error"] == {
            "code": "rate_limit_exceeded", "message": "no engine slot was free", "type": "capacity_exhausted"}
    gone = await translated([errors.SessionExpired("the session expired")])
    assert [e["type"] for e in gone] == ["response.created", "response.in_progress", "response.failed"]
    assert gone[-1]["response"]["error"]["code"] == "server_error"


async def test_a_client_that_leaves_a_streamed_response_cancels_its_session(redis_url: str) -> None:
    engine = ScriptedEngine(script=Script(hang=True))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/responses", json={"input": "hi there", "stream": True}) as response:
            sid = response.headers["X-Session-Id"]
            lines = response.aiter_lines()
            while "response.output_text.delta" not in await anext(lines):
                pass
        # The connection is closed here, before the response ended.
        assert await state_once_cancelled(client, sid) == "cancelled" and engine.sessions[0].aborted
