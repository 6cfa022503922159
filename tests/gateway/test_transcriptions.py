"""``POST /v1/audio/transcriptions`` through the official OpenAI client, as voice-agent frameworks'
OpenAI STT services call it; and sessions that only hear (``modalities: []``).

Real redis-server, the real Listener (Silero VAD, Moonshine) in front of the scripted Thinker
(which must never be asked: a transcription answers nothing), speech made on the spot by hibari
and by espeak-ng in a voice of its own, files encoded by FFmpeg (PyAV) as clients send them.
"""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
from collections.abc import AsyncIterator

import av
import httpx
import numpy as np
import openai
import pytest

from omni_adapter.audio import resample
from omni_adapter.audio import wav_of as wav
from omni_adapter.listener import with_listener
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import app_client, make_settings, openai_client
from tests.gateway.test_api import assert_error
from tests.voice import SPEECH_RATE, speech, word_error_rate

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def thinker() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def client(redis_url: str, thinker: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), with_listener(thinker)) as c:
        yield c


def encoded(pcm16: bytes, rate: int, container: str, codec: str) -> bytes:
    """The recording as a client's file: ``codec`` in ``container``, by FFmpeg."""
    out = io.BytesIO()
    with av.open(out, "w", format=container) as file:
        stream = file.add_stream(codec, rate=48_000 if codec == "libopus" else rate, layout="mono")
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=stream.rate)
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm16, "<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        for part in [*resampler.resample(frame), *resampler.resample(None)]:
            file.mux(stream.encode(part))
        file.mux(stream.encode(None))
    return out.getvalue()


def espeak(text: str, voice: str) -> bytes:
    """A WAV file of espeak-ng saying ``text`` in ``voice`` (22,050 Hz)."""
    espeak_ng = shutil.which("espeak-ng")
    assert espeak_ng is not None, "espeak-ng is not installed (scripts/setup.sh installs it)"
    return subprocess.run([espeak_ng, "-v", voice, "--stdout", text], check=True, capture_output=True).stdout


async def test_files_in_the_formats_clients_send_are_heard(client: httpx.AsyncClient,
                                                           thinker: ScriptedEngine) -> None:
    """pipecat and LiveKit send a WAV of the utterance and name OpenAI's models; browsers record
    WebM/Ogg Opus; phones and files are MP3 or M4A."""
    oai = openai_client(client)
    said = speech(QUESTION)
    files = {"question.wav": wav(said, SPEECH_RATE),
             "question.mp3": encoded(said, SPEECH_RATE, "mp3", "libmp3lame"),
             "question.ogg": encoded(said, SPEECH_RATE, "ogg", "libopus"),
             "question.m4a": encoded(said, SPEECH_RATE, "mp4", "aac")}
    for name, data in files.items():
        heard = await oai.audio.transcriptions.create(model="whisper-1", file=(name, data), language="en")
        assert word_error_rate(QUESTION, heard.text) == 0, (name, heard.text)
        assert heard.usage is not None and heard.usage.type == "duration" and heard.usage.seconds >= 1
    question = "How many legs does a spider have?"
    other_voice = await oai.audio.transcriptions.create(model="gpt-4o-transcribe",
                                                        file=("v.wav", espeak(question, "en-us+m3")),
                                                        response_format="text")
    assert isinstance(other_voice, str) and word_error_rate(question, other_voice) <= 0.15, other_voice
    verbose = await oai.audio.transcriptions.create(model="whisper-1", file=("q.wav", files["question.wav"]),
                                                    response_format="verbose_json")  # LiveKit asks whisper-1 so
    assert verbose.language == "english" and verbose.duration > 1 and word_error_rate(QUESTION, verbose.text) == 0
    assert thinker.sessions == [], "a transcription asks the Thinker nothing"


