"""vLLM's own request fields, as a ``vllm serve`` user sends them to chat completions, completions
and the sessions API: those that change the answer work through both real engines (in process and
the sidecar), the rest are taken at their defaults and refused otherwise, saying why.

Real redis-server; the scripted engine for what is decided before any engine work, the real
engines (SmolLM2, CPU) for what the answer holds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from gateway import errors
from gateway.service.models import CreateSessionRequest
from gateway.store.session_hash import StoredRequest
from omni_adapter.http_engine import openai_sampling
from omni_adapter.model_bootstrap import converted_default_model
from omni_adapter.port import Engine, SamplingOptions
from omni_adapter.scripted import ScriptedEngine
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
from tests.vllm_sidecar import VllmSidecar

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: What a client generated from vLLM's schema sends for the fields it does not set.
VLLM_DEFAULTS: dict[str, Any] = {
    "stop_token_ids": [], "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "bad_words": [], "priority": 0, "request_id": "req-1",
    "use_beam_search": False, "length_penalty": 1.0, "truncate_prompt_tokens": None,
    "return_tokens_as_token_ids": None}
#: Chat's own (chat completions and the sessions API, not completions).
CHAT_DEFAULTS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False,
                                 "chat_template": None, "mm_processor_kwargs": {}}


@pytest.fixture
async def scripted(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        yield client, engine


def ask(content: str, **fields: object) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], **fields}


async def test_vllms_defaults_are_taken_and_change_nothing(
        scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = scripted
    chat = await client.post(CHAT, json=ask("hello", **VLLM_DEFAULTS, **CHAT_DEFAULTS, echo=False))
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "echo: hello"
    assert chat.json()["id"] == chat.headers["X-Session-Id"], "the answer's id is the session's, not request_id"
    completion = await client.post(COMPLETIONS, json={"model": "scripted", "prompt": "hi", **VLLM_DEFAULTS})
    assert completion.status_code == 200, completion.text
    created = await client.post(BASE, json={"model": "scripted", **VLLM_DEFAULTS, **CHAT_DEFAULTS, "first_chunk": {
        "sequence_id": 0, "text": "hi", "end_of_input": True}})
    assert created.status_code == 201, created.text
    for session in engine.sessions:
        asked = session.request
        assert asked.sampling == replace(SamplingOptions(), max_tokens=asked.sampling.max_tokens), asked.sampling
        assert asked.add_generation_prompt and not asked.continue_final_message


@pytest.mark.parametrize(("fields", "param", "why"), [
    ({"use_beam_search": True}, "use_beam_search", "beam search is not supported"),
    ({"length_penalty": 0.5}, "length_penalty", "beam search is not supported"),
    ({"truncate_prompt_tokens": 100}, "truncate_prompt_tokens", "not truncated here"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "by their text"),
    ({"priority": -5}, "priority", "priority scheduling is not enabled"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "the model's own renders"),
    ({"mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs", "take no options"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message",
     "cannot both be true"),
    ({"bad_words": [""]}, "bad_words", ""),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ""),
    ({"guided_json": {"type": "object"}}, "guided_json", "send structured_outputs"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", "send structured_outputs"),
])
async def test_what_cannot_be_honoured_is_refused_saying_why(
        scripted: tuple[httpx.AsyncClient, ScriptedEngine], fields: dict[str, Any], param: str, why: str) -> None:
    """400 on OpenAI's doors, 422 on the sessions API; the field named, the reason in words."""
    client, engine = scripted
    doors = [(CHAT, ask("hello", **fields), 400),
             (BASE, {"model": "scripted", **fields}, 422)]
    if param in VLLM_DEFAULTS:  # vLLM's completions take these; chat's template fields are not among them
        doors.append((COMPLETIONS, {"model": "scripted", "prompt": "hi", **fields}, 400))
    for door, body, status in doors:
        error = assert_error(await client.post(door, json=body), status, "validation_error")
        assert (error["param"] or "").startswith(param), (door, error)
        assert why in error["message"] and "Extra inputs" not in error["message"], (door, error)
    assert engine.sessions == [], "nothing refused reached the engine"


