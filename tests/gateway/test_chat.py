"""The OpenAI front door with the official ``openai`` client, real Redis, the scripted engine.

A chat completion is a session whose input has ended: the same runner,
limits and errors. The real-engine runs are in test_real_engine.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.runtime.app import create_app
from omni_adapter.port import Capabilities
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from tests.gateway.client import (
    BASE,
    app_client,
    live_app,
    live_server,
    make_settings,
    openai_client,
    state_once_cancelled,
)
from tests.gateway.test_api import assert_error
from tests.omni_adapter.sessions import MODEL
from tests.omni_adapter.test_http_engine import NO_AUTO_TOOLS, refusing_sidecar

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hello world"}]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def client(redis_url: str, engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), engine) as c:
        yield c


async def test_streamed_and_non_streamed_answers_agree(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    oai = openai_client(client)
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    completion = await oai.chat.completions.create(model="scripted", messages=messages, temperature=0)
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "echo: hello\nworld"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    # History went in as the session's messages; the last message as its input.
    session = engine.sessions[0]
    assert session.request.messages == ({"role": "system", "content": "be brief"},)
    assert [c.data for c in session.fed] == [b"hello\nworld"]

    stream = await oai.chat.completions.create(model="scripted", messages=messages, temperature=0,
                                               stream=True, stream_options={"include_usage": True,
                                                                            "include_obfuscation": False})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == completion.usage


async def test_the_assistant_answers_whoever_spoke_last(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    """A conversation of a system message alone (the assistant speaks first: a voice agent's
    greeting), or one that ends with the assistant's message (a new turn after it), is answered
    as vLLM answers it: the last message, whoever's, is the input."""
    oai = openai_client(client)
    greeting = await oai.chat.completions.create(model="scripted", messages=[
        {"role": "system", "content": "Greet the user."}])
    assert greeting.choices[0].message.content == "echo: Greet the user."
    assert engine.sessions[-1].request.input_role == "system" and engine.sessions[-1].request.messages == ()
    again = await oai.chat.completions.create(model="scripted", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"}])
    assert again.choices[0].message.content == "echo: Hello! How can I help?"
    request = engine.sessions[-1].request
    assert request.input_role == "assistant" and request.messages == ({"role": "user", "content": "hi"},)
    refused = await oai.chat.completions.create(model="scripted", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}])
    assert refused.choices[0].message.content == "echo: No.", "a refusal is what the assistant said"


async def test_an_answer_sent_back_as_the_sdk_dumps_it_is_history(client: httpx.AsyncClient,
                                                                  engine: ScriptedEngine) -> None:
    """``completion.choices[0].message.model_dump()`` carries ``refusal``, ``annotations``,
    ``audio`` and ``function_call``, all null: a multi-turn client sends that back as is. A
    refusal is what the assistant said; an audio id alone says nothing this server kept."""
    oai = openai_client(client)
    first = await oai.chat.completions.create(model="scripted", messages=USER)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    parts = {"role": "assistant", "content": [{"type": "refusal", "refusal": "Not that either."}]}
    spoken = {"role": "assistant", "content": None, "audio": {  # a spoken answer's dump
        "id": "audio_1", "data": "AAAA", "expires_at": 1, "transcript": "Said aloud."}}
    again = await oai.chat.completions.create(model="scripted", messages=[
        *USER, dumped, {"role": "user", "content": "and this"}, refused, parts, spoken,
        {"role": "user", "content": "ok"}])
    assert again.choices[0].message.content == "echo: ok"
    history = engine.sessions[-1].request.messages
    assert [m["content"] for m in history] == ["hello world", "echo: hello world", "and this",
                                               "I cannot help with that.", "Not that either.", "Said aloud."]
    for bad, param in [({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "messages.1"),
                       ({"role": "user", "content": "x", "refusal": "no"}, "messages.1"),
                       ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
                        "messages.1.function_call")]:
        response = await client.post(CHAT, json={"model": "scripted", "messages": [*USER, bad, *USER]})
        assert assert_error(response, 400, "validation_error")["param"] == param, bad


