"""The OpenAI request fields clients send beyond the basics: ``response_format`` held by
the real engine, the OpenAI playground's exported request, and clear errors for the rest.

Real redis-server; the real vLLM engine (SmolLM2, CPU) for the answers held to JSON,
the scripted engine (which holds nothing to JSON) for the checks before any engine work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from gateway import errors
from gateway.service.models import CreateSessionRequest
from gateway.store.session_hash import StoredRequest
from omni_adapter.http_engine import openai_sampling
from omni_adapter.model_bootstrap import converted_default_model
from omni_adapter.port import (
    Engine,
    EngineRequest,
    EngineSession,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    ToolCallDelta,
)
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from omni_adapter.vllm_engine import load_tokenizer
from tests.gateway.client import (
    BASE,
    app_client,
    content_of,
    make_settings,
    openai_client,
    parse_sse,
)
from tests.gateway.test_api import assert_error

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture
async def real(redis_url: str, vllm_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as client:
        yield client


@pytest.fixture
async def either(redis_url: str, real_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    """The in-process engine, then a ``vllm serve`` sidecar (the ``openai-http`` adapter)."""
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        yield client


@pytest.fixture
async def scripted(redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as client:
        yield client


class Person(BaseModel):
    # Bounded, so an answer at temperature 1 fits its max_tokens whatever the seed: a long made-up
    # name (katakana is several tokens a character) once ran past 48 tokens and cut the JSON.
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


class StopsMidAnswer:
    """An engine whose sessions say their first ``deltas`` text deltas and then wait: the
    replica running them is about to stop. ``cut`` is set when they have been published."""

    def __init__(self, engine: Engine, deltas: int) -> None:
        self.engine, self.deltas = engine, deltas
        #: The text and the function-call pieces said before the cut.
        self.said, self.calls = "", list[ToolCallDelta]()
        self.cut = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def open_session(self, request: EngineRequest) -> EngineSession:
        return _Cut(self.engine.open_session(request), self)


class _Cut:
    def __init__(self, inner: EngineSession, engine: StopsMidAnswer) -> None:
        self.inner, self.engine = inner, engine

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        await self.inner.feed(chunks)

    async def end_input(self) -> None:
        await self.inner.end_input()

    async def abort(self) -> None:
        await self.inner.abort()

    async def events(self) -> AsyncIterator[OutputEvent]:
        said = 0
        async for event in self.inner.events():
            if said == self.engine.deltas:
                self.engine.cut.set()  # the relay asks for more: what came before is in Redis
                await asyncio.Event().wait()
            if isinstance(event, TextDelta | ToolCallDelta):
                said += 1
            if isinstance(event, TextDelta):
                self.engine.said += event.text
            elif isinstance(event, ToolCallDelta):
                self.engine.calls.append(event)
            yield event


def ask(content: str, **fields: object) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], **fields}


async def create_session(client: httpx.AsyncClient, text: str, **fields: object) -> str:
    """A streaming-input session whose input is ``text``, whole: its id."""
    response = await client.post(BASE, json={"model": MODEL, **fields, "first_chunk": {
        "sequence_id": 0, "text": text, "end_of_input": True}})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


# --- on the real engine ---------------------------------------------------------


@pytest.mark.engine
async def test_the_openai_sdks_parse_gets_an_answer_that_matches_the_schema(either: httpx.AsyncClient) -> None:
    """``client.chat.completions.parse`` sends ``response_format: json_schema`` (strict) and
    validates the answer against the model; a 135M model left free rarely writes JSON at all."""
    completion = await openai_client(either).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet? Answer as JSON."}],
        response_format=Verdict, temperature=0, max_tokens=40)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Verdict), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.engine
async def test_a_streamed_json_object_answer_parses_whole(real: httpx.AsyncClient) -> None:
    stream = await openai_client(real).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the largest city of France and its population "
                                                            "as JSON."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=80, stream=True)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text


@pytest.mark.engine
async def test_a_streaming_input_session_held_to_a_schema_answers_in_it(real: httpx.AsyncClient) -> None:
    """Mode B: the input arrives in chunks; the answer still follows the schema (the engine
    takes the whole input at its end, since a request's grammar is set when it is added)."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    created = await real.post(BASE, json={
        "model": MODEL, "temperature": 0, "max_tokens": 30, "start_policy": "on_first_chunk",
        "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    for seq, text in enumerate(["What colour", " is the sky?", " Answer in JSON."]):
        sent = await real.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": text,
                                                              "end_of_input": seq == 2})
        assert sent.status_code == 202, sent.text
    result = (await real.get(f"{BASE}/{sid}/result", params={"wait": 60})).json()
    assert result["state"] == "completed", result
    answer = json.loads(result["completion"]["choices"][0]["message"]["content"])
    assert set(answer) == {"colour"} and answer["colour"] in ("red", "green", "blue"), answer


