"""``POST /v1/audio/speech`` through the official OpenAI client, as voice-agent frameworks' OpenAI
TTS services call it; and sessions that speak their input (``speak_input``).

Real redis-server, the real Talker (hibari) behind the scripted Thinker (which must never be
asked: text to speech answers nothing), and the real recognizer (Moonshine) to hear what was
said: each file, decoded by FFmpeg (PyAV) as a player would, must say the text.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import av
import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from gateway.service.models import CreateSessionRequest
from gateway.store.session_hash import StoredRequest
from omni_adapter.audio import OPENAI_PCM16_RATE, parse_wav
from omni_adapter.listener import with_listener
from omni_adapter.port import SamplingOptions
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from omni_adapter.talker import with_talker
from tests.gateway.client import app_client, live_app, make_settings, openai_client
from tests.gateway.test_api import assert_error
from tests.voice import recognize, word_error_rate

TEXT = "The museum opens early in the morning."


@pytest.fixture(scope="module")
def thinker() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def client(redis_url: str, thinker: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), with_talker(with_listener(thinker))) as c:
        yield c


def played(data: bytes) -> tuple[bytes, int]:
    """The file's samples as a player decodes them: mono pcm16 and its rate."""
    with av.open(io.BytesIO(data)) as file:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=OPENAI_PCM16_RATE)
        frames = [out for frame in file.decode(file.streams.audio[0]) for out in resampler.resample(frame)]
        frames += resampler.resample(None)
    return b"".join(np.asarray(f.to_ndarray()).tobytes() for f in frames), OPENAI_PCM16_RATE


async def test_every_format_says_the_text(client: httpx.AsyncClient, thinker: ScriptedEngine) -> None:
    """pipecat asks for pcm, LiveKit for mp3; players take the rest."""
    oai = openai_client(client)
    for fmt in ("mp3", "opus", "aac", "flac", "wav", "pcm"):
        speech = await oai.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt)
        data = speech.content
        pcm, rate = (data, OPENAI_PCM16_RATE) if fmt == "pcm" else played(data)
        assert len(pcm) > rate, fmt  # over half a second of speech
        assert word_error_rate(TEXT, recognize(pcm, rate)) == 0, (fmt, recognize(pcm, rate))
    assert thinker.sessions == [], "text to speech asks the Thinker nothing"


async def test_a_long_text_comes_in_pieces_as_it_is_spoken(redis_url: str) -> None:
    """Over a real socket (the in-process transport reads a response whole)."""
    text = "First, open the door. Then, turn on the lights, and close the window behind you."
    async with live_app(make_settings(redis_url=redis_url), with_talker(ScriptedEngine())) as url:
        oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with oai.audio.speech.with_streaming_response.create(model="gpt-4o-mini-tts", voice="marin",
                                                                   input=text, response_format="pcm") as response:
            pieces = [piece async for piece in response.iter_bytes()]
    assert len(pieces) > 2, "each phrase is sent once it is spoken"
    assert word_error_rate(text, recognize(b"".join(pieces), OPENAI_PCM16_RATE)) <= 0.1


async def test_the_file_in_server_sent_events(client: httpx.AsyncClient) -> None:
    """``stream_format: sse`` (LiveKit asks for it): the file's bytes in ``speech.audio.delta``
    events, then ``speech.audio.done``."""
    response = await client.post("/v1/audio/speech", json={"model": "gpt-4o-mini-tts", "voice": "ash", "input": TEXT,
                                                          "response_format": "mp3", "stream_format": "sse"})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    assert all(e["audio"] for e in events[:-1]), "no empty delta"
    pcm, rate = played(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]))
    assert word_error_rate(TEXT, recognize(pcm, rate)) == 0


async def test_what_it_cannot_do_is_a_clear_error(client: httpx.AsyncClient, redis_url: str) -> None:
    speak = {"model": "tts-1", "voice": "alloy", "input": "Hello."}
    for fields, status, param in (({"speed": 4.5}, 400, "speed"), ({"speed": 0.2}, 400, "speed"),
                                  ({"input": ""}, 400, "input"), ({"input": "a" * 4097}, 400, "input"),
                                  ({"response_format": "ogg"}, 400, "response_format")):
        refused = await client.post("/v1/audio/speech", json={**speak, **fields})
        assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text
    for unsaid in ("   ", "\U0001f642\U0001f642"):  # nothing the voice can say: not an empty file
        refused = await client.post("/v1/audio/speech", json={**speak, "input": unsaid})
        assert assert_error(refused, 400, "invalid_request", param="input")["message"].startswith("the input has nothing")
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as mute:
        assert_error(await mute.post("/v1/audio/speech", json=speak), 400, "unsupported_modality")


async def test_a_session_speaks_its_text_as_it_streams_in(client: httpx.AsyncClient,
                                                          thinker: ScriptedEngine) -> None:
    """The sessions API's text to speech: an LLM's tokens from elsewhere, spoken while they come."""
    created = await client.post("/v1/streaming_input/sessions", json={
        "model": "scripted", "modalities": ["text", "audio"], "speak_input": True})
    assert created.status_code == 201, created.text
    session = created.json()["session_id"]
    base = f"/v1/streaming_input/sessions/{session}"
    for seq, piece in enumerate(["The museum opens ", "early in ", "the morning."]):
        sent = await client.post(f"{base}/chunks", json={"sequence_id": seq, "text": piece})
        assert sent.status_code == 202, sent.text
    await client.post(f"{base}/finish", json={})
    async with client.stream("GET", f"{base}/events") as events:
        frames = [json.loads(line[5:]) for line in [line async for line in events.aiter_lines()]
                  if line.startswith("data:") and line != "data: [DONE]"]
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices"))
    assert text == TEXT, "the answer's text is the input"
    result = (await client.get(f"{base}/result", params={"wait": 30})).json()
    pcm, rate = parse_wav(base64.b64decode(result["completion"]["choices"][0]["message"]["audio"]["data"]))
    assert word_error_rate(TEXT, recognize(pcm, rate)) == 0
    refused = await client.post("/v1/streaming_input/sessions", json={
        "model": "scripted", "modalities": ["text"], "speak_input": True})
    assert_error(refused, 422, "validation_error")  # the sessions API's contract: 422
    assert thinker.sessions == []


