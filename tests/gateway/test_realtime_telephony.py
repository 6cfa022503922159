"""G.711 on the Realtime WebSocket, as a phone bridge sends it (a Twilio Media Stream: μ-law
at 8 kHz in 20 ms pieces), with the official ``openai`` SDK as the client.

The caller's audio is made the way a phone network would make it, independently of the
gateway's codec: hibari speaks, the stdlib's ``audioop`` resamples to 8 kHz and encodes
μ-law. The answer's μ-law is decoded the same way and heard by the real recognizer.
"""

from __future__ import annotations

import audioop  # the test's own G.711, not the gateway's (PyAV's): deprecated since 3.11, still here
import base64
import threading
from typing import Any

import numpy as np
import pytest

from gateway.api.realtime.audio_formats import G711Decoder, G711Encoder, Transcoder
from gateway.api.realtime.config import RealtimeConfig
from omni_adapter.listener import with_listener
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import answer_text, sdk, until
from tests.voice import SPEECH_RATE, recognize, speech, word_error_rate

QUESTION = "What is the capital of France?"
PHONE_RATE = 8_000
#: A Twilio Media Stream's piece: 20 ms of μ-law at 8 kHz.
PIECE_BYTES = 160


def phone_ulaw(pcm24k: bytes) -> bytes:
    """What a phone network carries of ``pcm24k``: 8 kHz, μ-law."""
    narrow, _ = audioop.ratecv(pcm24k, 2, 1, SPEECH_RATE, PHONE_RATE, None)
    return audioop.lin2ulaw(narrow, 2)


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    noise = reference.astype(float) - other.astype(float)
    return float(10 * np.log10(np.sum(reference.astype(float) ** 2) / max(np.sum(noise ** 2), 1.0)))


