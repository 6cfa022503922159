"""What every real adapter must do, run on each (``real_engine``: in-process vLLM and the sidecar)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from omni_adapter.factory import EngineChoice, open_prompt_counter
from omni_adapter.port import (
    Engine,
    EngineRejectedError,
    EngineRequest,
    Finished,
    InputChunk,
    PromptCounter,
    RequestChecks,
    SamplingOptions,
    TextDelta,
)
from omni_adapter.vllm_engine import VllmEngine
from tests.omni_adapter.sessions import ALIAS, MODEL, one_shot, request, text_chunks

pytestmark = pytest.mark.engine

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
#: A function called earlier in the conversation, and its result.
CALLED = ({"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
              "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "c0", "content": "rain"})
QUESTION = "What colour is the sky on a clear day? Answer — briefly, it's a test."


async def test_max_tokens_ends_with_length(real_engine: Engine) -> None:
    text, end = await one_shot(real_engine, request(max_tokens=3), "Tell me a long story.")
    assert text
    assert isinstance(end, Finished)
    assert (end.finish_reason, end.usage.completion_tokens) == ("length", 3)


async def test_stop_string_truncates_the_answer(real_engine: Engine) -> None:
    full, _ = await one_shot(real_engine, request(), QUESTION)
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    text, end = await one_shot(real_engine, request(stop=(stop,)), QUESTION)
    assert text == full[: full.index(stop)]
    assert isinstance(end, Finished) and end.finish_reason == "stop"


async def test_a_streamed_input_keeps_the_answers_decoding_options_and_log_probabilities(
        real_engine: Engine) -> None:
    """vLLM makes a streamed request's detokenizer and log probability keeper at its first input:
    what the final input asks (special tokens kept, joined; log probabilities) holds when the input
    streamed in before the end. (Special tokens: ``<|im_start|>``, which logit_bias forces.)"""

    async def streamed(**sampling: object) -> tuple[str, int]:
        session = real_engine.open_session(request(max_tokens=3, logit_bias={"1": 100}, **sampling))
        for chunk in text_chunks(b"Say hi to me, please, my good friend.", 8):
            await session.feed([chunk])
            await asyncio.sleep(0.2)  # each piece prefilled before the next
        await session.end_input()
        deltas = [event async for event in session.events()]
        assert isinstance(deltas[-1], Finished), deltas[-1]
        said = [delta for delta in deltas if isinstance(delta, TextDelta)]
        return "".join(d.text for d in said), sum(len(d.logprobs) for d in said)

    assert await streamed() == ("", 0)
    assert (await streamed(skip_special_tokens=False, spaces_between_special_tokens=False))[0] == "<|im_start|>" * 3
    assert (await streamed(logprobs=1))[1] == 3


async def test_abort_mid_generation_ends_events_then_engine_still_serves(real_engine: Engine) -> None:
    session = real_engine.open_session(request(max_tokens=400, temperature=1.0, seed=1))
    await session.feed(text_chunks(b"Write a long essay about rivers.", 8))
    await session.end_input()
    events = session.events()
    async with asyncio.timeout(60):
        first = await anext(events)
    assert isinstance(first, TextDelta)
    await session.abort()
    async with asyncio.timeout(5):
        rest = [event async for event in events]
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 400
    await session.abort()  # twice is fine
    _, end = await one_shot(real_engine, request(max_tokens=2), "Hi")
    assert isinstance(end, Finished) and end.usage.completion_tokens == 2


async def test_abort_before_any_input(real_engine: Engine) -> None:
    session = real_engine.open_session(request())
    await session.abort()
    await session.abort()
    events = [event async for event in session.events()]
    assert len(events) == 1 and isinstance(events[0], Finished)
    assert events[0].finish_reason == "abort" and events[0].usage.prompt_tokens == 0


async def test_unsupported_chunks_models_and_modalities_are_rejected(real_engine: Engine) -> None:
    session = real_engine.open_session(request())
    with pytest.raises(EngineRejectedError):
        await session.feed([InputChunk(sequence_id=0, modality="audio", data=b"\0\0")])
    await session.abort()
    with pytest.raises(EngineRejectedError):
        real_engine.open_session(EngineRequest("x", "other-model", (), SamplingOptions()))
    with pytest.raises(EngineRejectedError):
        real_engine.open_session(
            EngineRequest("x", MODEL, (), SamplingOptions(), output_modalities=("audio",)))


async def test_the_answer_so_far_after_a_hand_off_counts_as_the_answers(real_engine: Engine) -> None:
    """A new holder continues the answer after its text so far (the assistant's prefix): that text
    counts against max_tokens and in the usage as completion tokens, not prompt tokens."""
    _, alone = await one_shot(real_engine, request(max_tokens=1), QUESTION)
    continued = replace(request(max_tokens=6), assistant_prefix="The sky is")
    text, end = await one_shot(real_engine, continued, QUESTION)
    assert isinstance(alone, Finished) and isinstance(end, Finished)
    assert end.usage.prompt_tokens == alone.usage.prompt_tokens, "the prefix is the answer's, not the prompt's"
    # "The sky is" is three tokens of the six: at most three more are made.
    assert end.usage.completion_tokens <= 6 and len(text.split()) <= 3, (text, end)
    # The answer so far is all max_tokens allows: it ends (in-process vLLM makes one token more).
    everything_said = replace(request(max_tokens=2), assistant_prefix="The sky is")
    text, end = await one_shot(real_engine, everything_said, QUESTION)
    assert isinstance(end, Finished) and end.finish_reason == "length" and len(text.split()) <= 1, (text, end)



@pytest.fixture
async def counter(real_engine: Engine, request: pytest.FixtureRequest) -> AsyncIterator[tuple[PromptCounter, int]]:
    """The adapter's prompt counter as a process opens it (``open_prompt_counter``), and its context."""
    if isinstance(real_engine, RequestChecks):
        opened = await open_prompt_counter(EngineChoice(kind="vllm"), real_engine)
        context = real_engine.max_input_tokens + 1
    else:  # an API worker has no engine: it opens the sidecar's counter from the settings
        sidecar = request.getfixturevalue("vllm_sidecar")
        opened = await open_prompt_counter(EngineChoice(kind="openai-http", engine_url=sidecar.url), None)
        context = sidecar.max_model_len
    assert isinstance(opened, PromptCounter)
    try:
        yield opened, context
    finally:
        await opened.aclose()


async def test_the_prompt_counter_counts_as_the_in_process_engine(counter: tuple[PromptCounter, int],
                                                                    vllm_engine: VllmEngine) -> None:
    """Every process counts a prompt (a Realtime history's trim) as its engine will take it: by the
    engine's checks in process, by the sidecar's /tokenize in front of it; both count alike."""
    counts, context = counter
    assert counts.max_input_tokens == context - 1
    turns = tuple({"role": role, "content": f"Turn {n}: {'name a fruit' if role == 'user' else 'A pear.'}"}
                  for n in range(12) for role in ("user", "assistant"))
    counted = []
    for req in (request(history=()), request(), request(history=(*request().messages, *turns)),
                replace(request(), input_role="system"), replace(request(), model=ALIAS),
                replace(request(history=(*request().messages, *CALLED)), tools=(WEATHER,))):
        tokens = await counts.prompt_tokens(req)
        assert tokens == vllm_engine.check_request(replace(req, model=MODEL)) > 0, req
        counted.append(tokens)
    assert counted[2] > counted[1] + 12 * 8, "the history counts"
    assert counted[5] > counted[1] + 50, "the tools count (told in SmolLM2's system prompt), and the call"
