"""A session's spoken answer: ``delta.audio`` frames while it streams, a wav in the result.

Engines yield ``AudioDelta`` (pcm16 at any rate); OpenAI clients expect
``pcm16`` at 24 kHz in ``delta.audio.data`` and the whole answer as
``message.audio`` (base64 wav) in the non-streamed completion. One
``AudioOutput`` per relayed session does both, so the relay stays the same
for every adapter (the CPU Talker, vLLM-Omni's own Talker, a sidecar).
"""

from __future__ import annotations

import base64
import copy
import json
import time
from collections.abc import Iterable
from typing import Any, cast

from gateway.output.audio_file import AudioFileWriter, SpeechFormat
from gateway.output.frames import DONE, FrameBuilder
from omni_adapter.audio import OPENAI_PCM16_RATE, StreamResampler, parse_wav, wav_of
from omni_adapter.port import AudioDelta


class AudioOutput:
    def __init__(self, frames: FrameBuilder, ttl_sec: float) -> None:
        self._frames = frames
        #: OpenAI's audio ids look like ``audio_<hex>``.
        self.audio_id = "audio_" + frames.session_id.removeprefix("sis-")
        #: Until when the audio can be read back (the result's lifetime).
        self.expires_at = int(time.time() + ttl_sec)
        self._pcm: list[bytes] = []
        self._transcript: list[str] = []
        #: The answer's audio is one stream: resampled with the filter's state carried
        #: from delta to delta (no click where one ends and the next begins).
        self._resampler = StreamResampler(OPENAI_PCM16_RATE)

    def frame(self, delta: AudioDelta) -> str:
        pcm = self._resampler.push(delta.pcm16, delta.sample_rate).tobytes()
        self._pcm.append(pcm)
        told = delta.transcript
        if told:
            # The phrases' transcripts, streamed, add up to the whole one (joined by spaces).
            told = f" {told}" if self._transcript and not told[0].isspace() else told
            self._transcript.append(delta.transcript.strip())
        return self._frames.audio({"id": self.audio_id, "data": base64.b64encode(pcm).decode(),
                                   "transcript": told, "expires_at": self.expires_at})

    def flush_frame(self) -> str | None:
        """The last samples the resampler holds back (its filter's delay), at the answer's end."""
        tail = self._resampler.flush().tobytes()
        if not tail:
            return None
        self._pcm.append(tail)
        return self._frames.audio({"id": self.audio_id, "data": base64.b64encode(tail).decode(),
                                   "transcript": "", "expires_at": self.expires_at})

    def replay(self, frame_data: Iterable[str]) -> None:
        """Take back what an earlier holder of the session already streamed (after a hand-off)."""
        for data in frame_data:
            if data == DONE:
                continue
            for choice in json.loads(data).get("choices", ()):
                if spoken := choice["delta"].get("audio"):
                    self._pcm.append(base64.b64decode(spoken["data"]))
                    if spoken.get("transcript"):
                        self._transcript.append(spoken["transcript"].strip())

    def complete(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The completion with ``message.audio`` added, if anything was spoken."""
        if not self._pcm:
            return completion
        wav = wav_of(b"".join(self._pcm), OPENAI_PCM16_RATE)
        completion["choices"][0]["message"]["audio"] = {
            "id": self.audio_id, "data": base64.b64encode(wav).decode(),
            "expires_at": self.expires_at, "transcript": " ".join(self._transcript)}
        return completion


def in_format(completion: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A stored completion's spoken answer (kept as wav) in the format the request asked: bare
    pcm16 at 24 kHz (OpenAI's ``message.audio.data`` is then the samples), or a file FFmpeg encodes
    (mp3, flac, opus, aac, as ``/v1/audio/speech`` writes them)."""
    audio = completion["choices"][0]["message"].get("audio")
    if fmt == "wav" or not audio or not audio.get("data"):
        return completion
    pcm, _ = parse_wav(base64.b64decode(audio["data"]))
    if fmt != "pcm16":
        writer = AudioFileWriter(cast(SpeechFormat, fmt))
        pcm = writer.write(pcm) + writer.close()
    answer = copy.deepcopy(completion)
    answer["choices"][0]["message"]["audio"]["data"] = base64.b64encode(pcm).decode()
    return answer