async def test_template_variables_and_a_reasoning_effort_reach_the_engine_as_vllm_makes_them(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    """vLLM's ``chat_template_kwargs`` (a Qwen3 model's ``enable_thinking``), on chat completions,
    responses and the sessions API; a reasoning effort is the template's too, as vLLM passes it."""
    oai = openai_client(client)
    hi = [{"role": "user", "content": "hi"}]
    await oai.chat.completions.create(model="scripted", messages=hi,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    await oai.chat.completions.create(model="scripted", messages=hi, reasoning_effort="none")
    await oai.chat.completions.create(model="scripted", messages=hi, reasoning_effort="high",
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    await oai.responses.create(model="scripted", input="hi", reasoning={"effort": "low"})
    # On the Responses API too (the OpenAI Agents SDK's default model), beside OpenAI's options
    # that change nothing here (the whole conversation is sent each time: nothing to compact).
    await oai.responses.create(model="scripted", input="hi", extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "prompt_cache_options": {"mode": "implicit"},
        "context_management": [{"type": "compaction", "compact_threshold": 200000}]})
    # A reasoning model's thoughts on an earlier answer, sent back as vLLM's clients do: left out.
    await oai.chat.completions.create(model="scripted", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
        {"role": "user", "content": "hi"}])  # type: ignore[list-item]
    created = await client.post("/v1/streaming_input/sessions", json={
        "model": "scripted", "chat_template_kwargs": {"enable_thinking": False}})
    assert created.status_code == 201, created.text
    await client.post(f"/v1/streaming_input/sessions/{created.json()['session_id']}/chunks",
                      json={"sequence_id": 0, "text": "hi"})
    await client.post(f"/v1/streaming_input/sessions/{created.json()['session_id']}/finish", json={})
    async with asyncio.timeout(5):
        while len(engine.sessions) < 7:  # noqa: ASYNC110 (the engine work starts on its own)
            await asyncio.sleep(0.01)
    assert [s.request.chat_template_kwargs for s in engine.sessions] == [
        {"enable_thinking": False},
        {"enable_thinking": False, "reasoning_effort": "none"},
        {"enable_thinking": False, "reasoning_effort": "high"},
        {"enable_thinking": True, "reasoning_effort": "low"},
        {"enable_thinking": False}, {},
        {"enable_thinking": False}]
    assert engine.sessions[5].request.messages[1] == {"role": "assistant", "content": "hello"}
    refused = await client.post("/v1/chat/completions", json={
        "model": "scripted", "messages": hi, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}})
    assert assert_error(refused, 400, "validation_error")["param"] == "chat_template_kwargs"


async def test_the_session_behind_a_completion_is_readable(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json={"messages": USER})
    assert response.status_code == 200, response.text
    sid = response.headers["X-Session-Id"]
    assert response.json()["id"] == sid
    result = (await client.get(f"{BASE}/{sid}/result")).json()
    assert result["state"] == "completed" and result["completion"] == response.json()


async def test_models_lists_what_the_engine_serves(client: httpx.AsyncClient) -> None:
    models = await openai_client(client).models.list()
    assert [m.id for m in models.data] == ["scripted"]
    assert models.data[0].object == "model"


async def test_a_model_served_under_several_names_answers_to_each(redis_url: str) -> None:
    # As vLLM's --served-model-name a b: a framework that asks for its own default finds it.
    names = ("scripted", "gpt-4o-mini")
    engine = ScriptedEngine(capabilities=replace(text_capabilities(), model_names=names))
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        oai = openai_client(client)
        assert [m.id for m in (await oai.models.list()).data] == list(names)
        assert (await oai.models.retrieve("gpt-4o-mini")).id == "gpt-4o-mini"
        completion = await oai.chat.completions.create(model="gpt-4o-mini", messages=USER)
        assert completion.model == "gpt-4o-mini" and completion.choices[0].message.content == "echo: hello world"
        with pytest.raises(openai.NotFoundError) as raised:
            await oai.chat.completions.create(model="gpt-4o", messages=USER)
        assert "scripted, gpt-4o-mini" in raised.value.message


