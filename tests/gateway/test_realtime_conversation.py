"""The GA conversation events on /v1/realtime: items, responses, function calls (scripted engine).

Every event received is checked against the ``openai`` SDK's own models
(``conforming``). The scripted engine answers ``echo: <input>``; a session's
``request.messages`` is the history the model was given.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets

from omni_adapter.listener import with_listener
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import (
    TEXT_ONLY,
    answer_text,
    conforming,
    resumed_until_done,
    sdk,
    text_turn,
    types,
    until,
)
from tests.voice import SPEECH_RATE, pieces, speech

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def history(engine: ScriptedEngine, index: int = -1) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in engine.sessions[index].request.messages]


@pytest.fixture
async def served(redis_url: str) -> AsyncIterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url:
        yield url, engine


async def test_items_are_placed_retrieved_deleted_and_seed_the_history(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    async with sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={**TEXT_ONLY, "instructions": "Be brief."})
        await until(conn, "session.updated")
        # A framework seeds the history: system, user and assistant items, then asks.
        for item in ({"id": "sys1", "type": "message", "role": "system",
                      "content": [{"type": "input_text", "text": "Speak French."}]},
                     {"id": "u1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                     {"id": "a1", "type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": "bonjour"}]}):
            await conn.conversation.item.create(item=item)
            added = await until(conn, "conversation.item.done")
            assert added[0]["type"] == "conversation.item.added" and added[0]["item"]["id"] == item["id"]
        await conn.conversation.item.create(previous_item_id="root", item={
            "id": "first", "type": "message", "role": "system", "content": [{"type": "input_text", "text": "Hello."}]})
        placed = await until(conn, "conversation.item.done")
        assert placed[0]["previous_item_id"] is None
        await conn.conversation.item.create(previous_item_id="u1", item={
            "id": "mid", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "ça va"}]})
        assert (await until(conn, "conversation.item.done"))[0]["previous_item_id"] == "u1"
        await conn.conversation.item.delete(item_id="first")
        assert (await until(conn, "conversation.item.deleted"))[-1]["item_id"] == "first"
        await conn.conversation.item.retrieve(item_id="a1")
        assert (await until(conn, "conversation.item.retrieved"))[-1]["item"]["content"][0]["text"] == "bonjour"
        for event, code in ((conn.conversation.item.retrieve(item_id="nope"), "item_retrieve_invalid_item_id"),
                            (conn.conversation.item.delete(item_id="nope"), "item_delete_invalid_item_id"),
                            (conn.conversation.item.truncate(item_id="nope", content_index=0, audio_end_ms=0),
                             "item_truncate_invalid_item_id"),
                            (conn.response.cancel(), "response_cancel_not_active")):
            await event
            assert (await until(conn, "error"))[-1]["error"]["code"] == code
        events = await text_turn(conn, "comment?")
        assert answer_text(events) == "echo: comment?"
    assert history(engine) == [("system", "Be brief."), ("system", "Speak French."), ("user", "hi"),
                               ("user", "ça va"), ("assistant", "bonjour")]


async def test_truncate_cuts_what_was_not_heard_and_the_next_turn_sees_the_cut(redis_url: str) -> None:
    from omni_adapter.scripted import echo
    from omni_adapter.talker import with_talker

    engine = ScriptedEngine(Script(answer=lambda request, text: echo(request, "One two. Three four five. Six.")))
    async with live_app(make_settings(redis_url=redis_url), with_talker(engine)) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        events = await text_turn(conn, "count")
        said = [e for e in events if e["type"] == "response.output_audio.delta"]
        item_id = said[0]["item_id"]
        heard_ms = len(base64.b64decode(said[0]["delta"])) // 48  # the first sentence's audio
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=heard_ms)
        truncated = (await until(conn, "conversation.item.truncated"))[-1]
        assert truncated["audio_end_ms"] == heard_ms
        await conn.conversation.item.retrieve(item_id=item_id)
        kept = (await until(conn, "conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
        assert kept == "echo: One two."
        # Beyond what was sent is clamped, not an error.
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=10**9)
        assert (await until(conn, "conversation.item.truncated"))[-1]["audio_end_ms"] == heard_ms
        await text_turn(conn, "again")
    assert history(engine)[-1] == ("assistant", "echo: One two.")


async def test_the_assistant_speaks_first_and_again_after_itself(served: tuple[str, ScriptedEngine]) -> None:
    """A voice agent's greeting: response.create before anything is said answers the session's
    instructions (as a conversation of the system message alone); after the assistant's own item,
    response.create answers again (a new turn, as vLLM renders it)."""
    url, engine = served
    async with sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={**TEXT_ONLY, "instructions": "Greet the user warmly."})
        await conn.response.create()
        greeting = await until(conn, "response.done")
        assert greeting[-1]["response"]["status"] == "completed"
        assert answer_text(greeting) == "echo: Greet the user warmly."
        request = engine.sessions[-1].request
        assert request.input_role == "system" and request.messages == (), "the instructions once, as the input"
        await conn.response.create()
        again = await until(conn, "response.done")
        assert answer_text(again) == "echo: echo: Greet the user warmly."
        assert engine.sessions[-1].request.input_role == "assistant"
        assert history(engine) == [("system", "Greet the user warmly.")]


async def test_response_parameters_and_an_out_of_band_answer(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    async with sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session=TEXT_ONLY)
        await text_turn(conn, "first")
        # An out-of-band answer: its own instructions and input; the conversation gets nothing.
        await conn.response.create(response={
            "conversation": "none", "instructions": "Classify.", "metadata": {"topic": "triage"},
            "max_output_tokens": 7, "output_modalities": ["text"],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "side"}]}]})
        side = await until(conn, "response.done")
        assert answer_text(side) == "echo: side"
        assert not [e for e in side if e["type"].startswith("conversation.item")]
        done = side[-1]["response"]
        assert done["metadata"] == {"topic": "triage"} and done["conversation_id"] is None
        assert done["max_output_tokens"] == 7
        request = engine.sessions[-1].request
        assert request.sampling.max_tokens == 7 and history(engine) == [("system", "Classify.")]
        # Null fields are fields not given (LiveKit's plugin sends instructions: null).
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "second"}]})
        await conn.response.create(response={"instructions": None, "conversation": None, "input": None})
        second = await until(conn, "response.done")
        assert answer_text(second) == "echo: second"
    assert history(engine) == [("system", "You are a helpful assistant."), ("user", "first"),
                               ("assistant", "echo: first")], "the out-of-band answer is not in the history"


async def test_a_function_call_then_its_output_feeds_the_next_answer(redis_url: str) -> None:
    engine = ScriptedEngine(Script(calls=lambda request, text: [("get_weather", '{"city": "Paris"}')]
                                   if request.input_role == "user" else []))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={**TEXT_ONLY, "tools": [WEATHER], "tool_choice": "auto"})
        updated = await until(conn, "session.updated")
        assert updated[-1]["session"]["tools"][0]["name"] == "get_weather"
        events = await text_turn(conn, "weather in Paris?")
        order = types(events)
        assert order.index("response.function_call_arguments.delta") < \
            order.index("response.function_call_arguments.done") < order.index("response.done")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
        [call] = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
        assert call["call_id"] == done["call_id"] and call["status"] == "completed"
        assert engine.sessions[-1].request.tools[0]["function"]["name"] == "get_weather"

        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "sunny, 24 C"})
        await until(conn, "conversation.item.done")
        await conn.response.create()
        answered = await until(conn, "response.done")
    assert answer_text(answered) == "echo: sunny, 24 C"
    request = engine.sessions[-1].request
    assert (request.input_role, request.input_tool_call_id) == ("tool", call["call_id"])
    assert request.messages[-1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}


async def test_parallel_tool_calls_is_a_session_setting_a_response_may_override(redis_url: str) -> None:
    """The SDK's ``parallel_tool_calls`` (session and response): false reaches the engine as
    "at most one call"; a response's own value wins; anything but a boolean is an error event."""
    engine = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={**TEXT_ONLY, "tools": [WEATHER], "parallel_tool_calls": False})
        updated = await until(conn, "session.updated")
        assert updated[-1]["session"]["parallel_tool_calls"] is False
        await text_turn(conn, "one")
        assert engine.sessions[-1].request.parallel_tool_calls is False
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]})
        await conn.response.create(response={"parallel_tool_calls": True})
        await until(conn, "response.done")
        assert engine.sessions[-1].request.parallel_tool_calls is True
        await conn.send({"type": "session.update", "session": {"parallel_tool_calls": "no"}})  # type: ignore[typeddict-item]
        refused = await until(conn, "error")
        assert refused[-1]["error"]["param"] == "session.parallel_tool_calls"
        await text_turn(conn, "three")  # the session as it was
        assert engine.sessions[-1].request.parallel_tool_calls is False