async def test_chat_input_audio_in_mp3_is_heard(redis_url: str) -> None:
    """OpenAI's chat takes input_audio in wav and mp3; mp3 was refused by name."""
    mp3 = base64.b64encode(encoded(speech(QUESTION), SPEECH_RATE, "mp3", "libmp3lame")).decode()
    async with app_client(make_settings(redis_url=redis_url), with_listener(ScriptedEngine())) as client:
        answer = await openai_client(client).chat.completions.create(model="scripted", messages=[{
            "role": "user", "content": [{"type": "input_audio", "input_audio": {"data": mp3, "format": "mp3"}}]}])
        assert answer.choices[0].message.content == f"echo: {QUESTION}"
        not_mp3 = base64.b64encode(b"not an mp3 at all").decode()
        refused = await client.post("/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user",
            "content": [{"type": "input_audio", "input_audio": {"data": not_mp3, "format": "mp3"}}]}]})
        assert_error(refused, 400, "invalid_payload", "messages.0.content.0.input_audio.data")


async def test_a_file_whose_sample_rate_changes_midway_is_heard_whole(client: httpx.AsyncClient) -> None:
    """Joined MP3s (or chained Ogg) change rate between frames; each part is heard."""
    first, second = "Turn on the lights.", "And close the door."
    joined = (encoded(speech(first), SPEECH_RATE, "mp3", "libmp3lame")
              + encoded(resample(speech(second), SPEECH_RATE, 16_000), 16_000, "mp3", "libmp3lame"))
    heard = await openai_client(client).audio.transcriptions.create(model="whisper-1", file=("joined.mp3", joined))
    assert word_error_rate(f"{first} {second}", heard.text) <= 0.15, heard.text


async def test_a_streamed_transcription_tells_the_words_then_the_whole_text(client: httpx.AsyncClient) -> None:
    oai = openai_client(client)
    said = speech("Turn on the lights.") + bytes(SPEECH_RATE) + speech("And close the door.")
    stream = await oai.audio.transcriptions.create(model="gpt-4o-mini-transcribe", stream=True,
                                                   file=("two.wav", wav(said, SPEECH_RATE)))
    events = [event async for event in stream]
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) > 2
    done = events[-1]
    assert done.type == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == done.text  # type: ignore[union-attr]
    assert word_error_rate("Turn on the lights. And close the door.", done.text) == 0, done.text


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK's mark; vLLM still serves it
async def test_a_translation_is_the_english_speechs_transcript(client: httpx.AsyncClient) -> None:
    """OpenAI's translations (to English), as the SDK asks: the recognizer hears English."""
    oai = openai_client(client)
    said = ("q.wav", wav(speech(QUESTION), SPEECH_RATE))
    translated = await oai.audio.translations.create(model="whisper-1", file=said)
    assert word_error_rate(QUESTION, translated.text) == 0, translated.text
    verbose = await oai.audio.translations.create(model="whisper-1", file=said, response_format="verbose_json")
    assert (verbose.text, verbose.language) == (translated.text, "english") and verbose.duration > 1
    with pytest.raises(openai.BadRequestError, match="no timings"):
        await oai.audio.translations.create(model="whisper-1", file=said, response_format="srt")
    french = await client.post("/v1/audio/translations", files={"file": said},  # vLLM's source language
                               data={"model": "whisper-1", "language": "fr"})
    assert_error(french, 400, "invalid_request", "language")


async def test_silence_is_an_empty_text(client: httpx.AsyncClient) -> None:
    heard = await openai_client(client).audio.transcriptions.create(
        model="whisper-1", file=("quiet.wav", wav(bytes(2 * 16_000 * 2), 16_000)))
    assert heard.text == ""