async def test_vllms_fields_reach_the_engine(scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = scripted
    sampled = {"stop_token_ids": [2, 7], "include_stop_str_in_output": True, "skip_special_tokens": False,
               "spaces_between_special_tokens": False, "bad_words": ["Paris"]}
    expected = SamplingOptions(stop_token_ids=(2, 7), include_stop_str_in_output=True, skip_special_tokens=False,
                               spaces_between_special_tokens=False, bad_words=("Paris",))
    for door, body in ((CHAT, ask("hello", **sampled)), (COMPLETIONS, {"model": "scripted", "prompt": "hi", **sampled}),
                       (BASE, {"model": "scripted", **sampled, "first_chunk": {"sequence_id": 0, "text": "hi",
                                                                                 "end_of_input": True}})):
        assert (await client.post(door, json=body)).status_code in (200, 201)
        asked = engine.sessions[-1].request.sampling
        assert replace(asked, max_tokens=None) == expected, (door, asked)
    flags = await client.post(CHAT, json=ask("hello", add_generation_prompt=False))
    assert flags.status_code == 200, flags.text
    assert not engine.sessions[-1].request.add_generation_prompt
    assert not engine.sessions[-1].request.continue_final_message


async def test_a_prefilled_answer_is_continued_and_echoed(scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    """``continue_final_message`` (vLLM's way to prefill the start of the answer, with
    ``add_generation_prompt`` false, or alone): the last message, the assistant's, is the input
    the answer continues; ``echo`` starts the answer with it, whole and streamed."""
    client, engine = scripted
    prefilled = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}]
    for flags in ({"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True}):
        answer = await client.post(CHAT, json={"model": "scripted", "messages": prefilled, "echo": True, **flags})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "It isecho: It is"
        asked = engine.sessions[-1].request
        assert asked.continue_final_message and not asked.add_generation_prompt and asked.input_role == "assistant"
        result = (await client.get(f"{BASE}/{answer.json()['id']}/result")).json()
        assert result["completion"]["choices"][0]["message"]["content"] == "echo: It is", "the session's is the answer"
    streamed = await client.post(CHAT, json={"model": "scripted", "messages": prefilled, "echo": True,
                                             "continue_final_message": True, "stream": True})
    frames = [json.loads(event.data) for event in parse_sse(streamed.text) if event.data != "[DONE]"]
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert frames[1]["choices"][0]["delta"] == {"content": "It is"}, "echoed right after the role, as vLLM"
    assert "".join(f["choices"][0]["delta"].get("content") or "" for f in frames) == "It isecho: It is"
    user_last = await client.post(CHAT, json=ask("hello", echo=True))
    assert user_last.json()["choices"][0]["message"]["content"] == "echo: hello", "only the answer's role is echoed"
    raw = await client.post(BASE, json={"model": "scripted", "raw_prompt": True, "continue_final_message": True})
    assert_error(raw, 422, "validation_error", "raw_prompt")


def test_the_new_fields_are_stored_only_when_set_and_needed_by_a_replica() -> None:
    """A replica of the release before reads a session that uses none (a rolling deploy), and
    refuses one that uses any, which it would answer wrongly (it reads past unknown fields)."""
    plain = StoredRequest(messages=(), modalities=("text",), sampling=SamplingOptions(temperature=0.5))
    stored = json.loads(plain.to_json())
    assert "needs" not in stored and not {"stop_token_ids", "bad_words"} & set(stored["sampling"])
    assert not {"add_generation_prompt", "continue_final_message"} & set(stored)
    sampled = SamplingOptions(stop_token_ids=(2,), include_stop_str_in_output=True, skip_special_tokens=False,
                              spaces_between_special_tokens=False, bad_words=("x",))
    used = replace(plain, sampling=sampled, add_generation_prompt=False, continue_final_message=True)
    assert StoredRequest.from_json(used.to_json()) == used
    assert set(json.loads(used.to_json())["needs"]) == {
        "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
        "bad_words", "add_generation_prompt", "continue_final_message"}
    request = StoredRequest.from_json(used.to_json()).engine_request("r", "m")
    assert request.continue_final_message and not request.add_generation_prompt
    before = {**json.loads(used.to_json()), "needs": ["a_later_feature"]}
    with pytest.raises(errors.EngineUnavailable, match="a_later_feature"):
        StoredRequest.from_json(json.dumps(before)).engine_request("r", "m")
    asked = CreateSessionRequest(temperature=0.5)  # a retry on the release before digests the same request
    assert not {"stop_token_ids", "request_id", "continue_final_message"} & set(json.loads(
        asked.model_dump_json(exclude=asked.unset_since_digests)))
    retried = CreateSessionRequest(temperature=0.5, request_id="attempt-2")  # a client's per-attempt id
    assert retried.model_dump_json(exclude=retried.unset_since_digests) == asked.model_dump_json(
        exclude=asked.unset_since_digests), "request_id is no part of an Idempotency-Key's digest"
    assert openai_sampling(sampled) == {"stop_token_ids": [2], "include_stop_str_in_output": True,
                                        "skip_special_tokens": False, "spaces_between_special_tokens": False,
                                        "bad_words": ["x"]}


# --- the real engines ------------------------------------------------------------------------


@pytest.fixture
async def client(redis_url: str, real_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), real_engine) as c:
        yield c


COLOURS = "Name three colours, separated by commas."


@pytest.mark.engine
async def test_stop_token_ids_end_the_answer_and_include_stop_str_keeps_the_stop(
        client: httpx.AsyncClient, real_engine: Engine) -> None:
    oai = openai_client(client)
    model = real_engine.capabilities.model_names[0]
    comma, dot = (load_tokenizer(str(converted_default_model())).encode(mark, add_special_tokens=False)[0]
                  for mark in (",", "."))

    async def counted(**extra: Any) -> tuple[str, str | None]:
        answer = await oai.completions.create(model=model, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12,
                                              temperature=0, extra_body=extra)
        return answer.choices[0].text, answer.choices[0].finish_reason

    free, _ = await counted()
    assert "," in free, free
    stopped, reason = await counted(stop_token_ids=[comma])
    assert reason == "stop" and "," not in stopped and stopped and free.startswith(stopped), (free, stopped)
    kept, reason = await counted(stop_token_ids=[comma], include_stop_str_in_output=True)
    assert reason == "stop" and kept == stopped + ",", (stopped, kept)
    as_string, _ = await counted(stop=[","], include_stop_str_in_output=True)
    assert as_string == kept, "a stop string is kept too"

    async def chatted(**extra: Any) -> tuple[str, str | None]:
        answer = await oai.chat.completions.create(model=model, max_tokens=16, temperature=0, extra_body=extra,
                                                   messages=[{"role": "user", "content": COLOURS}])
        return answer.choices[0].message.content or "", answer.choices[0].finish_reason

    free, _ = await chatted()
    assert "." in free, free  # "1. Red\n2. ..."
    assert await chatted(stop_token_ids=[dot]) == (free[:free.index(".")], "stop"), free


@pytest.mark.engine
async def test_bad_words_are_never_said(client: httpx.AsyncClient, real_engine: Engine) -> None:
    oai = openai_client(client)
    model = real_engine.capabilities.model_names[0]
    question = [{"role": "user", "content": "What is the capital of France?"}]

    async def answer(**extra: Any) -> str:
        said = await oai.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0,
                                                 extra_body=extra)
        return said.choices[0].message.content or ""

    assert "Paris" in await answer()
    assert "Paris" not in await answer(bad_words=["Paris"])