@pytest.mark.engine
async def test_an_answer_held_to_a_schema_that_a_stopping_replica_cut_is_made_again_and_goes_on(
        redis_url: str, vllm_engine: Engine) -> None:
    """A replica stops mid-answer and another takes the session over: after the JSON so far as
    the assistant's prefix, vLLM's grammar would begin a second document. The new holder makes
    the answer again with the seed create chose (temperature 1: sampled), passes on only what
    is new, and the client reads one JSON document that matches the schema."""
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    stopping = StopsMidAnswer(vllm_engine, deltas=10)
    async with app_client(settings, stopping) as a:  # type: ignore[arg-type]  # an engine by its methods
        sid = await create_session(a, "Make up a person with an unusual name and an age, as JSON.", max_tokens=96,
                                   temperature=1.0,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "person", "schema": Person.model_json_schema()}})
        await asyncio.wait_for(stopping.cut.wait(), 60)
    async with app_client(settings, vllm_engine) as b:
        stream = (await b.get(f"{BASE}/{sid}/events")).text
        result = (await b.get(f"{BASE}/{sid}/result", params={"wait": 30})).json()
    assert result["state"] == "completed", result
    answer = result["completion"]["choices"][0]["message"]["content"]
    assert answer.startswith(stopping.said) and len(answer) > len(stopping.said)
    Person.model_validate_json(answer)
    assert content_of(parse_sse(stream)) == answer  # what each replica published, stitched: once each


