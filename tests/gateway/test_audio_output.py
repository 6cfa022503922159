"""AudioDelta -> ``delta.audio`` frames and the result's wav, for any engine's sample rate."""

from __future__ import annotations

import base64
import json

import numpy as np

from gateway.output.audio import AudioOutput
from gateway.output.frames import FrameBuilder
from omni_adapter.audio import OPENAI_PCM16_RATE, parse_wav
from omni_adapter.port import AudioDelta, Usage

FRAMES = FrameBuilder("sis-abc123", "m", 1_700_000_000)


def completion() -> dict:
    return FRAMES.completion("Hi. Bye.", "stop", Usage(1, 2))


def test_frames_carry_24khz_pcm16_whatever_rate_the_engine_speaks() -> None:
    audio = AudioOutput(FRAMES, ttl_sec=60)
    native = np.arange(1200, dtype="<i2").tobytes()  # 0.1 s at 12 kHz
    frames = [json.loads(audio.frame(AudioDelta(native, 12_000, transcript=t))) for t in ("Hi.", "Bye.")]
    tail = audio.flush_frame()  # what the resampler's filter held back, at the end of the answer
    assert tail is not None
    frames.append(json.loads(tail))
    deltas = [f["choices"][0]["delta"]["audio"] for f in frames]
    assert frames[0]["object"] == "chat.completion.chunk" and frames[0]["choices"][0]["finish_reason"] is None
    # The streamed transcripts add up to the whole one (OpenAI's deltas concatenate).
    assert deltas[0]["id"] == "audio_abc123" and [d["transcript"] for d in deltas] == ["Hi.", " Bye.", ""]
    pcm = b"".join(base64.b64decode(d["data"]) for d in deltas)
    assert len(pcm) == 2 * 4800  # 0.2 s at 24 kHz: one stream, nothing lost at the joins
    assert audio.flush_frame() is None

    message = audio.complete(completion())["choices"][0]["message"]
    assert message["content"] == "Hi. Bye."
    assert message["audio"]["transcript"] == "Hi. Bye." == "".join(d["transcript"] for d in deltas)
    assert message["audio"]["expires_at"] == deltas[0]["expires_at"]
    assert parse_wav(base64.b64decode(message["audio"]["data"])) == (pcm, OPENAI_PCM16_RATE)


def test_a_stream_at_24khz_passes_as_it_is() -> None:
    audio = AudioOutput(FRAMES, ttl_sec=60)
    same_rate = np.full(240, 7, dtype="<i2").tobytes()
    frame = json.loads(audio.frame(AudioDelta(same_rate, OPENAI_PCM16_RATE, transcript="Bye.")))
    assert base64.b64decode(frame["choices"][0]["delta"]["audio"]["data"]) == same_rate
    assert audio.flush_frame() is None


def test_a_text_only_answer_has_no_audio() -> None:
    assert AudioOutput(FRAMES, ttl_sec=60).complete(completion()) == completion()


def test_after_a_hand_off_the_result_keeps_the_audio_streamed_before_it() -> None:
    before = AudioOutput(FRAMES, ttl_sec=60)
    spoken = [before.frame(AudioDelta(np.full(240, 3, dtype="<i2").tobytes(), OPENAI_PCM16_RATE, "Hi."))]
    streamed = [FRAMES.role(), FRAMES.content("Hi."), *spoken, FRAMES.content(" Bye.")]

    after = AudioOutput(FRAMES, ttl_sec=60)  # the new owner's relay
    after.replay(streamed)
    after.frame(AudioDelta(np.full(240, 5, dtype="<i2").tobytes(), OPENAI_PCM16_RATE, "Bye."))
    message = after.complete(completion())["choices"][0]["message"]
    pcm, _ = parse_wav(base64.b64decode(message["audio"]["data"]))
    assert pcm == np.full(240, 3, dtype="<i2").tobytes() + np.full(240, 5, dtype="<i2").tobytes()
    assert message["audio"]["transcript"] == "Hi. Bye."
