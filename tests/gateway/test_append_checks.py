"""What can be checked at append is checked at append (real vLLM, SmolLM2).

A request the engine would refuse, and input that would overflow the model's
context, are 4xx answers before anything is stored, with the engine's
details; the session stays as it was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from omni_adapter.port import Engine
from omni_adapter.vllm_engine import VllmEngine
from tests.gateway.client import BASE, app_client, make_settings, openai_client
from tests.gateway.test_api import assert_error, view

pytestmark = pytest.mark.engine


@pytest.fixture
async def client(redis_url: str, vllm_engine: VllmEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as c:
        yield c


async def test_sampling_values_the_engine_refuses_are_422_at_create(client: httpx.AsyncClient) -> None:
    # top_k=-5 passes the API's schema; vLLM refuses it. It used to fail the session later.
    error = assert_error(await client.post(BASE, json={"top_k": -5}), 422, "validation_error")
    assert "top_k" in error["message"]
    chat = await client.post("/v1/chat/completions", json={
        "model": "SmolLM2-135M-Instruct", "top_k": -5, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400  # OpenAI's doors: a 400, as OpenAI and vLLM answer
    # Past 64 bits: vLLM's engine could not send them (a 500 and its traceback).
    for field, value in (("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**70)):
        assert_error(await client.post(BASE, json={field: value}), 422, "validation_error", field)
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
            answer = await client.post(path, json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2, **body,
                                                   field: value})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, (path, answer.text)


async def test_input_past_the_context_is_413_and_the_session_stays(
        client: httpx.AsyncClient, vllm_engine: VllmEngine) -> None:
    sid = (await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
    words = "one two three four five six seven eight nine ten " * 100  # ~1,000 tokens
    for seq in range(3):
        assert (await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": words})).status_code == 202
    # The fourth would take the input past SmolLM2's 4,096 tokens.
    error = assert_error(await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 3, "text": words * 2}),
                         413, "context_length_exceeded")
    assert error["max_input_tokens"] == vllm_engine.max_input_tokens and error["prompt_tokens"] > 4000
    state = await view(client, sid)
    assert state["state"] == "open" and state["received_chunks"] == 3  # nothing stored, nothing failed
    # A shorter last chunk still fits, and the session answers.
    last = await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 3, "text": "Count them.",
                                                           "end_of_input": True})
    assert last.status_code == 202


async def test_history_past_the_context_is_413_at_create(client: httpx.AsyncClient) -> None:
    history = [{"role": "system", "content": "word " * 5000}]
    assert_error(await client.post(BASE, json={"messages": history}), 413, "context_length_exceeded", "messages")


async def test_a_chat_past_the_context_is_openai_s_400(redis_url: str, real_engine: Engine) -> None:
    """As OpenAI and vLLM answer it, so frameworks that trim on context_length_exceeded see it:
    whether the gateway counts (in-process) or the engine does (a vllm serve sidecar)."""
    async with app_client(make_settings(redis_url=redis_url), real_engine) as client:
        oai = openai_client(client)
        for long in ([{"role": "system", "content": "word " * 5000}, {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "word " * 5000}]):
            with pytest.raises(openai.BadRequestError) as raised:
                await oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=long, max_tokens=4)
            assert raised.value.code == "context_length_exceeded" and raised.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as raised:
            await oai.responses.create(model="SmolLM2-135M-Instruct", input="word " * 5000, max_output_tokens=4)
        assert raised.value.code == "context_length_exceeded" and raised.value.param == "input"


def test_token_lower_bound_never_exceeds_the_real_count(vllm_engine: VllmEngine) -> None:
    tokenizer = vllm_engine._streaming  # the engine's own rules
    text = "Here is a list of fruits:  apples, pears,\n\nplums and 12 cherries. Which fruit is red? Don't."
    for cut in range(1, len(text)):
        pieces = [text[:cut], text[cut:]]
        total = len(tokenizer.encode_plain(text))
        assert sum(vllm_engine.input_tokens_at_least(p) for p in pieces) <= total