async def test_speech_that_waits_too_long_for_room_is_a_503_and_frees_its_session(redis_url: str) -> None:
    """Every engine slot busy: no speech begins within ``chat_queue_timeout_sec``; the request is
    dropped with a 503, as a chat's is, never left without an answer's status."""
    settings = make_settings(redis_url=redis_url, max_engine_sessions=1, chat_queue_timeout_sec=0.5,
                             max_sessions_per_identity=2)
    async with app_client(settings, with_talker(ScriptedEngine(Script(hang=True)))) as client:
        busy = await client.post("/v1/streaming_input/sessions", json={
            "model": "scripted", "first_chunk": {"sequence_id": 0, "text": "x", "end_of_input": True}})
        assert busy.json()["owner"] is not None  # the one slot
        async with asyncio.timeout(5):
            queued = await client.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi."})
        assert_error(queued, 503, "capacity_exhausted")
        assert (await client.post("/v1/streaming_input/sessions", json={"model": "scripted"})).status_code == 201


async def test_speed_speaks_faster_or_slower_and_is_still_heard(client: httpx.AsyncClient) -> None:
    """OpenAI's ``speed`` (pipecat's and LiveKit's TTS settings): hibari's own pace where it says
    it right (0.5 to 1), and FFmpeg's atempo for the rest of a speed beyond."""
    oai = openai_client(client)
    length: dict[float, int] = {}
    for speed in (1.0, 1.25, 1.5, 0.5, 4.0, 0.25):
        speech = await oai.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                               speed=speed)
        length[speed] = len(speech.content)
        if speed in (1.0, 1.25, 0.5, 1.5):
            # (at 1.5 the recognizer may miss a short word: "The" lasts 60 ms)
            errors = word_error_rate(TEXT, recognize(speech.content, OPENAI_PCM16_RATE))
            assert errors <= (1 / 7 if speed == 1.5 else 0), (speed, errors)
    for speed in (1.25, 1.5, 0.5, 4.0, 0.25):  # the length asked, within 6 % (each phrase's pause too)
        assert abs(length[speed] / length[1.0] * speed - 1) < 0.06, (speed, length)


async def test_a_voice_of_one_pace_refuses_another_speed(redis_url: str) -> None:
    """An engine that speaks itself at one pace (vLLM-Omni's Talker, a vLLM-Omni sidecar) says so,
    never speaks at 1 as if asked: a 400 from the speech door, a 422 from the sessions API."""
    one_pace = ScriptedEngine(capabilities=replace(text_capabilities(), output_modalities=frozenset({"text", "audio"}),
                                                   speech=True))
    async with app_client(make_settings(redis_url=redis_url), one_pace) as client:
        refused = await client.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi.",
                                                              "speed": 1.25})
        assert "one speed" in assert_error(refused, 400, "validation_error", param="speed")["message"]
        session = {"model": "scripted", "modalities": ["text", "audio"], "speak_input": True}
        assert_error(await client.post("/v1/streaming_input/sessions", json={**session, "speed": 0.5}),
                     422, "validation_error", param="speed")
        for speed in (None, 1):
            made = await client.post("/v1/streaming_input/sessions", json={**session, "speed": speed})
            assert made.status_code == 201, made.text


async def test_the_speed_travels_with_the_session(client: httpx.AsyncClient, thinker: ScriptedEngine) -> None:
    """The sessions API's ``speed``: stored with the session (a new holder speaks at it too); only
    with audio output."""
    created = await client.post("/v1/streaming_input/sessions", json={
        "model": "scripted", "modalities": ["text", "audio"], "speak_input": True, "speed": 1.25,
        "first_chunk": {"sequence_id": 0, "text": TEXT, "end_of_input": True}})
    assert created.status_code == 201, created.text
    base = f"/v1/streaming_input/sessions/{created.json()['session_id']}"
    result = (await client.get(f"{base}/result", params={"wait": 30})).json()
    pcm, rate = parse_wav(base64.b64decode(result["completion"]["choices"][0]["message"]["audio"]["data"]))
    assert word_error_rate(TEXT, recognize(pcm, rate)) == 0
    refused = await client.post("/v1/streaming_input/sessions", json={"model": "scripted", "speed": 1.25})
    assert_error(refused, 422, "validation_error")
    assert thinker.sessions == []


def test_the_speed_is_stored_only_when_set_and_needed_by_a_replica() -> None:
    """A replica of the release before reads every session at speed 1 and refuses one at another
    speed (it would speak it at 1); a retry there digests a request without ``speed`` the same."""
    plain = StoredRequest(messages=(), modalities=("text", "audio"), sampling=SamplingOptions(), speak_input=True)
    assert "speech_speed" not in json.loads(plain.to_json())
    fast = replace(plain, speech_speed=1.25)
    assert json.loads(fast.to_json())["needs"] == ["speak_input", "speech_speed"]
    assert StoredRequest.from_json(fast.to_json()) == fast
    assert StoredRequest.from_json(fast.to_json()).engine_request("r", "m").speech_speed == 1.25
    asked = CreateSessionRequest(modalities=["text", "audio"], speak_input=True)
    assert "speed" not in json.loads(asked.model_dump_json(exclude=asked.unset_since_digests))
