"""The OpenAI Agents SDK's ``RealtimeRunner``, as its docs show it, with only the URL changed.

One session: a text turn, a turn with a function tool the agent calls and
whose output the next answer is given, a spoken turn (server VAD, 20 ms
frames as a microphone sends them), ``interrupt()`` mid-answer, and a next
turn without errors. The SDK validates every server event against its
models (a failure is an ``error`` session event); each raw event is also
checked against the ``openai`` SDK's models here.

The tool turn asks for the call with a raw ``response.create`` naming the
function (the SDK's ``RealtimeModelSendRawMessage``): the 135M default model
does not call tools by itself under ``auto``, and a session-wide ``required``
would make every answer, the one after the tool's output too, call again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.model_inputs import RealtimeModelSendRawMessage

from tests.frameworks.conftest import Gateway
from tests.gateway.test_realtime import conforming
from tests.voice import SPEECH_RATE, pieces, speech

pytestmark = pytest.mark.engine


class Events:
    """A session's events as they come, read by a task of their own."""

    def __init__(self, session: Any) -> None:
        self.seen: list[Any] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._read(session))

    async def _read(self, session: Any) -> None:
        async for event in session:
            async with self._changed:
                self.seen.append(event)
                self._changed.notify_all()

    async def until(self, matches: Callable[[Any], bool], within_sec: float = 120,
                    since: int | None = None) -> Any:
        """The first event that ``matches`` from now on (or from the ``since``-th event seen)."""
        start = len(self.seen) if since is None else since
        try:
            async with asyncio.timeout(within_sec), self._changed:
                while True:
                    found = next((e for e in self.seen[start:] if matches(e)), None)
                    if found is not None:
                        return found
                    await self._changed.wait()
        except TimeoutError:  # say what came instead, or a failure tells nothing
            raise AssertionError(f"not within {within_sec} s; came: {self._summary(start)}") from None

    def _summary(self, start: int) -> list[str]:
        said = []
        for event in self.seen[start:]:
            if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                data = event.data.data
                said.append(data["type"] if data["type"] != "response.done"
                            else f"response.done {data['response']['status']} {data['response'].get('status_details')}")
            elif event.type != "raw_model_event":
                said.append(event.type)
        return said

    def raw(self, kind: str) -> list[dict[str, Any]]:
        return [e.data.data for e in self.seen if e.type == "raw_model_event"
                and e.data.type == "raw_server_event" and e.data.data.get("type") == kind]

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def response_done(event: Any) -> bool:
    return event.type == "raw_model_event" and event.data.type == "raw_server_event" \
        and event.data.data.get("type") == "response.done"


