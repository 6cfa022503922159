"""``POST /v1/completions``: the prompt is the whole input, as vLLM serves it.

The official ``openai`` SDK as the client and real Redis; the scripted engine for the
shapes and the refusals, and the real engines (in-process vLLM, and the ``openai-http``
adapter over a ``vllm serve`` sidecar) against that sidecar's own ``/v1/completions``:
the same prompt at temperature 0 gets the same words (and log probabilities, in chat too).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from omni_adapter.port import Engine
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import (
    BASE,
    app_client,
    content_of,
    make_settings,
    openai_client,
    parse_sse,
)
from tests.vllm_sidecar import VllmSidecar

#: SmolLM2's own chat format, written by hand: its special tokens must be the model's.
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
async def scripted(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        yield client, engine


async def test_a_completion_continues_the_prompt_with_no_chat_template(
        scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = scripted
    oai = openai_client(client)
    completion = await oai.completions.create(model="scripted", prompt="Once upon a time")
    assert completion.object == "text_completion" and completion.model == "scripted"
    assert completion.choices[0].text == "echo: Once upon a time" and completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens > 0
    asked = engine.sessions[-1].request
    assert asked.raw_prompt and asked.messages == () and asked.sampling.max_tokens == 16  # OpenAI's default
    echoed = await oai.completions.create(model="scripted", prompt=["Say it"], echo=True, max_tokens=None,
                                          extra_body={"ignore_eos": True, "min_tokens": 2})
    assert echoed.choices[0].text == "Say itecho: Say it"
    asked = engine.sessions[-1].request
    assert asked.sampling.max_tokens == 16, "an explicit null is vLLM's default too"
    assert asked.sampling.ignore_eos is True and asked.sampling.min_tokens == 2  # vllm bench serve sends them

    stream = await oai.completions.create(model="scripted", prompt="one two three", stream=True,
                                          stream_options={"include_usage": True}, echo=True)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "one two threeecho: one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert all(c.object == "text_completion" for c in chunks)


async def test_what_is_not_served_is_said(scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = scripted
    oai = openai_client(client)
    for fields, status, param in [
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": [1, 2, 3]}, 400, "prompt"),
        ({"prompt": "a", "suffix": "b"}, 400, "suffix"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "a", "logprobs": 2}, 400, "logprobs"),  # the scripted engine returns none
        ({"prompt": "a", "logprobs": 2, "echo": True}, 400, "logprobs"),  # the prompt's
        ({"prompt": "a", "n": 2}, 400, "n"),
        ({"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "a", "model": "gpt-3.5-turbo-instruct"}, 404, "model"),
    ]:
        with pytest.raises(openai.APIStatusError) as refused:
            await oai.completions.create(**{"model": "scripted", **fields})  # type: ignore[call-overload]
        assert refused.value.status_code == status, (fields, refused.value.body)
        body = refused.value.body
        assert isinstance(body, dict) and body.get("param") == param, (fields, body)
    surrogate = await client.post("/v1/completions", content=b'{"model": "scripted", "prompt": "hi \\ud800"}',
                                  headers={"Content-Type": "application/json"})
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt", surrogate.text
    assert engine.sessions == [], "nothing refused reached the engine"


@pytest.mark.engine
async def test_the_real_engines_complete_as_vllm_does(redis_url: str, real_engine: Engine,
                                                      vllm_sidecar: VllmSidecar) -> None:
    """vLLM's quickstart prompt, and a chat prompt written by hand in the model's own special
    tokens, at temperature 0: the words are vLLM's own, and so is the prompt's token count."""
    vllm_sidecar.ensure_running()
    vllm = openai.AsyncOpenAI(base_url=f"{vllm_sidecar.url}/v1", api_key="unused", max_retries=0)
    served = (await vllm.models.list()).data[0].id
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        oai = openai_client(client)
        model = real_engine.capabilities.model_names[0]
        for prompt, tokens in [("San Francisco is a", 7), (CHAT_PROMPT, 12)]:
            ours = await oai.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0)
            theirs = await vllm.completions.create(model=served, prompt=prompt, max_tokens=tokens, temperature=0)
            assert ours.choices[0].text == theirs.choices[0].text, (prompt, ours.choices[0].text)
            assert ours.usage is not None and theirs.usage is not None
            assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
            assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
        assert "Paris" in ours.choices[0].text
        # vllm bench serve's random dataset: the answer runs to max_tokens, past the end of sequence.
        benched = await oai.completions.create(model=model, prompt="Hi", max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert benched.usage is not None and benched.usage.completion_tokens == 24
        assert benched.choices[0].finish_reason == "length"
        # min_tokens alone (no max_tokens): at least that many, the rest up to the model.
        floor = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                  temperature=0, extra_body={"min_tokens": 12})
        assert floor.usage is not None and floor.usage.completion_tokens >= 12
        # A long prompt in the model's chat format fits: its special tokens count one each.
        turns = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n" * 111
        long = await oai.completions.create(model=model, prompt=turns, max_tokens=2, temperature=0)
        assert long.usage is not None and 1400 < long.usage.prompt_tokens < 1500
        with pytest.raises(openai.BadRequestError) as too_long:
            await oai.completions.create(model=model, prompt="word " * 5000, max_tokens=4)
        assert too_long.value.code == "context_length_exceeded" and too_long.value.param == "prompt"


@pytest.mark.engine
async def test_the_real_engines_return_the_answer_s_log_probabilities_as_vllm_does(
        redis_url: str, real_engine: Engine, vllm_sidecar: VllmSidecar) -> None:
    """``logprobs`` / ``top_logprobs`` in chat (whole and streamed) and ``logprobs`` in completions, at
    temperature 0: the tokens are the answer's and vLLM's own, their log probabilities vLLM's (to
    numerical noise), and each token is the likeliest of those listed beside it."""
    vllm_sidecar.ensure_running()
    vllm = openai.AsyncOpenAI(base_url=f"{vllm_sidecar.url}/v1", api_key="unused", max_retries=0)
    served = (await vllm.models.list()).data[0].id
    asked: dict[str, Any] = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        oai = openai_client(client)
        model = real_engine.capabilities.model_names[0]
        ours = (await oai.chat.completions.create(model=model, **asked)).choices[0]
        theirs = (await vllm.chat.completions.create(model=served, **asked)).choices[0]
        stream = await oai.chat.completions.create(model=model, stream=True, **asked)
        streamed = [entry async for chunk in stream for choice in chunk.choices
                    for entry in (choice.logprobs.content or [] if choice.logprobs else [])]
        completed = (await oai.completions.create(model=model, prompt="San Francisco is a", max_tokens=6,
                                                  temperature=0, logprobs=2)).choices[0]
        reference = (await vllm.completions.create(model=served, prompt="San Francisco is a", max_tokens=6,
                                                   temperature=0, logprobs=2)).choices[0]
        unscored = (await oai.chat.completions.create(model=model, **{**asked, "logprobs": False,
                                                                      "top_logprobs": None})).choices[0]
        # The Responses API: the same tokens on its output text, whole and streamed.
        responded = await oai.responses.create(model=model, input=asked["messages"], max_output_tokens=8,
                                               temperature=0, top_logprobs=3,
                                               include=["message.output_text.logprobs"])
        responded_stream = await oai.responses.create(model=model, input=asked["messages"], max_output_tokens=8,
                                                      temperature=0, top_logprobs=3, stream=True)
        streamed_events = [event async for event in responded_stream]
        deltas = [entry for event in streamed_events if event.type == "response.output_text.delta"
                  for entry in event.logprobs or ()]
        done = next(event for event in streamed_events if event.type == "response.output_text.done")
    assert ours.logprobs is not None and ours.logprobs.content and theirs.logprobs and theirs.logprobs.content
    tokens = ours.logprobs.content
    # vLLM lists the end of sequence too (``<|im_end|>``) when the answer ends with it.
    assert "".join(t.token for t in tokens).removesuffix("<|im_end|>") == ours.message.content
    assert [t.token for t in tokens] == [t.token for t in theirs.logprobs.content]
    assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in theirs.logprobs.content], abs=0.05)
    for token in tokens:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in tokens]
    assert unscored.logprobs is None
    said = responded.output[0]
    assert said.type == "message" and said.content[0].type == "output_text"
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in said.content[0].logprobs or ()] \
        == [(t.token, t.logprob, 3) for t in tokens]  # (chat's, the end of sequence too)
    assert [t.token for t in done.logprobs or ()] == [t.token for t in said.content[0].logprobs or ()]
    assert [t.token for t in deltas] == [t.token for t in done.logprobs or ()][:len(deltas)] and deltas
    assert completed.logprobs is not None and reference.logprobs is not None
    assert completed.logprobs.tokens == reference.logprobs.tokens and "".join(completed.logprobs.tokens) == completed.text
    assert completed.logprobs.text_offset == reference.logprobs.text_offset
    assert completed.logprobs.token_logprobs == pytest.approx(reference.logprobs.token_logprobs, abs=0.05)
    assert completed.logprobs.top_logprobs and all(len(top) == 2 for top in completed.logprobs.top_logprobs)


async def test_the_sessions_api_streams_a_raw_prompt(scripted: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    """A prompt built while it streams (a retrieval app's own template): ``raw_prompt`` on the
    sessions API, its chunks the prompt in order; with chat's fields it is a 422 that says why."""
    client, engine = scripted
    created = await client.post(BASE, json={"model": "scripted", "raw_prompt": True})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    for seq, text in enumerate(["Context: the sky is blue.\n", "Question: what colour is the sky?\nAnswer:"]):
        sent = await client.post(f"{BASE}/{sid}/chunks",
                                 json={"sequence_id": seq, "text": text, "end_of_input": seq == 1})
        assert sent.status_code in (200, 202), sent.text
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert content_of(events) == "echo: Context: the sky is blue.\nQuestion: what colour is the sky?\nAnswer:"
    assert engine.sessions[-1].request.raw_prompt and engine.sessions[-1].request.messages == ()
    refused = await client.post(BASE, json={"model": "scripted", "raw_prompt": True,
                                            "messages": [{"role": "system", "content": "Be brief."}]})
    assert refused.status_code == 422 and "raw_prompt" in refused.json()["error"]["message"]
