"""Server-side turn detection (``turn_detection: server_vad``) with Silero VAD.

OpenAI's default: the server says when speech starts and stops, and answers
without a commit. The appended pcm16 (24 kHz) is resampled to 16 kHz as one
stream and scored by Silero VAD every 32 ms (``omni_adapter/vad.py``):
speech starts at ``START_WINDOWS`` windows in a row at or above
``threshold`` (OpenAI's knob: a speech probability, 0.5 by default) and
stops after ``silence_duration_ms`` below ``threshold - 0.15`` (Silero's own
hysteresis); ``speech_started`` reports ``prefix_padding_ms`` before the
start. Noise, music and breathing score low, so they do not open turns.

A window costs about 0.3 ms of onnxruntime (a 200 ms append: ~2 ms), so it
runs on the event loop; the model is loaded once per process, on first use.
Without the cached model (setup not run) loudness decides instead.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from omni_adapter.audio import StreamResampler
from omni_adapter.vad import (
    RATE,
    WINDOW_MS,
    LoudnessProbability,
    LoudnessVad,
    SileroVad,
    SpeechProbability,
)

logger = logging.getLogger(__name__)

#: Windows of speech in a row that open a turn (64 ms: not a click).
START_WINDOWS = 2


@dataclass
class VadChange:
    #: "speech_started" or "speech_stopped".
    kind: str
    #: Milliseconds since the buffer's first audio (the speech's start less the padding, or its end).
    at_ms: int
    #: Where in the piece fed the change was decided (bytes): the audio before it is the old side's,
    #: the audio after it the new side's, so a piece holding a stop and the next start is cut twice.
    cut: int = 0


@functools.cache
def _model() -> SileroVad | LoudnessVad:
    """The process's VAD model (immutable, shared by every connection's own stream state)."""
    model = SileroVad.load()
    if model is None:
        logger.warning("Silero VAD's model is not cached (scripts/setup.sh): server_vad goes by loudness")
        return LoudnessVad()
    return model


class SpeechDetector:
    def __init__(self, rate: int, threshold: float = 0.5, silence_duration_ms: int = 500,
                 prefix_padding_ms: int = 300, origin_ms: int = 0) -> None:
        self._rate = rate
        #: Where the detector's first audio is in the connection's buffer (a session.update
        #: starts a new detector): OpenAI's ``audio_start_ms`` counts from the buffer's start.
        self._origin_ms = origin_ms
        self._threshold = threshold
        self._silence_windows = max(1, -(-silence_duration_ms // WINDOW_MS))
        #: Audio kept before a start is decided: the padding asked for, before the speech found
        #: (which began ``START_WINDOWS`` windows before the decision).
        self.padding_ms = prefix_padding_ms + START_WINDOWS * WINDOW_MS
        self._prefix_padding_ms = prefix_padding_ms
        self._resampler = StreamResampler(RATE)
        self._probability: SpeechProbability | LoudnessProbability = _model().stream()
        self._windows_seen = 0
        self._samples_fed = 0
        self._loud_run = 0
        self._quiet_run = 0
        self.speaking = False

    def feed(self, pcm16: bytes) -> list[VadChange]:
        """The starts and stops this audio makes (usually none), in order."""
        changes: list[VadChange] = []
        fed_before, self._samples_fed = self._samples_fed, self._samples_fed + len(pcm16) // 2

        def cut() -> int:
            """The byte of this piece the windows heard so far end at (the resampler's few
            samples of delay put it a little early; the piece's bounds hold it)."""
            heard = self._windows_seen * WINDOW_MS * self._rate // 1000
            return 2 * min(max(0, heard - fed_before), len(pcm16) // 2)

        for probability in self._probability.push(self._resampler.push(pcm16, self._rate)):
            self._windows_seen += 1
            if probability >= self._threshold:
                self._loud_run += 1
                self._quiet_run = 0
            else:
                self._loud_run = 0
                self._quiet_run += probability < self._threshold - 0.15
            if not self.speaking and self._loud_run >= START_WINDOWS:
                self.speaking = True
                start = (self._windows_seen - START_WINDOWS) * WINDOW_MS
                changes.append(VadChange("speech_started",
                                         self._origin_ms + max(0, start - self._prefix_padding_ms), cut()))
            elif self.speaking and self._quiet_run >= self._silence_windows:
                self.speaking = False
                changes.append(VadChange("speech_stopped",
                                         self._origin_ms + (self._windows_seen - self._quiet_run) * WINDOW_MS, cut()))
        return changes