async def test_required_without_parallel_calls_is_one_call_on_the_real_engine(redis_url: str, vllm_engine: Any) -> None:
    """``tool_choice: required`` on the 135M model wrote the same call twice in two answers of
    four (at the model's default sampling); with ``parallel_tool_calls: false`` each holds one."""
    async with live_app(make_settings(redis_url=redis_url), vllm_engine) as url:
        for _ in range(3):
            async with sdk(url).realtime.connect(model=vllm_engine.capabilities.model_names[0]) as conn:
                await conn.session.update(session={**TEXT_ONLY, "tools": [WEATHER], "tool_choice": "required",
                                                   "parallel_tool_calls": False, "max_output_tokens": 60})
                await until(conn, "session.updated")
                events = await text_turn(conn, "What is the weather in Lima?")
            calls = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
            assert len(calls) == 1, calls
            assert calls[0]["name"] == "get_weather" and "city" in json.loads(calls[0]["arguments"]), calls


async def test_a_second_response_while_one_runs_gets_openais_code_and_rate_limits_follow_each(
        redis_url: str) -> None:
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine(Script(word_delay_sec=0.1))) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session=TEXT_ONLY)
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a b c d"}]})
        await conn.response.create()
        await until(conn, "response.created")
        await conn.response.create()
        refused = await until(conn, "error")
        assert refused[-1]["error"]["code"] == "conversation_already_has_active_response"
        events = await until(conn, "rate_limits.updated")
        assert types(events).index("response.done") < len(events) - 1
        limit = events[-1]["rate_limits"][0]
        assert limit["name"] == "requests" and 0 < limit["remaining"] <= limit["limit"]