@pytest.mark.parametrize("kind", ["audio/pcmu", "audio/pcma"])
def test_the_codec_round_trip_keeps_the_voice(kind: str) -> None:
    """Speech through the gateway's encoder (24 → 8 kHz, G.711) and decoder (back to 24 kHz): the
    bytes are G.711's size, and the voice is the same (band-limited to the phone's 4 kHz)."""
    voice = speech(QUESTION)
    encoder = G711Encoder(kind)
    encoded = b"".join(encoder.encode(voice[i:i + 960]) for i in range(0, len(voice), 960)) + encoder.flush()
    assert abs(len(encoded) - len(voice) // 2 // 3) <= 1  # one byte per 8 kHz sample, the filter's tail too
    decoder = G711Decoder(kind)
    back = b"".join(decoder.pcm(encoded[i:i + PIECE_BYTES]) for i in range(0, len(encoded), PIECE_BYTES))
    original = np.frombuffer(voice, "<i2")
    restored = np.frombuffer(back, "<i2")
    narrow = np.frombuffer(audioop.ratecv(audioop.ratecv(voice, 2, 1, SPEECH_RATE, PHONE_RATE, None)[0], 2, 1,
                                          PHONE_RATE, SPEECH_RATE, None)[0], "<i2")
    # Compared with the same voice band-limited by another resampler: aligned by the filters' delay.
    best = max(snr_db(narrow[:len(restored) - 200], restored[shift:len(restored) - 200 + shift])
               for shift in range(0, 120))
    assert best > 10, best
    assert len(restored) > 0.9 * len(original)
    assert kind == "audio/pcmu" or audioop.alaw2lin(encoded[:PIECE_BYTES], 2)  # A-law decodes as A-law


async def test_a_long_mulaw_append_is_translated_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two minutes of μ-law in one append (1.3 MB of base64, under the event cap) is decoded and
    resampled in a worker thread, a 20 ms piece on the loop; the audio is what one decoder makes
    of the three pieces as one stream."""
    call = phone_ulaw(speech(QUESTION))
    long_call = call * max(1, 120 * PHONE_RATE // len(call))
    pieces = [call[:PIECE_BYTES], long_call, call[:PIECE_BYTES]]
    events = [{"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()} for piece in pieces]
    expected = [np.frombuffer(pcm, "<i2") for pcm in map(G711Decoder("audio/pcmu").pcm, pieces)]
    threads: list[bool] = []
    decode = G711Decoder.pcm

    def watched(self: G711Decoder, encoded: bytes) -> bytes:
        threads.append(threading.current_thread() is threading.main_thread())
        return decode(self, encoded)

    monkeypatch.setattr(G711Decoder, "pcm", watched)
    transcoder = Transcoder()
    translated = [await transcoder.client_event(event, "audio/pcmu") for event in events]
    assert threads == [True, False, True]  # on the loop (the main thread), off it, on it
    got = [np.frombuffer(base64.b64decode(event["audio"]), "<i2") for event in translated]
    assert [len(samples) for samples in got] == [len(samples) for samples in expected]
    # The same samples, but for the last bit: soxr's float rounding may differ between threads.
    assert all(np.abs(a.astype(int) - b).max(initial=0) <= 2 for a, b in zip(got, expected, strict=True))


def test_the_session_takes_the_ga_and_the_beta_names_and_refuses_other_formats() -> None:
    from gateway import errors

    config = RealtimeConfig(model="m", can_speak=True)
    config.update({"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                 "output": {"format": {"type": "audio/pcma"}}}})
    audio = config.session_object("s")["audio"]
    assert audio["input"]["format"] == {"type": "audio/pcmu"} and audio["output"]["format"] == {"type": "audio/pcma"}
    config.update({"input_audio_format": "pcm16", "output_audio_format": "g711_ulaw"})  # the beta protocol's
    assert (config.input_audio_format, config.output_audio_format) == ("audio/pcm", "audio/pcmu")
    assert RealtimeConfig.restored(config.saved(), can_transcribe=False) == config
    plain = RealtimeConfig(model="m", can_speak=True)
    assert "input_audio_format" not in plain.saved()  # a release before reads it (a rolling deploy)
    for bad, param in [({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "session.audio.input.format"),
                       ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
                        "session.audio.output.format"),
                       ({"audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}},
                        "session.audio.input.format"),
                       ({"input_audio_format": "mp3"}, "session.input_audio_format")]:
        with pytest.raises(errors.ValidationFailed) as refused:
            config.update(bad)
        assert refused.value.param == param


async def test_mulaw_appends_and_a_mulaw_item_are_heard_and_the_session_says_its_formats(redis_url: str) -> None:
    """The scripted engine echoes what the recognizer heard of the μ-law question."""
    async with live_app(make_settings(redis_url=redis_url), with_listener(ScriptedEngine())) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await until(connection, "session.created")
        await connection.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}}})
        updated = (await until(connection, "session.updated"))[-1]
        assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
        call = phone_ulaw(speech(QUESTION))
        for start in range(0, len(call), PIECE_BYTES):
            await connection.input_audio_buffer.append(audio=base64.b64encode(call[start:start + PIECE_BYTES]).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        appended = await until(connection, "response.done")
        # The same call's words as a recorded item (an input_audio part), in the same format.
        await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": base64.b64encode(phone_ulaw(speech("How tall is Mount Everest?"))).decode()}]})
        await connection.response.create()
        recorded = await until(connection, "response.done")
    heard = answer_text(appended).removeprefix("echo:").strip()
    assert word_error_rate(QUESTION, heard) <= 0.2, heard
    heard = answer_text(recorded).removeprefix("echo:").strip()
    assert word_error_rate("How tall is Mount Everest?", heard) <= 0.2, heard


@pytest.mark.engine
async def test_a_phone_call_in_mulaw_is_answered_in_mulaw_on_the_real_engine(redis_url: str, vllm_engine: Any) -> None:
    from omni_adapter.talker import with_talker

    engine = with_talker(with_listener(vllm_engine))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model=engine.capabilities.model_names[0]) as connection:
        await until(connection, "session.created")
        await connection.session.update(session={  # as OpenAI's Twilio example sets it; server_vad ends the turn
            "type": "realtime", "instructions": "You are a helpful assistant. Answer in one sentence.",
            "max_output_tokens": 24, "temperature": 0,
            "audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcmu"}}}})
        call = phone_ulaw(speech(QUESTION) + bytes(2 * SPEECH_RATE))  # then a second of the line's silence
        for start in range(0, len(call), PIECE_BYTES):
            await connection.input_audio_buffer.append(audio=base64.b64encode(call[start:start + PIECE_BYTES]).decode())
        events = await until(connection, "response.done", within_sec=120)
    answer = answer_text(events)
    assert "Paris" in answer, answer
    ulaw = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(ulaw) > PHONE_RATE // 2  # more than half a second, at one byte per 8 kHz sample
    spoken = audioop.ulaw2lin(ulaw, 2)
    assert word_error_rate(answer, recognize(spoken, PHONE_RATE)) <= 0.5, recognize(spoken, PHONE_RATE)
