"""The gateway end to end: real redis-server, each real engine adapter (SmolLM2, CPU).

Every test runs against the in-process ``vllm`` adapter and the ``openai-http``
adapter over a real ``vllm serve`` sidecar (the ``real_engine`` fixture).

The headline property: streaming changes nothing but latency. A session fed
in many chunks, out of order, with duplicates, under ``on_first_chunk``
answers exactly like the same input sent as one chunk under ``on_end_only``,
and its prompt is exactly the one-shot chat-template tokenization.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from omni_adapter.port import Engine
from tests.gateway.client import (
    BASE,
    app_client,
    content_of,
    live_app,
    make_settings,
    openai_client,
    parse_sse,
)
from tests.vllm_sidecar import VllmSidecar

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "system", "content": "Answer in one short sentence."}]
QUESTION = ("Here is a list of fruits:  apples, pears,\n\nplums and 12 cherries. "
            "Which fruit is red? Don't explain.")
SAMPLING = {"temperature": 0, "max_tokens": 12, "stream_options": {"include_usage": True}}


@pytest.fixture
async def client(redis_url: str, real_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), real_engine) as c:
        yield c


def split_text(text: str, pieces: int, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), pieces - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


async def run_one_shot(client: httpx.AsyncClient) -> tuple[str, dict]:
    response = await client.post(BASE, json={
        **SAMPLING, "messages": MESSAGES, "start_policy": "on_end_only",
        "first_chunk": {"sequence_id": 0, "text": QUESTION, "end_of_input": True}})
    sid = response.json()["session_id"]
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    return content_of(events), events[-2].json()["usage"]


async def run_streamed(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, dict, list]:
    response = await client.post(BASE, json={**SAMPLING, "messages": MESSAGES, "start_policy": "on_first_chunk"})
    sid = response.json()["session_id"]
    subscriber = asyncio.create_task(client.get(f"{BASE}/{sid}/events"))
    pieces = split_text(QUESTION, 9, rng)
    order = list(range(len(pieces)))
    # Shuffle within small windows: out of order, but inside the ordering window.
    for start in range(0, len(order), 3):
        window = order[start:start + 3]
        rng.shuffle(window)
        order[start:start + 3] = window
    states = []
    for seq in order:
        chunk = {"sequence_id": seq, "text": pieces[seq], "end_of_input": seq == len(pieces) - 1}
        first = await client.post(f"{BASE}/{sid}/chunks", json=chunk)
        assert first.status_code == 202, first.text
        states.append(first.json()["state"])
        retry = await client.post(f"{BASE}/{sid}/chunks", json=chunk)
        assert retry.status_code == 200 and retry.json()["duplicate"]
        await asyncio.sleep(0.05)
    events = parse_sse((await subscriber).text)
    return content_of(events), events[-2].json()["usage"], states


async def test_streaming_changes_nothing_but_latency(client: httpx.AsyncClient) -> None:
    one_shot_text, one_shot_usage = await run_one_shot(client)
    streamed_text, streamed_usage, states = await run_streamed(client, random.Random(7))

    assert one_shot_text.strip(), "the model produced no text"
    assert streamed_text == one_shot_text
    assert "streaming" in states, "the engine session never opened before the end of input"
    assert streamed_usage["prompt_tokens"] == one_shot_usage["prompt_tokens"]

    from transformers import AutoTokenizer

    from omni_adapter.model_bootstrap import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    rendered = tokenizer.apply_chat_template(
        [*MESSAGES, {"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    one_shot_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert streamed_usage["prompt_tokens"] == len(one_shot_ids)
    assert streamed_usage["completion_tokens"] >= 1


async def test_result_and_readiness_with_the_real_engine(client: httpx.AsyncClient) -> None:
    assert (await client.get("/readyz")).json() == {"status": "ready"}
    response = await client.post(BASE, json={
        "temperature": 0, "max_tokens": 4,
        "first_chunk": {"sequence_id": 0, "text": "Say hi.", "end_of_input": True}})
    sid = response.json()["session_id"]
    result = await client.get(f"{BASE}/{sid}/result", params={"wait": 60})
    assert result.status_code == 200, result.text
    completion = result.json()["completion"]
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 4
    assert completion["choices"][0]["message"]["content"]


async def test_failure_before_generation_is_one_error_event(client: httpx.AsyncClient) -> None:
    response = await client.post(BASE, json={"start_policy": "on_first_chunk"})
    sid = response.json()["session_id"]
    await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "partial input"})
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert len(events) == 1 and events[0].event == "error"
    assert events[0].json()["error"]["code"] == "session_cancelled"


async def cancel_as_a_client_would(client: httpx.AsyncClient, sid: str) -> httpx.Response:
    """DELETE, sent again after a 503 ``store_unavailable`` (what its envelope asks of a client).

    Once in a full CI run on 2 starved cores (2026-11-25) every Redis call of the
    process stalled past its 10 s deadline while the sidecar generated; this test
    is about the engine's abort, not that stall (an open question in the notes).
    """
    for _ in range(3):
        response = await client.delete(f"{BASE}/{sid}")
        if response.status_code != 503 or response.json()["error"]["code"] != "store_unavailable":
            break
        await asyncio.sleep(float(response.headers.get("Retry-After", 1)))
    return response


async def test_cancel_mid_generation_aborts_the_engine(client: httpx.AsyncClient) -> None:
    response = await client.post(BASE, json={
        "temperature": 0, "max_tokens": 200,
        "first_chunk": {"sequence_id": 0, "text": "Write a long story about a cat.", "end_of_input": True}})
    sid = response.json()["session_id"]
    for _ in range(100):
        view = (await client.get(f"{BASE}/{sid}")).json()
        last = await client.get(f"{BASE}/{sid}/result")
        if last.status_code == 202 and view["state"] == "generating":
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert (await cancel_as_a_client_would(client, sid)).status_code == 204
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].event == "error" and events[-1].json()["error"]["code"] == "session_cancelled"
    tokens_at_cancel = len(events)
    await asyncio.sleep(1.0)
    events_later = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert len(events_later) == tokens_at_cancel, "frames kept coming after the cancel"


async def test_an_answer_begins_with_its_first_token_even_one_that_says_nothing(
        redis_url: str, real_engine: Engine) -> None:
    """An answer whose tokens decode to nothing (here only ``<|im_start|>``, a special token,
    which logit_bias forces) begins all the same: its role chunk comes with its first token, as
    vLLM's does, while the rest is still being made. Before, it came with the end (a benchmark's
    first token was the last)."""
    asked = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
             "temperature": 0, "max_tokens": 64, "logit_bias": {"1": 100}}
    async with live_app(make_settings(redis_url=redis_url), real_engine) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=asked) as response:
        assert response.status_code == 200
        lines = (line async for line in response.aiter_lines() if line.startswith("data: "))
        first = json.loads((await anext(lines))[6:])
        while_made = (await http.get(f"{BASE}/{first['id']}")).json()["state"]
        rest = [line[6:] async for line in lines]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert while_made == "generating", "the first chunk came with the end of the answer"
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])["choices"][0]
    assert last["finish_reason"] == "length" and not last["delta"].get("content")


async def test_a_conversation_that_does_not_end_with_the_user_is_answered_as_vllm_answers_it(
        redis_url: str, real_engine: Engine, vllm_sidecar: VllmSidecar) -> None:
    """The assistant speaking first (a system message alone) and a new assistant turn after its
    own message: at temperature 0, the words vLLM's own server gives for the same messages."""
    vllm_sidecar.ensure_running()
    vllm = openai.AsyncOpenAI(base_url=f"{vllm_sidecar.url}/v1", api_key="unused", max_retries=0)
    served = (await vllm.models.list()).data[0].id
    conversations: list[list[Any]] = [
        [{"role": "system", "content": "You are a friendly voice assistant. Greet the user."}],
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."}]]
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        oai = openai_client(client)
        for messages in conversations:
            ours = await oai.chat.completions.create(model=real_engine.capabilities.model_names[0],
                                                     messages=messages, max_tokens=12, temperature=0)
            theirs = await vllm.chat.completions.create(model=served, messages=messages, max_tokens=12,
                                                        temperature=0)
            assert ours.choices[0].message.content == theirs.choices[0].message.content, messages
            assert ours.usage is not None and theirs.usage is not None
            assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens, messages


async def test_vllms_structured_outputs_hold_the_answer(client: httpx.AsyncClient, real_engine: Engine) -> None:
    """vLLM's own ``structured_outputs`` (its documented way to constrain an answer; litellm's
    ``hosted_vllm`` sends it): a choice, a regex, a grammar, a JSON schema, on chat and completions,
    whole and streamed. A grammar it cannot read is a 400 naming it."""
    model = real_engine.capabilities.model_names[0]
    oai = openai_client(client)
    question = [{"role": "user", "content": "Is the sky blue?"}]

    async def held(constraint: dict[str, Any], max_tokens: int = 8) -> str:
        answer = await oai.chat.completions.create(model=model, messages=question, max_tokens=max_tokens,
                                                   extra_body={"structured_outputs": constraint})
        return answer.choices[0].message.content or ""

    assert await held({"choice": ["yes", "no"]}) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", await held({"regex": "[0-9]{3}"}))
    assert await held({"grammar": 'root ::= "red" | "blue"'}) in ("red", "blue")
    schema = {"type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"]}
    assert isinstance(json.loads(await held({"json": schema}, max_tokens=24))["blue"], bool)
    streamed = await oai.chat.completions.create(model=model, messages=question, max_tokens=8, stream=True,
                                                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices]) in ("yes", "no")
    completion = await oai.completions.create(model=model, prompt="The sky is", max_tokens=4,
                                              extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert completion.choices[0].text in ("blue", "green")
    responded = await oai.responses.create(model=model, input="Is the sky blue?", max_output_tokens=24,
                                           extra_body={"structured_outputs": {"json": schema}})
    assert isinstance(json.loads(responded.output_text)["blue"], bool)
    for bad in ({"regex": "[0-9"}, {"choice": []}, {"regex": "a", "choice": ["a"]}):
        with pytest.raises(openai.BadRequestError) as refused:
            await held(bad)
        said = refused.value.body
        assert isinstance(said, dict)
        # The sidecar's server checks the regex when it runs the request: its reason, no param.
        assert (said["param"] or "").startswith("structured_outputs") or "invalid regex" in said["message"], said