@pytest.mark.engine
async def test_a_function_call_that_a_stopping_replica_cut_goes_on_under_its_first_id(
        redis_url: str, vllm_engine: Engine) -> None:
    """A call published in part cannot be an assistant prefix (calls are parsed from what the
    engine generates): the new holder makes the answer again with the seed create chose, and the
    stream and the completion hold each call once, whole, under the id its first piece had."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    stopping = StopsMidAnswer(vllm_engine, deltas=3)
    async with app_client(settings, stopping) as a:  # type: ignore[arg-type]  # an engine by its methods
        sid = await create_session(a, "What is the weather in Paris today?", max_tokens=64, temperature=1.0,
                                   tools=[weather], tool_choice="required", parallel_tool_calls=False)
        await asyncio.wait_for(stopping.cut.wait(), 60)
    async with app_client(settings, vllm_engine) as b:
        stream = (await b.get(f"{BASE}/{sid}/events")).text
        result = (await b.get(f"{BASE}/{sid}/result", params={"wait": 30})).json()
    assert result["state"] == "completed", result
    assert stopping.calls and stopping.calls[0].id, stopping.calls  # the cut came inside a call
    answer = result["completion"]["choices"][0]
    (call,) = answer["message"]["tool_calls"]
    assert call["id"] == stopping.calls[0].id and call["function"]["name"] == "get_weather", answer
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str), answer
    pieces = [piece for event in parse_sse(stream) if event.event is None and event.data != "[DONE]"
              for choice in event.json()["choices"] for piece in choice["delta"].get("tool_calls") or ()]
    assert [piece["id"] for piece in pieces if "id" in piece] == [call["id"]]  # announced once
    assert "".join(piece["function"]["arguments"] for piece in pieces) == call["function"]["arguments"]


def test_an_answer_made_again_passes_on_only_what_is_new_and_stops_where_it_differs() -> None:
    from gateway.output.frames import ToolCalls
    from gateway.work.said_again import SaidAgain
    from omni_adapter.port import Finished, Usage

    again = SaidAgain('{"name": "Al')
    assert [again.after(TextDelta(text)) for text in ('{"na', 'me": "', 'Alice"', ', "age"')] == [
        TextDelta(""), TextDelta(""), TextDelta('ice"'), TextDelta(', "age"')]
    assert not again.left and not again.checks(TextDelta("more"))
    assert SaidAgain('{"name": "Al').after(TextDelta('{"name": "Bo')) is None  # sampled otherwise
    assert SaidAgain('{"name"').after(Finished("stop", Usage(1, 1))) is None  # ended before what was said
    # A call published in part: made again under a new id, it goes on under the first one.
    published = ToolCalls([ToolCallDelta(0, "call_a", "get_weather", '{"ci'), ToolCallDelta(0, arguments='ty"')])
    calls = SaidAgain("", published.by_index())
    assert calls.after(ToolCallDelta(0, "call_b", "get_weather", "")) == ToolCallDelta(0)
    assert calls.after(ToolCallDelta(0, arguments='{"city": "Paris"}')) == ToolCallDelta(0, arguments=': "Paris"}')
    assert calls.checks(ToolCallDelta(0, arguments="}")) and not calls.checks(ToolCallDelta(1, "call_c", "f"))
    assert SaidAgain("", {0: ("get_weather", "{")}).after(ToolCallDelta(0, "b", "get_time")) is None


@pytest.mark.engine
async def test_min_p_and_logit_bias_reach_the_engine(real: httpx.AsyncClient) -> None:
    """A bias of -100 on the token a greedy answer starts with changes that first token."""
    question = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
                "max_tokens": 3, "min_p": 0.05}
    free = await real.post(CHAT, json=question)
    assert free.status_code == 200, free.text
    first = free.json()["choices"][0]["message"]["content"]
    token = load_tokenizer(str(converted_default_model())).encode(first)[0]  # the engine's own tokenizer
    biased = await real.post(CHAT, json={**question, "logit_bias": {str(token): -100}})
    assert biased.status_code == 200, biased.text
    assert not biased.json()["choices"][0]["message"]["content"].startswith(first), (first, biased.json())


@pytest.mark.engine
async def test_what_only_the_engine_can_check_is_refused_with_its_reason(real: httpx.AsyncClient) -> None:
    """A token id beyond the vocabulary (vLLM's check when it adds the request), a schema the
    grammar compiler refuses (vLLM's engine core failed the request with a server error): the
    client's mistake, checked before any work, and named."""
    question = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3}
    beyond = await real.post(CHAT, json={**question, "logit_bias": {"99999999": 5}})
    assert assert_error(beyond, 400, "validation_error")["param"] == "logit_bias"
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}
    refused = await real.post(CHAT, json={**question, "response_format": broken})
    error = assert_error(refused, 400, "validation_error")
    assert "minimum greater than maximum" in error["message"] and error["param"] == "response_format"
    assert ".cc" not in error["message"], "no C++ source lines"
    # A function's parameters the answer is held to (required, named): a 400 before a stream starts
    # too (a 200, then an error event, sent a framework's client into retries).
    tools = [{"type": "function", "function": {"name": "pick", "parameters": broken["json_schema"]["schema"]}}]
    for stream in (False, True):
        called = await real.post(CHAT, json={**question, "tools": tools, "tool_choice": "required", "stream": stream})
        error = assert_error(called, 400, "validation_error")
        assert "minimum greater than maximum" in error["message"], error
        assert error["param"] == "tools.0.function.parameters", error
    # A $ref to itself: the compiler takes it, then the engine core failed the request (a 500).
    endless = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}
    error = assert_error(await real.post(CHAT, json={**question, "response_format": endless}), 400, "validation_error")
    assert "refers only to itself" in error["message"] and error["param"] == "response_format"
    tree = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/n", "$defs": {"n": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}}}}
    assert (await real.post(CHAT, json={**question, "response_format": tree})).status_code == 200
    unsampled = await real.post(CHAT, json={**question, "top_k": -5})
    assert assert_error(unsampled, 400, "validation_error")["param"] == "top_k"


# --- before any engine work -------------------------------------------------------


