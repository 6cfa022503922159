"""A request that names no sampling gets the served model's defaults, on every front door.

The embedded SmolLM2-135M samples at its model card's temperature 0.2 and
top-p 0.9 (written into its generation config at conversion). At OpenAI's
1.0, which the engine used to fill in, two of three chat completions of this
question came back in broken French (issue 28).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from omni_adapter.vllm_engine import VllmEngine
from tests.gateway.client import app_client, live_app, make_settings, openai_client
from tests.gateway.test_realtime import answer_text, sdk, text_turn, until

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
TRIES = 10


@pytest.fixture
async def client(redis_url: str, vllm_engine: VllmEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as c:
        yield c


@pytest.mark.engine
def test_the_engine_samples_with_the_model_card_s_defaults(vllm_engine: VllmEngine) -> None:
    assert (vllm_engine.sampling_defaults.temperature, vllm_engine.sampling_defaults.top_p) == (0.2, 0.9)


@pytest.mark.engine
async def test_chat_completions_without_sampling_fields_say_paris(client: httpx.AsyncClient) -> None:
    oai = openai_client(client)
    answers = [(await oai.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=12,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )).choices[0].message.content or "" for _ in range(TRIES)]
    assert all("Paris" in answer for answer in answers), answers


@pytest.mark.engine
async def test_realtime_turns_at_the_server_s_defaults_say_paris(redis_url: str, vllm_engine: VllmEngine) -> None:
    answers = []
    async with live_app(make_settings(redis_url=redis_url), vllm_engine) as url:
        for _ in range(TRIES):  # a connection each: no earlier answer in the history
            async with sdk(url).realtime.connect(model="SmolLM2-135M-Instruct") as connection:
                await until(connection, "session.created")
                # GA Realtime has no temperature: what the server defaults to is what users get.
                await connection.session.update(session={
                    "type": "realtime", "instructions": SYSTEM, "output_modalities": ["text"],
                    "max_output_tokens": 12, "audio": {"input": {"turn_detection": None}}})
                answers.append(answer_text(await text_turn(connection, QUESTION)))
    assert all("Paris" in answer for answer in answers), answers