async def test_streams_that_outlast_a_keep_alive_ping_read_whole_by_the_sdk_and_by_vllms_benchmark(
        redis_url: str) -> None:
    """The SDK takes a blank line after an ``id:`` for an event, so a ping's must not be one when
    the stream has ids (``X-Event-Ids``, for a resume); vLLM's ``vllm bench serve`` splits events
    on ``\n\n`` and reads each as ``data: <json>`` alone, so an OpenAI-shaped stream has neither
    ids nor a ping glued to the next event."""
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    words = "one two three four five six seven eight nine ten eleven twelve"
    engine = ScriptedEngine(Script(word_delay_sec=0.25))
    body = {"model": "scripted", "messages": [{"role": "user", "content": words}], "stream": True}
    async with live_app(make_settings(redis_url=redis_url, sse_ping_sec=1), engine) as url:
        oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for headers in ({}, {"X-Event-Ids": "true"}):
            stream = await oai.chat.completions.create(**body, extra_headers=headers)  # type: ignore[call-overload]
            started = time.monotonic()
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            assert time.monotonic() - started > 2, "the stream lasted past a ping"
            assert text == f"echo: {words}"
        async with httpx.AsyncClient(base_url=url) as client, client.stream("POST", "/v1/chat/completions",
                                                                           json=body) as response:
            parser, read = StreamedResponseHandler(), ""
            async for piece in response.aiter_raw():  # as it arrives, as the benchmark reads it
                for message in parser.add_chunk(piece.strip()):
                    if message.startswith(":") or message == "data: [DONE]":
                        continue
                    for choice in json.loads(message.removeprefix("data: "))["choices"]:
                        read += choice["delta"].get("content") or ""
    assert b"id:" not in piece and read == f"echo: {words}"


async def test_bad_requests_get_the_envelope_and_open_no_session(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAAAA==", "format": "pcm16"}}
    cases = [
        ({"messages": USER, "temperature": 3}, 400, "validation_error", "temperature"),
        ({"messages": []}, 400, "validation_error", "messages"),
        ({"messages": USER, "n": 2}, 400, "validation_error", "n"),
        ({"messages": USER, "tools": []}, 400, "validation_error", "tools"),
        ({"messages": USER, "model": "gpt-9"}, 404, "model_not_found", "model"),
        ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
         "validation_error", "messages.1.tool_calls"),
        ({"messages": USER, "stream": False, "stream_options": {"include_usage": True}}, 400, "invalid_request",
         "stream_options"),
        ({"messages": [{"role": "user", "content": ""}]}, 400, "empty_input", "messages.0.content"),
        ({"messages": [{"role": "user", "content": [audio]}]}, 400, "unsupported_modality",
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": [audio]}, *USER]}, 400, "validation_error",
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
         400, "validation_error", "messages.0.content.0.image_url.url"),
        ({"messages": USER, "modalities": ["text", "audio"]}, 400, "unsupported_modality", "modalities"),
        # A boolean is true or false, as OpenAI takes it: not "yes", 1 or "true".
        ({"messages": USER, "parallel_tool_calls": "yes"}, 400, "validation_error", "parallel_tool_calls"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, 400, "validation_error",
         "stream_options.include_usage"),
        ({"messages": USER, "stream_options": {"continuous_usage_stats": True}}, 400, "validation_error",
         "stream_options.continuous_usage_stats"),
    ]
    for body, status, code, param in cases:
        for stream in (False, True):
            assert_error(await client.post(CHAT, json={"stream": stream, **body}), status, code, param)
    assert_error(await client.post(CHAT, content=b"{", headers={"Content-Type": "application/json"}),
                 400, "invalid_json")
    for stream in (b"false", b"true"):  # JSON's escapes allow a lone surrogate; UTF-8 cannot carry it
        lone = b'{"stream": %s, "messages": [{"role": "user", "content": "a\\udc00"}]}' % stream
        assert_error(await client.post(CHAT, content=lone, headers={"Content-Type": "application/json"}),
                     400, "invalid_payload", "messages.0.content")
    assert_error(await client.post(CHAT, json={"stream": "true", "messages": USER}), 400, "validation_error", "stream")
    assert engine.sessions == []

    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client(client).chat.completions.create(model="scripted", messages=USER, temperature=3)
    assert raised.value.code == "validation_error" and raised.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        await openai_client(client).chat.completions.create(model="gpt-9", messages=USER)