async def test_the_openai_playgrounds_exported_request_is_answered(scripted: httpx.AsyncClient) -> None:
    """What the playground's "code" button writes: response_format text, store, a service tier
    (and a reasoning effort, for a reasoning model)."""
    response = await scripted.post(CHAT, json=ask(
        "hello", response_format={"type": "text"}, temperature=1, max_completion_tokens=2048, top_p=1,
        frequency_penalty=0, presence_penalty=0, store=False, service_tier="auto", logprobs=False, top_logprobs=0,
        reasoning_effort="low"))
    assert response.status_code == 200, response.text


async def test_a_client_that_sends_every_unset_option_as_null_is_answered(scripted: httpx.AsyncClient) -> None:
    """Clients generated from OpenAI's schema send each option they do not set as null; OpenAI and
    vLLM take it as left out. A null where a value is required is still refused, by name."""
    nulls = {name: None for name in ("n", "stream", "modalities", "temperature", "stop", "tools", "seed",
                                     "stream_options", "response_format", "logprobs", "top_logprobs", "audio")}
    chat = await scripted.post(CHAT, json=ask("hello", **nulls))
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "echo: hello", chat.text
    completion = await scripted.post("/v1/completions", json={
        "model": "scripted", "prompt": "hi", "n": None, "echo": None, "stream": None, "best_of": None, "suffix": None})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "echo: hi", completion.text
    response = await scripted.post("/v1/responses", json={"model": "scripted", "input": "hi", "stream": None,
                                                          "tools": None, "background": None})
    assert response.status_code == 200 and response.json()["status"] == "completed", response.text
    refused = assert_error(await scripted.post(CHAT, json={"model": "scripted", "messages": None}), 400,
                           "validation_error")
    assert refused["param"] == "messages", refused


async def test_openai_fields_that_change_nothing_here_are_taken(scripted: httpx.AsyncClient) -> None:
    """Newer OpenAI fields that SDK helpers and frameworks set: bookkeeping, cache keys, hints."""
    response = await scripted.post(CHAT, json=ask(
        "hello", user="u-1", safety_identifier="hashed-user", prompt_cache_key="agent-7",
        prompt_cache_retention="24h", verbosity="low", prediction={"type": "content", "content": "hello"}))
    assert response.status_code == 200, response.text
    for effort in ("xhigh", "max"):  # the SDK's newest efforts
        response = await scripted.post(CHAT, json=ask("hello", reasoning_effort=effort))
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "false"}, "logprobs"),
    ({"store": "no"}, "store"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": "terse"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"logit_bias": {"hello": 5}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "ogg"}}]}]}, "messages.0.content.0.input_audio.format"),
])
async def test_fields_it_cannot_honour_are_400s_that_name_them(scripted: httpx.AsyncClient, fields: dict,
                                                               param: str) -> None:
    response = await scripted.post(CHAT, json=ask("hello", **fields))
    error = assert_error(response, 400, "validation_error")
    assert error["param"] is not None and error["param"].startswith(param), error
    assert "valid string" not in error["message"] and "Value error" not in error["message"], error


async def test_json_on_an_engine_that_cannot_hold_to_it_is_refused_before_any_work(
        scripted: httpx.AsyncClient) -> None:
    response = await scripted.post(CHAT, json=ask("hello", response_format={"type": "json_object"}))
    error = assert_error(response, 400, "validation_error")
    assert "response_format" in error["message"], error
    created = await scripted.post(BASE, json={"model": "scripted", "response_format": {"type": "json_object"}})
    assert_error(created, 422, "validation_error")
    vllms = await scripted.post(CHAT, json=ask("hello", structured_outputs={"choice": ["a", "b"]}))
    assert assert_error(vllms, 400, "validation_error")["param"] == "structured_outputs"
    both = await scripted.post(CHAT, json=ask("hello", structured_outputs={"regex": "a"},
                                             response_format={"type": "json_object"}))
    assert assert_error(both, 400, "validation_error")["param"] == "structured_outputs"


