"""The OpenAI front door, the Talker and capability checks on the real engine.

Real redis-server, the real vLLM engine (SmolLM2, CPU) and real espeak-ng,
composed as the embedded default is (``with_talker``).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator

import av
import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel

from omni_adapter.audio import OPENAI_PCM16_RATE, parse_wav
from omni_adapter.port import Engine
from omni_adapter.talker import EspeakTalker, TalkingEngine
from omni_adapter.vllm_engine import VllmEngine
from tests.gateway.client import (
    BASE,
    app_client,
    content_of,
    make_settings,
    openai_client,
    parse_sse,
)
from tests.gateway.test_api import assert_error
from tests.omni_adapter.sessions import ALIAS

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name a colour. One word."}]
LIST_PROMPT = "List three fruits, one per line."


@pytest.fixture
async def client(redis_url: str, vllm_engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    talker = EspeakTalker.find()
    assert talker is not None, "espeak-ng is not installed (scripts/setup.sh installs it)"
    async with app_client(make_settings(redis_url=redis_url), TalkingEngine(vllm_engine, talker)) as c:
        yield c


def alnum(text: str) -> str:
    return "".join(ch for ch in text if ch.isalnum())


async def test_openai_client_streamed_text_equals_non_streamed(client: httpx.AsyncClient, vllm_engine: VllmEngine) -> None:
    oai = openai_client(client)
    sampling = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 10}
    completion = await oai.chat.completions.create(**sampling)
    stream = await oai.chat.completions.create(**sampling, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]

    text = completion.choices[0].message.content
    assert text and text.strip()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage == completion.usage
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 10
    cards = (await oai.models.list()).data
    assert [m.id for m in cards] == [MODEL, ALIAS]
    # vLLM's card fields: both names serve the engine's model, whose context is the setting's.
    assert [(m.root, m.max_model_len) for m in cards] == [(MODEL, vllm_engine.max_input_tokens + 1)] * 2
    # A client that names the alias (a framework's default model) is answered by the same model.
    # vLLM's template variables: the embedded model's template reads none, so the answer is the same.
    aliased = await oai.chat.completions.create(**{**sampling, "model": ALIAS},
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert aliased.model == ALIAS and aliased.choices[0].message.content == text


async def test_the_responses_api_answers_as_chat_completions_do(client: httpx.AsyncClient) -> None:
    oai = openai_client(client)
    chat = await oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=10)
    response = await oai.responses.create(model=MODEL, input=QUESTION[0]["content"], temperature=0,
                                          max_output_tokens=10)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    class City(BaseModel):
        name: str
        country: str

    parsed = await oai.responses.parse(model=MODEL, input="Name a city in France.", text_format=City,
                                       temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


async def test_a_named_function_call_streamed_and_not_then_its_result_answered(client: httpx.AsyncClient) -> None:
    """Function calling on vLLM's structured output: valid arguments even from the 135M model."""
    oai = openai_client(client)
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    calling = {"model": MODEL, "messages": asked, "tools": [weather], "temperature": 0, "max_tokens": 24,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    completion = await oai.chat.completions.create(**calling)
    [call] = completion.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    stream = await oai.chat.completions.create(**calling, stream=True)
    deltas = [t for c in [chunk async for chunk in stream] if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function and deltas[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in deltas if t.function) == call.function.arguments

    answer = await oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, tools=[weather], messages=[
        {"role": "system", "content": "Tell the user the weather the tool reported."}, *asked,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 24 degrees"}])
    said = answer.choices[0].message.content or ""
    assert "sunny" in said.lower() or "24" in said, said
    # A function that returned nothing: the engine still answers after its empty result.
    empty = await oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, tools=[weather], messages=[
        *asked, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": ""}])
    assert empty.choices[0].finish_reason in ("stop", "length") and empty.usage and empty.usage.completion_tokens
    # An answer that may not call (tool_choice none, or no tools: a framework's reply after a hand-off)
    # is words, not the earlier call's markup copied from the history (it was, from this history).
    for may_not_call in ({"tools": [weather], "tool_choice": "none"}, {}):
        words = await oai.chat.completions.create(model=MODEL, temperature=0, max_tokens=60, **may_not_call, messages=[
            {"role": "system", "content": "You give the weather."}, *asked,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C in Paris"}])
        assert "tool_call" not in (words.choices[0].message.content or ""), (may_not_call, words)


async def test_required_without_parallel_calls_gives_one_call_and_finishes_with_tool_calls(
        client: httpx.AsyncClient) -> None:
    """A newcomer's request: ``required`` with a small ``max_tokens``. The 135M model repeats its
    call until the limit when the schema allows a list; ``parallel_tool_calls: false`` bounds it
    to one, and the answer ends with ``tool_calls``, not ``length``."""
    tools = [{"type": "function", "function": {
        "name": name, "description": about,
        "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
        for name, about, arg in (("get_weather", "The weather in a city", "city"),
                                 ("get_time", "The time now in a timezone", "zone"))]
    for seed in (1, 3):  # at the server's default sampling these seeds wrote a second call, cut off
        completion = await openai_client(client).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=tools,
            tool_choice="required", parallel_tool_calls=False, max_tokens=40, seed=seed)
        choice = completion.choices[0]
        [call] = choice.message.tool_calls or []
        assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)
        assert choice.finish_reason == "tool_calls", seed


async def test_the_real_engines_capabilities_decide_validation(client: httpx.AsyncClient) -> None:
    pcm = base64.b64encode(b"\x00\x01" * 800).decode()
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client(client).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": pcm, "format": "pcm16"}}]}])
    assert raised.value.code == "unsupported_modality"

    # Text in, text and audio out (the Talker); audio in is refused and stores nothing.
    created = await client.post(BASE, json={"modalities": ["text", "audio"], "start_policy": "on_end_only"})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    assert_error(await client.post(f"{BASE}/{sid}/chunks", json={
        "sequence_id": 0, "modality": "audio", "payload": pcm}), 422, "unsupported_modality", "modality")
    assert (await client.get(f"{BASE}/{sid}")).json()["received_chunks"] == 0
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204


async def test_text_and_audio_session_streams_speech_before_done(client: httpx.AsyncClient) -> None:
    response = await client.post(BASE, json={
        "modalities": ["text", "audio"], "temperature": 0, "max_tokens": 20,
        "first_chunk": {"sequence_id": 0, "text": LIST_PROMPT, "end_of_input": True}})
    sid = response.json()["session_id"]
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].data == "[DONE]"
    deltas = [e.json()["choices"][0]["delta"] for e in events[:-1] if e.json()["choices"]]
    kinds = ["audio" if "audio" in d else "content" if "content" in d else "other" for d in deltas]
    assert "audio" in kinds
    # Speech starts while the text is still streaming, not after it.
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("content")

    text = content_of(events)
    audio = [d["audio"] for d in deltas if "audio" in d]
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert np.abs(samples).max() > 1_000, "the audio is silent"
    seconds = len(samples) / OPENAI_PCM16_RATE
    # espeak-ng at 175 words a minute says some 10-20 characters a second.
    assert len(alnum(text)) / 40 < seconds < len(alnum(text)) / 4, (seconds, text)
    assert alnum("".join(a["transcript"] for a in audio)) == alnum(text)
    assert len({a["id"] for a in audio}) == 1

    result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 30})).json()
    message = result["completion"]["choices"][0]["message"]
    assert message["content"] == text
    assert parse_wav(base64.b64decode(message["audio"]["data"])) == (pcm, OPENAI_PCM16_RATE)
    assert message["audio"]["id"] == audio[0]["id"]
    assert alnum(message["audio"]["transcript"]) == alnum(text)


async def test_openai_client_gets_audio_in_a_non_streamed_completion(client: httpx.AsyncClient) -> None:
    completion = await openai_client(client).chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
        modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    message = completion.choices[0].message
    assert message.audio is not None and message.content
    pcm, rate = parse_wav(base64.b64decode(message.audio.data))
    assert rate == OPENAI_PCM16_RATE and len(pcm) > 0.2 * rate * 2
    assert alnum(message.audio.transcript) == alnum(message.content)
    # pcm16: the bare samples (24 kHz), as OpenAI sends them; the same answer at temperature 0.
    bare = await openai_client(client).chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
        modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"})
    assert bare.choices[0].message.audio is not None
    assert base64.b64decode(bare.choices[0].message.audio.data) == pcm
    # The other formats OpenAI gives a whole answer in: files that decode to the same length of speech.
    for fmt in ("mp3", "flac"):
        encoded = await openai_client(client).chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
            modalities=["text", "audio"], audio={"voice": "alloy", "format": fmt})
        assert encoded.choices[0].message.audio is not None
        with av.open(io.BytesIO(base64.b64decode(encoded.choices[0].message.audio.data))) as file:
            assert file.format.name == fmt
            seconds = sum(frame.samples / frame.sample_rate for frame in file.decode(audio=0))
        assert abs(seconds - len(pcm) / 2 / OPENAI_PCM16_RATE) < 0.1, (fmt, seconds)
    refused = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "modalities": ["text", "audio"], "stream": True,
        "audio": {"voice": "alloy", "format": "mp3"}})
    assert "pcm16" in assert_error(refused, 400, "validation_error")["message"]
    in_session = await client.post(BASE, json={"modalities": ["text", "audio"], "audio": {"format": "opus"}})
    assert "wav" in assert_error(in_session, 422, "validation_error")["message"]