@pytest.mark.engine
async def test_special_tokens_are_kept_when_asked(client: httpx.AsyncClient) -> None:
    """``skip_special_tokens`` false keeps them (here ``<|im_start|>``, which logit_bias forces),
    ``spaces_between_special_tokens`` false joins them (a session whose input streams in:
    tests/omni_adapter/test_real_adapters.py)."""
    async def said(**extra: Any) -> str:
        created = await client.post(BASE, json={"temperature": 0, "max_tokens": 3, "logit_bias": {"1": 100}, **extra,
                                                "first_chunk": {"sequence_id": 0, "text": "Say hi.",
                                                                "end_of_input": True}})
        events = parse_sse((await client.get(f"{BASE}/{created.json()['session_id']}/events")).text)
        assert events[-1].data == "[DONE]", events[-1]
        return content_of(events)

    assert await said() == ""
    assert "<|im_start|>" in await said(skip_special_tokens=False)
    assert await said(skip_special_tokens=False, spaces_between_special_tokens=False) == "<|im_start|>" * 3


@pytest.mark.engine
async def test_a_prefilled_answer_is_continued_as_vllm_continues_it(
        redis_url: str, real_engine: Engine, vllm_sidecar: VllmSidecar) -> None:
    """``continue_final_message`` (with ``add_generation_prompt`` false, as vLLM asks) and
    ``add_generation_prompt`` false alone: at temperature 0, vLLM's own server's words and prompt;
    ``echo`` gives the prefilled start too."""
    vllm_sidecar.ensure_running()
    vllm = openai.AsyncOpenAI(base_url=f"{vllm_sidecar.url}/v1", api_key="unused", max_retries=0)
    served = (await vllm.models.list()).data[0].id
    prefilled: list[Any] = [{"role": "user", "content": "What is the capital of France?"},
                            {"role": "assistant", "content": "The capital of France is"}]
    asked: list[tuple[list[Any], dict[str, Any]]] = [
        (prefilled, {"add_generation_prompt": False, "continue_final_message": True}),
        (prefilled, {"add_generation_prompt": False, "continue_final_message": True, "echo": True}),
        (prefilled[:1], {"add_generation_prompt": False})]
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        oai = openai_client(client)
        for messages, flags in asked:
            ours = await oai.chat.completions.create(model=real_engine.capabilities.model_names[0],
                                                     messages=messages, max_tokens=8, temperature=0,
                                                     extra_body=flags)
            theirs = await vllm.chat.completions.create(model=served, messages=messages, max_tokens=8,
                                                        temperature=0, extra_body=flags)
            assert ours.choices[0].message.content == theirs.choices[0].message.content, flags
            assert ours.usage is not None and theirs.usage is not None
            assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens, flags
        # continue_final_message alone (vLLM asks for add_generation_prompt false beside it) is taken.
        alone = await oai.chat.completions.create(model=real_engine.capabilities.model_names[0], messages=prefilled,
                                                  max_tokens=8, temperature=0,
                                                  extra_body={"continue_final_message": True, "echo": True})
        continued = alone.choices[0].message.content or ""
        assert continued.startswith("The capital of France is ") and "Paris" in continued, continued