async def test_speech_during_an_answer_without_interrupt_is_kept_and_answered_next(redis_url: str) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=0.15))
    quiet = bytes(2 * SPEECH_RATE // 5)
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}}})
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two three four"}]})
        await conn.response.create()
        await until(conn, "response.output_text.delta")
        for piece in [*pieces(speech("What is the capital of France?"), SPEECH_RATE, 20), quiet, quiet, quiet]:
            await conn.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        first = await until(conn, "response.done")
        assert first[-1]["response"]["status"] == "completed", "no barge-in"
        assert not [e for e in first if e["type"] == "error"], "no error per audio frame"
        second = await until(conn, "response.done", within_sec=60)
    assert "input_audio_buffer.speech_started" in types(second)
    assert answer_text(second) == "echo: What is the capital of France?"


async def test_idle_timeout_triggers_a_response(redis_url: str) -> None:
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url, \
            sdk(url).realtime.connect(model="scripted") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 300}}}})
        await until(conn, "session.updated")
        await text_turn(conn, "hello")
        events = await until(conn, "response.done", within_sec=10)
        triggered = next(e for e in events if e["type"] == "input_audio_buffer.timeout_triggered")
        # As at OpenAI: the silence is the user's committed (empty) audio item, then answered.
        await conn.conversation.item.retrieve(item_id=triggered["item_id"])
        retrieved = (await until(conn, "conversation.item.retrieved"))[-1]["item"]
    order = types(events)
    assert order.index("input_audio_buffer.timeout_triggered") < order.index("input_audio_buffer.committed") \
        < order.index("response.created")
    assert next(e for e in events if e["type"] == "input_audio_buffer.committed")["item_id"] == triggered["item_id"]
    assert retrieved["role"] == "user" and retrieved["content"][0]["type"] == "input_audio"
    assert answer_text(events).startswith("echo: The user has said nothing")


async def test_a_resume_after_a_request_event_replays_only_what_came_after(redis_url: str) -> None:
    """``session.updated`` answers the client's request, not a frame: a resume after it gets
    the answer's events after it, none before it again and none lost."""
    settings = make_settings(redis_url=redis_url)
    words = "one two three four five six"
    async with live_app(settings, ScriptedEngine(Script(word_delay_sec=0.2))) as a, \
            live_app(settings, ScriptedEngine()) as b:
        ws = await websockets.connect(a.replace("http", "ws") + "/v1/realtime")
        session_id = json.loads(await ws.recv())["session"]["id"]
        for event in ({"type": "session.update", "session": TEXT_ONLY},
                      {"type": "conversation.item.create", "item": {
                          "type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}},
                      {"type": "response.create"}):
            await ws.send(json.dumps(event))
        before: list[dict[str, Any]] = []
        while sum(e["type"] == "response.output_text.delta" for e in before) < 2:
            before.append(conforming(json.loads(await ws.recv())))
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        while before[-1]["type"] != "session.updated":
            before.append(conforming(json.loads(await ws.recv())))
        ws.transport.abort()
        after = await resumed_until_done(b, session_id, before[-1]["event_id"])
    assert answer_text(before) + answer_text(after) == f"echo: {words}"
    assert "response.created" not in types(after)