async def test_realtime_runner_text_tool_spoken_interrupt_and_next_turn(gateway: Gateway) -> None:
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return "Sunny and 24 degrees"

    agent = RealtimeAgent(name="Assistant", tools=[get_weather],
                          instructions="You are a helpful assistant. Answer in one short sentence.")
    runner = RealtimeRunner(agent, config={"model_settings": {"max_output_tokens": 24}})
    session = await runner.run(model_config={"url": f"{gateway.ws_url}?model={gateway.model}", "api_key": "unused"})
    async with session:
        events = Events(session)
        try:
            # A text turn.
            await session.send_message("Hello! Say hi back.")
            await events.until(response_done)

            # A function tool the agent calls; its output is given to the next answer.
            await session.model.send_event(RealtimeModelSendRawMessage(message={
                "type": "conversation.item.create", "other_data": {"item": {
                    "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}}}))
            await session.model.send_event(RealtimeModelSendRawMessage(message={
                "type": "response.create", "other_data": {"response": {
                    "tool_choice": {"type": "function", "name": "get_weather"}}}}))
            ended = await events.until(lambda e: e.type == "tool_end")
            assert ended.output == "Sunny and 24 degrees" and len(called) == 1 and called[0]
            await events.until(lambda e: response_done(e) and not any(
                o.get("type") == "function_call" for o in e.data.data["response"]["output"]))
            fed_back = gateway.engine.requests[-1]
            assert fed_back.input_role == "tool", "the tool's output is the next answer's input"
            assert fed_back.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"

            # A spoken turn: a microphone's 20 ms frames, then silence; server VAD answers.
            for frame in pieces(speech("What is the capital of France?") + bytes(SPEECH_RATE), SPEECH_RATE, 20):
                await session.send_audio(frame)
            await events.until(response_done)
            heard = gateway.engine.requests[-1]
            assert heard.input_role == "user"

            # interrupt() mid-answer (the SDK truncates what was played), then a next turn.
            # (Not the spoken turn's answer: with a weather tool at hand the 135M model may
            # answer a capital's question with a call to a function it made up, which the
            # answer leaves out, and nothing is said.)
            await session.send_message("Hello again! Say hi back.")
            await events.until(lambda e: e.type == "audio")
            answering = len(events.seen)  # its response.done may come while interrupt() is sent
            await session.interrupt()
            await events.until(response_done, since=answering)
            await session.send_message("Thanks! Say bye.")
            # Answered (cut off at max_output_tokens is "incomplete", as at OpenAI), not cancelled.
            done = await events.until(response_done)
            assert done.data.data["response"]["status"] in ("completed", "incomplete"), done.data.data
        finally:
            await events.aclose()
    errors = [e for e in events.seen if e.type == "error"]
    assert errors == [], errors
    assert events.raw("conversation.item.truncated"), "interrupt() truncates the answer the user heard"
    for kind in {e.data.data["type"] for e in events.seen if e.type == "raw_model_event"
                 and e.data.type == "raw_server_event"}:
        for raw in events.raw(kind):
            conforming(raw)
    spoken = [e for e in events.raw("conversation.item.input_audio_transcription.completed")]
    assert spoken and "capital" in spoken[0]["transcript"]


async def test_a_text_agent_calls_its_tool_through_the_responses_api(gateway: Gateway) -> None:
    """The SDK's text agents speak the Responses API by default: unchanged but for the client's URL."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from openai import AsyncOpenAI

    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool's result in one sentence.",
                  tools=[get_weather], model=OpenAIResponsesModel(gateway.model, client),
                  # The 135M model calls a tool reliably only when it must; the SDK then resets
                  # the choice, so the second turn answers in words from the tool's output.
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                              run_config=RunConfig(tracing_disabled=True))
    assert asked and asked[0].strip()
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # Both turns went to the engine: the second with the call and its output as history.
    last = gateway.engine.requests[-1]
    assert last.input_role == "tool"
    calls = [call for message in last.messages for call in message.get("tool_calls") or ()]
    assert calls and {call["function"]["name"] for call in calls} == {"get_weather"}
    streamed = Runner.run_streamed(Agent(name="plain", instructions="Answer in one short sentence.",
                                         model=OpenAIResponsesModel(gateway.model, client),
                                         model_settings=ModelSettings(max_tokens=16, temperature=0)),
                                   "What is the capital of France?", run_config=RunConfig(tracing_disabled=True))
    kinds = {event.type async for event in streamed.stream_events()}
    assert "raw_response_event" in kinds and isinstance(streamed.final_output, str) and streamed.final_output


async def test_a_text_agent_over_the_responses_websocket_chains_its_turns(gateway: Gateway) -> None:
    """The SDK's WebSocket transport (``OpenAIResponsesWSModel``, what
    ``set_default_openai_responses_transport("websocket")`` picks) with response chaining: the
    turn after the tool call sends only the call's output, continuing the first response by its
    ``previous_response_id`` on the same socket."""
    from agents import Agent, ModelSettings, OpenAIResponsesWSModel, RunConfig, Runner
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny and 21 degrees in {city}."

    client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesWSModel(gateway.model, client)
    sent: list[dict[str, Any]] = []
    send = model._iter_websocket_response_events

    def watched(create_kwargs: dict[str, Any]) -> Any:  # (what it sends, read on the way)
        sent.append(create_kwargs)
        return send(create_kwargs)

    model._iter_websocket_response_events = watched  # type: ignore[method-assign]
    agent = Agent(name="weather", instructions="Answer with the tool's result in one sentence.",
                  tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                               temperature=0))
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3, auto_previous_response_id=True,
                                  run_config=RunConfig(tracing_disabled=True))
    finally:
        await model.close()
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(sent) == 2 and sent[1]["previous_response_id"] == result.raw_responses[0].response_id
    assert [item["type"] for item in sent[1]["input"]] == ["function_call_output"]
    first, last = gateway.engine.requests[-2:]
    # The first turn's question and call came from the connection: the SDK sent only the output.
    assert last.input_role == "tool"
    assert [m["role"] for m in last.messages] == [*(m["role"] for m in first.messages), "user", "assistant"]
    assert last.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
