"""Server-side turn detection (``turn_detection: server_vad``), by loudness.

OpenAI's default: the server says when speech starts and stops, and answers
without a commit. This detector looks at 20 ms frames of the appended pcm16:
speech starts after ``START_FRAMES`` loud frames in a row and stops after
``silence_duration_ms`` of quiet. ``threshold`` (0..1, OpenAI's knob) scales
the loudness a frame needs. It is cheap (numpy over the frames of one append)
and runs on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_MS = 20
#: Loud frames in a row that make a start (ignores clicks).
START_FRAMES = 3
#: The RMS (pcm16) a frame needs at ``threshold`` 0.5; speech at normal level is ~1000-5000.
BASE_RMS = 300.0


@dataclass
class VadChange:
    #: "speech_started" or "speech_stopped".
    kind: str
    #: Milliseconds since the first audio of the connection's buffer.
    at_ms: int


class SpeechDetector:
    def __init__(self, rate: int, threshold: float = 0.5, silence_duration_ms: int = 500,
                 prefix_padding_ms: int = 300) -> None:
        self._frame = rate * FRAME_MS // 1000
        self._min_rms = BASE_RMS * (threshold / 0.5) if threshold > 0 else 1.0
        self._silence_frames = max(1, silence_duration_ms // FRAME_MS)
        self.prefix_padding_ms = prefix_padding_ms
        self._pending = np.zeros(0, dtype="<i2")
        self._frames_seen = 0
        self._loud_run = 0
        self._quiet_run = 0
        self.speaking = False

    def feed(self, pcm16: bytes) -> list[VadChange]:
        """The starts and stops this audio makes (usually none)."""
        usable = len(pcm16) - len(pcm16) % 2
        samples = np.concatenate([self._pending, np.frombuffer(pcm16[:usable], dtype="<i2")])
        whole = len(samples) // self._frame * self._frame
        self._pending = samples[whole:]
        changes: list[VadChange] = []
        if whole == 0:
            return changes
        frames = samples[:whole].astype(np.float64).reshape(-1, self._frame)
        for loud in np.sqrt(np.mean(frames * frames, axis=1)) >= self._min_rms:
            self._frames_seen += 1
            if loud:
                self._loud_run += 1
                self._quiet_run = 0
            else:
                self._quiet_run += 1
                self._loud_run = 0
            if not self.speaking and self._loud_run >= START_FRAMES:
                self.speaking = True
                start = (self._frames_seen - START_FRAMES) * FRAME_MS
                changes.append(VadChange("speech_started", max(0, start - self.prefix_padding_ms)))
            elif self.speaking and self._quiet_run >= self._silence_frames:
                self.speaking = False
                changes.append(VadChange("speech_stopped", (self._frames_seen - self._quiet_run) * FRAME_MS))
        return changes
