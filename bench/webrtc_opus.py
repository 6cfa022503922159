"""The CPU a WebRTC call's media costs (issue 30): Opus in and out, per second of call.

A call decodes the browser's Opus (aiortc's ``OpusDecoder``: libopus through
PyAV), mixes it down and resamples it to 24 kHz (``media.mono_pcm16``: soxr),
and encodes the answer's 24 kHz frames to Opus (``SpeakerTrack`` frames into
aiortc's ``OpusEncoder``, which resamples to 48 kHz stereo first). This runs
those same pieces on ``--seconds`` of 20 ms frames in one thread, without the
network (RTP, SRTP, ICE are left out: per packet they are a few hashes and a
copy), and prints CPU milliseconds per second of audio each way; a full call
receives all the time and sends while the answer plays (the track sends
silence otherwise, which costs the encoder the same).

    .venv/bin/python -m bench.webrtc_opus [--seconds 60]
"""

from __future__ import annotations

import argparse
import fractions
import time

import numpy as np
from aiortc.codecs.opus import OpusDecoder, OpusEncoder
from aiortc.jitterbuffer import JitterFrame
from av import AudioFrame

from gateway.api.realtime.media import FRAME_SAMPLES, RATE, SpeakerTrack, mono_pcm16
from omni_adapter.audio import StreamResampler

BROWSER_RATE = 48_000


def voice_like(seconds: float, rate: int) -> np.ndarray:
    """A stand-in for speech: a wobbling 120-900 Hz tone with noise, syllable-shaped (int16)."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 120 + 60 * np.sin(2 * np.pi * 3 * t)
    tone = np.sin(2 * np.pi * np.cumsum(pitch) / rate) + 0.3 * np.sin(2 * np.pi * 900 * t)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)
    noise = np.random.default_rng(0).normal(0, 0.05, t.size)
    return (np.clip((tone * envelope + noise) * 0.3, -1, 1) * 32767).astype("<i2")


def browser_packets(seconds: float) -> list[bytes]:
    """What a browser sends: 20 ms Opus packets of 48 kHz stereo (made here with the same encoder)."""
    encoder, pcm = OpusEncoder(), voice_like(seconds, BROWSER_RATE)
    step = BROWSER_RATE // 50
    packets: list[bytes] = []
    for i, start in enumerate(range(0, pcm.size - step + 1, step)):
        frame = AudioFrame.from_ndarray(np.repeat(pcm[start:start + step], 2).reshape(1, -1), format="s16",
                                        layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = BROWSER_RATE, i * step, fractions.Fraction(1, BROWSER_RATE)
        packets += encoder.encode(frame)[0]
    return packets


def cpu_ms_per_audio_sec(seconds: float) -> tuple[float, float]:
    packets = browser_packets(seconds)
    decoder, resampler = OpusDecoder(), StreamResampler(RATE)
    started = time.process_time()
    for i, packet in enumerate(packets):
        for frame in decoder.decode(JitterFrame(data=packet, timestamp=i * 960)):
            mono_pcm16(frame, resampler)
    inbound = (time.process_time() - started) * 1000 / seconds

    answer = voice_like(seconds, RATE).tobytes()
    track, encoder = SpeakerTrack(lambda _: None, lambda _: None), OpusEncoder()
    track.speak("r", answer)
    started = time.process_time()
    for _ in range(len(answer) // (FRAME_SAMPLES * 2)):
        frame = track._frame(track._next_pcm())
        encoder.encode(frame)
        track._pts += FRAME_SAMPLES
    outbound = (time.process_time() - started) * 1000 / seconds
    return inbound, outbound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    inbound, outbound = cpu_ms_per_audio_sec(args.seconds)
    print(f"per second of call audio, one thread: in (Opus decode + mix + soxr to 24 kHz) {inbound:.1f} ms CPU; "
          f"out (24 kHz frames + Opus encode) {outbound:.1f} ms CPU; both {inbound + outbound:.1f} ms "
          f"-> {1000 / (inbound + outbound):.0f} calls' media per core, speaking all the time")


if __name__ == "__main__":
    main()