async def test_a_forced_function_call_holds_the_answer_beside_a_json_format(redis_url: str) -> None:
    """The OpenAI Agents SDK forces a tool and asks for a typed answer (output_type) in the same
    request, then asks again without forcing: as vLLM's server, the call's schema holds the first
    answer (it was a 400 here, which ended the agent's run)."""
    engine = ScriptedEngine(Script(calls=lambda request, text: [("f", "{}")]),
                            capabilities=replace(text_capabilities(), structured_outputs=True))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        for held in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"choice": ["a"]}}):
            response = await client.post(CHAT, json=ask("hello", tools=tools, tool_choice="required", **held))
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
            assert engine.sessions[-1].request.sampling.response_format is None


async def test_one_model_is_retrieved_and_another_is_a_404(scripted: httpx.AsyncClient) -> None:
    oai = openai_client(scripted)
    assert (await oai.models.retrieve("scripted")).id == "scripted"
    with pytest.raises(openai.NotFoundError) as raised:
        await oai.models.retrieve("gpt-4o")
    assert raised.value.code == "model_not_found"


def test_the_new_fields_are_stored_only_when_set_and_reach_a_sidecar() -> None:
    """A replica of the release before reads the stored request of a session that does not use
    them (a rolling deploy); one that does keeps them through the store."""
    plain = StoredRequest(messages=(), modalities=("text",), sampling=SamplingOptions(temperature=0.5))
    assert not {"min_p", "logit_bias", "response_format"} & set(json.loads(plain.to_json())["sampling"])
    assert "chat_template_kwargs" not in json.loads(plain.to_json())
    assert StoredRequest.from_json(plain.to_json()) == plain
    thinking_off = replace(plain, chat_template_kwargs={"enable_thinking": False})
    assert StoredRequest.from_json(thinking_off.to_json()) == thinking_off
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    held = StoredRequest(messages=(), modalities=("text",),
                         sampling=SamplingOptions(min_p=0.1, logit_bias={"7": -5.0}, response_format=fmt))
    assert StoredRequest.from_json(held.to_json()) == held
    sent = openai_sampling(held.sampling)
    assert sent["response_format"] == fmt and sent["min_p"] == 0.1 and sent["logit_bias"] == {"7": -5.0}


def test_a_session_that_needs_what_a_release_does_not_know_is_refused_by_it_not_misread() -> None:
    """A rolling deploy or a rollback: an older replica that claims a session made by a newer one
    whose needs it does not know fails it with a clear error; it still reads it (its result, its
    events), and what it knows it runs."""
    raw = StoredRequest(messages=(), modalities=("text",), sampling=SamplingOptions(), raw_prompt=True)
    assert json.loads(raw.to_json())["needs"] == ["raw_prompt"]
    assert "needs" not in json.loads(replace(raw, raw_prompt=False).to_json())
    assert StoredRequest.from_json(raw.to_json()).engine_request("r", "m").raw_prompt
    newer = {**json.loads(raw.to_json()), "needs": ["raw_prompt", "a_later_feature"]}
    newer["sampling"]["a_later_option"] = 3  # read all the same: the needs decide
    read = StoredRequest.from_json(json.dumps(newer))
    with pytest.raises(errors.EngineUnavailable, match="a_later_feature"):
        read.engine_request("r", "m")
    scored = replace(raw, raw_prompt=False, sampling=SamplingOptions(logprobs=2))
    assert json.loads(scored.to_json())["needs"] == ["logprobs"]
    assert "logprobs" not in json.loads(scored.to_json())["sampling"], "the release before reads each of those"
    assert StoredRequest.from_json(scored.to_json()) == scored
    # vLLM's grammars are new to the release before (it knows OpenAI's JSON kinds only).
    chosen = replace(raw, raw_prompt=False, sampling=SamplingOptions(response_format={"type": "choice",
                                                                                      "choice": ["a", "b"]}))
    assert json.loads(chosen.to_json())["needs"] == ["structured_outputs"]
    assert "needs" not in json.loads(replace(chosen, sampling=SamplingOptions(response_format={
        "type": "json_object"})).to_json())
    # A retry with an Idempotency-Key that lands on the release before digests the same request.
    asked = CreateSessionRequest(messages=[], temperature=0.5)
    assert "logprobs" not in asked.model_dump_json(exclude=asked.unset_since_digests)