async def test_what_it_cannot_do_is_a_clear_error(client: httpx.AsyncClient) -> None:
    oai = openai_client(client)
    good = ("q.wav", wav(speech("Hello."), SPEECH_RATE))
    with pytest.raises(openai.BadRequestError) as french:
        await oai.audio.transcriptions.create(model="whisper-1", file=good, language="fr")
    assert french.value.code == "invalid_request" and "language" in str(french.value)
    for timed in ({"response_format": "srt"}, {"response_format": "verbose_json",
                                                "timestamp_granularities": ["word"]}):
        with pytest.raises(openai.BadRequestError) as refused_timings:
            await oai.audio.transcriptions.create(model="whisper-1", file=good, **timed)  # type: ignore[call-overload]
        assert "no timings" in str(refused_timings.value)
    plain_form = await client.post("/v1/audio/transcriptions", files={"file": good},
                                   data={"model": "whisper-1", "timestamp_granularities": "word"})  # curl's spelling
    assert "no timings" in assert_error(plain_form, 400, "invalid_request", "timestamp_granularities")["message"]
    diarized = await client.post("/v1/audio/transcriptions", files={"file": good},
                                 data={"model": "whisper-1", "response_format": "diarized_json"})
    assert "speakers" in assert_error(diarized, 400, "invalid_request", "response_format")["message"]
    several = await client.post("/v1/audio/transcriptions", files={"file": good},  # LiveKit's, for gpt-transcribe
                                data={"model": "gpt-transcribe", "languages[]": ["en", "fr"]})
    assert "'fr'" in assert_error(several, 400, "invalid_request", "languages")["message"]
    # Headerless pcm16 (what /v1/audio/speech gives for "pcm"): FFmpeg would guess a format for it.
    for data in (b"not audio at all", b"", speech("Hello.")):
        refused = await client.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                                    files={"file": ("x.wav", data)})
        assert assert_error(refused, 400, "invalid_payload")["param"] == "file"
    missing = await client.post("/v1/audio/transcriptions", data={"model": "whisper-1"})
    assert missing.status_code == 400
    answerless = await client.post("/v1/chat/completions", json={
        "model": "scripted", "modalities": [], "messages": [{"role": "user", "content": "hi"}]})
    assert "transcriptions" in assert_error(answerless, 400, "validation_error", param="modalities")["message"]


async def test_a_file_at_an_absurd_sample_rate_is_refused_not_billed_for_its_stretch(
        client: httpx.AsyncClient) -> None:
    # 2 KB at 4 Hz was heard, and billed, as 250 s; the rates the sessions take (8-192 kHz) are taken.
    for rate in (4, 400_000):
        refused = await client.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                                    files={"file": ("slow.wav", wav(bytes(2_000), rate))})
        error = assert_error(refused, 400, "invalid_payload", param="file")
        assert f"{rate} Hz" in error["message"]
    heard = await client.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                              files={"file": ("quiet.wav", wav(bytes(2 * 8_000), 8_000))})
    assert heard.status_code == 200 and heard.json()["usage"] == {"type": "duration", "seconds": 1}


async def test_audio_longer_than_a_session_takes_is_a_413_before_it_is_all_decoded(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, max_payload_per_session=2 * 16_000 * 2)  # 2 s at 16 kHz
    async with app_client(settings, with_listener(ScriptedEngine())) as small:
        refused = await small.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                                   files={"file": ("long.wav", wav(speech(QUESTION), SPEECH_RATE))})
        assert "longer than 2 s" in assert_error(refused, 413, "payload_too_large", param="file")["message"]


async def test_an_engine_that_cannot_hear_says_so(redis_url: str) -> None:
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as deaf:
        refused = await deaf.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                                  files={"file": ("q.wav", wav(speech("Hello."), SPEECH_RATE))})
        assert_error(refused, 400, "unsupported_modality")


async def test_a_session_that_only_hears_streams_its_transcript_and_answers_nothing(
        client: httpx.AsyncClient, thinker: ScriptedEngine) -> None:
    """Live transcription on the sessions API: ``modalities: []``."""
    created = await client.post("/v1/streaming_input/sessions", json={"model": "scripted", "modalities": []})
    assert created.status_code == 201, created.text
    session = created.json()["session_id"]
    said = speech(QUESTION)
    step = SPEECH_RATE // 10 * 2  # 100 ms chunks, as a microphone sends them
    for seq, at in enumerate(range(0, len(said), step)):
        sent = await client.post(f"/v1/streaming_input/sessions/{session}/chunks", content=said[at:at + step],
                                 headers={"Content-Type": "application/octet-stream", "X-Sequence-Id": str(seq),
                                          "X-Modality": "audio", "X-Format": "pcm16", "X-Sample-Rate": "24000"})
        assert sent.status_code in (200, 201, 202), sent.text
    await client.post(f"/v1/streaming_input/sessions/{session}/finish", json={})
    result = (await client.get(f"/v1/streaming_input/sessions/{session}/result", params={"wait": 30})).json()
    assert result["state"] == "completed", result
    assert word_error_rate(QUESTION, result["input_transcript"]) == 0, result
    assert result["completion"]["choices"][0]["message"]["content"] == ""
    assert thinker.sessions == []