async def test_input_audio_reaches_an_engine_that_takes_audio(redis_url: str) -> None:
    engine = ScriptedEngine(capabilities=Capabilities(
        input_modalities=frozenset({"text", "audio"}), output_modalities=frozenset({"text"}),
        incremental=True, model_names=("scripted",)))
    pcm = base64.b64encode(b"\x00\x01" * 800).decode()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        response = await client.post(CHAT, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "transcribe:"},
            {"type": "input_audio", "input_audio": {"data": pcm, "format": "pcm16"}}]}]})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "echo: transcribe:<audio>"
        fed = engine.sessions[0].fed
        assert [(c.modality, c.format, c.sample_rate) for c in fed] == [
            ("text", None, None), ("audio", "pcm16", 16_000)]
        assert_error(await client.post(CHAT, json={"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "@@", "format": "pcm16"}}]}]}),
            400, "invalid_payload", "messages.0.content")


async def test_an_engine_failure_is_the_stored_error(redis_url: str) -> None:
    engine = ScriptedEngine(script=Script(error_after_words=1))
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        assert_error(await client.post(CHAT, json={"messages": USER}), 500, "engine_error")
        stream = await openai_client(client).chat.completions.create(model="scripted", messages=USER,
                                                                      stream=True)
        with pytest.raises(openai.APIError, match="scripted failure"):
            _ = [chunk async for chunk in stream]
    # The engine refusing the request as the client's mistake is a client error, streamed too.
    refusing = ScriptedEngine(script=Script(error_after_words=1, error_code="invalid_request"))
    async with app_client(make_settings(redis_url=redis_url), refusing) as client:
        assert_error(await client.post(CHAT, json={"messages": USER}), 400, "invalid_request")
        streamed = await client.post(CHAT, json={"messages": USER, "stream": True})
        [error] = [json.loads(line[6:])["error"] for line in streamed.text.splitlines()
                   if line.startswith("data: {\"error\"")]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request"), error


async def test_a_client_that_leaves_a_stream_cancels_its_session(redis_url: str) -> None:
    engine = ScriptedEngine(script=Script(hang=True))
    with live_server(create_app(make_settings(redis_url=redis_url), engine=engine)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", CHAT, json={"messages": USER, "stream": True}) as response:
                sid = response.headers["X-Session-Id"]
                lines = response.aiter_lines()
                while "echo:" not in await anext(lines):
                    pass
            # The connection is closed here, before [DONE].
            assert await state_once_cancelled(client, sid) == "cancelled" and engine.sessions[0].aborted


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_tool_calls_come_back_streamed_and_not_and_their_result_feeds_the_next_answer(
        redis_url: str) -> None:
    engine = ScriptedEngine(script=Script(calls=lambda request, text: [("get_weather", '{"city": "Paris"}')]
                                          if request.input_role == "user" else []))
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        oai = openai_client(client)
        asked = [{"role": "user", "content": "weather in Paris?"}]
        completion = await oai.chat.completions.create(model="scripted", messages=asked, tools=[WEATHER],
                                                       tool_choice="auto")
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
        assert engine.sessions[0].request.tools == (WEATHER,)
        assert engine.sessions[0].request.tool_choice == "auto"

        stream = await oai.chat.completions.create(model="scripted", messages=asked, tools=[WEATHER], stream=True)
        deltas = [c.choices[0].delta for c in [chunk async for chunk in stream] if c.choices]
        streamed = [t for d in deltas for t in d.tool_calls or []]
        assert streamed[0].id and streamed[0].function and streamed[0].function.name == "get_weather"
        assert "".join(t.function.arguments or "" for t in streamed if t.function) == '{"city": "Paris"}'

        # The function's result goes back as a tool message after the assistant's call.
        followed = await oai.chat.completions.create(model="scripted", tools=[WEATHER], messages=[
            *asked, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}])
        assert followed.choices[0].message.content == "echo: sunny, 24 C"
        assert followed.choices[0].finish_reason == "stop"
        last = engine.sessions[-1].request
        assert (last.input_role, last.input_tool_call_id) == ("tool", call.id)
        assert last.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
        # A function that returned nothing: its empty result is the input still (OpenAI takes it).
        empty = await oai.chat.completions.create(model="scripted", tools=[WEATHER], messages=[
            *asked, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": ""}])
        assert empty.choices[0].message.content == "echo: "
        assert engine.sessions[-1].request.input_role == "tool" and engine.sessions[-1].input_text == ""


async def test_what_frameworks_add_inside_tools_and_parts_is_taken(redis_url: str) -> None:
    """LiveKit's ``raw_schema`` tools repeat ``type`` inside the function, and its cached prompts mark
    a text part with ``prompt_cache_breakpoint`` (an SDK field): taken as vLLM takes them, not kept."""
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        raw_schema = {"type": "function", "function": {"type": "function", **WEATHER["function"]}}
        marked = [{"role": "system", "content": [{"type": "text", "text": "Be brief.",
                                                  "prompt_cache_breakpoint": {"mode": "explicit"}}]}, *USER]
        response = await client.post(CHAT, json={"messages": marked, "tools": [raw_schema]})
        assert response.status_code == 200, response.text
        request = engine.sessions[0].request
        assert request.tools == (WEATHER,) and request.messages[0] == {"role": "system", "content": "Be brief."}
        assert_error(await client.post(CHAT, json={"messages": USER, "tools": [
            {"type": "function", "function": {**WEATHER["function"], "paramters": {}}}]}), 400, "validation_error",
            "tools.0.function.paramters")


async def test_bad_tool_requests_are_refused(client: httpx.AsyncClient, redis_url: str) -> None:
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [
        {"messages": USER, "tools": [WEATHER], "tool_choice": named},
        {"messages": USER, "tool_choice": "required"},
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": None}]},
    ]
    for body in cases:
        assert_error(await client.post(CHAT, json=body), 400, "validation_error")
    plain = ScriptedEngine(capabilities=Capabilities(
        input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}), incremental=True,
        model_names=("scripted",)))
    async with app_client(make_settings(redis_url=redis_url), plain) as other:
        assert_error(await other.post(CHAT, json={"messages": USER, "tools": [WEATHER]}), 400,
                     "validation_error", "tools")
        # tool_choice none: the tools are not used, so any engine answers.
        response = await other.post(CHAT, json={"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
        assert response.status_code == 200, response.text
async def test_a_sidecars_refusal_of_tools_is_a_400_in_its_words(redis_url: str) -> None:
    """``auto`` on a ``vllm serve`` started without ``--enable-auto-tool-choice``: vLLM's 400, its message."""
    engine = refusing_sidecar(NO_AUTO_TOOLS)
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        answer = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER]})
        error = assert_error(answer, 400, "invalid_request")
        assert "--enable-auto-tool-choice" in error["message"]
        stream = await client.post(CHAT, json={"model": MODEL, "messages": USER, "tools": [WEATHER], "stream": True})
        assert "--enable-auto-tool-choice" in stream.text, stream.text


async def test_a_non_streamed_answer_that_waits_too_long_for_room_is_a_503(redis_url: str) -> None:
    """Every engine slot busy: the request is dropped after ``chat_queue_timeout_sec``, not left hanging."""
    settings = make_settings(redis_url=redis_url, max_engine_sessions=1, chat_queue_timeout_sec=0.5,
                             max_sessions_per_identity=2)
    async with app_client(settings, ScriptedEngine(Script(hang=True))) as client:
        busy = await client.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "x", "end_of_input": True}})
        assert busy.json()["owner"] is not None  # the one slot
        async with asyncio.timeout(5):
            queued = await client.post(CHAT, json={"messages": USER})
        assert_error(queued, 503, "capacity_exhausted")
        assert queued.headers["Retry-After"] == "5"
        # Its session was cancelled: the identity's second slot is free again.
        assert (await client.post(BASE, json={})).status_code == 201


async def test_a_client_that_leaves_a_non_streamed_answer_cancels_it(redis_url: str) -> None:
    engine = ScriptedEngine(Script(hang=True))
    app = create_app(make_settings(redis_url=redis_url), engine=engine)
    with live_server(app) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            waiting = asyncio.ensure_future(client.post(CHAT, json={"messages": USER}))
            async with asyncio.timeout(10):
                while not engine.sessions:  # noqa: ASYNC110 - the engine offers no event
                    await asyncio.sleep(0.02)
            waiting.cancel()  # the client hangs up
            await asyncio.gather(waiting, return_exceptions=True)
            async with asyncio.timeout(10):
                while not engine.sessions[0].aborted:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            sid = engine.sessions[0].request.request_id.rsplit("-", 1)[0]
            assert (await client.get(f"{BASE}/{sid}")).json()["state"] == "cancelled"
