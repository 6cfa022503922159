"""Is this speech? Silero VAD on onnxruntime, and the phrases it cuts a stream into.

Silero VAD (MIT) is a small recurrent model: 32 ms of 16 kHz audio (512
samples, plus the 64 before them as context) and its state in, the
probability of speech out. Noise, music and breathing score low where a
loudness threshold would open a turn. The model file is the one setup took
from the ``silero-vad`` wheel (``omni_adapter/speech_models.py``); one
onnxruntime session serves every stream of the process, each stream keeps
its own state. A window costs ~0.3 ms, and onnxruntime releases the GIL
while it runs.

:class:`PhraseCutter` turns the probabilities into phrases for a recognizer
that is not a streaming model (Moonshine): a phrase ends at a pause, so
its words can be settled, and prefilled, while the next one is spoken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

RATE = 16_000
#: Samples per window (32 ms), and the samples of context before each.
WINDOW = 512
CONTEXT = 64
WINDOW_MS = WINDOW * 1000 // RATE


class SileroVad:
    """The model, loaded once per process; :meth:`stream` for each audio stream."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self._session = ort.InferenceSession(str(path / "silero_vad.onnx"), options,
                                             providers=["CPUExecutionProvider"])
        self._rate = np.array(RATE, dtype=np.int64)

    @classmethod
    def load(cls) -> SileroVad | None:
        """The model setup cached, or ``None`` when setup has not made it (or onnxruntime is missing)."""
        from omni_adapter.speech_models import cached_speech_models

        models = cached_speech_models()
        if models is None:
            return None
        try:
            return cls(models.silero_vad)
        except ImportError:
            return None

    def stream(self) -> SpeechProbability:
        return SpeechProbability(self)

    def run(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        probability, new_state = self._session.run(
            None, {"input": window[None, :], "state": state, "sr": self._rate})
        return float(probability[0, 0]), new_state


class SpeechProbability:
    """One stream: 16 kHz samples in, the speech probability of each whole 32 ms window out."""

    def __init__(self, model: SileroVad) -> None:
        self._model = model  # the state, the context and what is not a window yet are the stream's
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._samples = np.zeros(CONTEXT, dtype=np.float32)  # context, then what is not a window yet

    def push(self, samples: np.ndarray) -> list[float]:
        """``samples``: int16 at 16 kHz. One probability per window completed."""
        self._samples = np.concatenate([self._samples, samples.astype(np.float32) / 32768.0])
        probabilities = []
        at = 0
        while len(self._samples) - at >= CONTEXT + WINDOW:
            probability, self._state = self._model.run(self._samples[at:at + CONTEXT + WINDOW], self._state)
            probabilities.append(probability)
            at += WINDOW
        self._samples = self._samples[at:]
        return probabilities


@dataclass
class PhraseCutter:
    """Cuts a stream into phrases at pauses (see the module docstring).

    A phrase opens at a window of speech (``threshold``), with up to
    ``padding_ms`` of the audio before it (the recognizer hears the onset),
    and closes after ``pause_ms`` below ``threshold - 0.15`` (Silero's own
    hysteresis). It keeps ``tail_ms`` after its last window of speech: the
    rest of the pause, or of a noise the VAD half believes, only invites the
    recognizer to say more than was said. Phrases of fewer than
    ``min_speech_ms`` of speech are dropped as clicks; one that grows past
    ``max_phrase_sec`` is cut where it is (Moonshine's encoder reads the whole
    phrase at once).
    """

    threshold: float = 0.5
    pause_ms: int = 300
    padding_ms: int = 200
    tail_ms: int = 160
    min_speech_ms: int = 90
    max_phrase_sec: float = 20.0
    _before: list[np.ndarray] = field(default_factory=list)
    _phrase: list[np.ndarray] = field(default_factory=list)
    _speech_windows: int = 0
    _quiet_windows: int = 0
    #: How many windows of the phrase end with its last window of speech.
    _through_speech: int = 0
    _closed: int = 0

    @property
    def in_phrase(self) -> bool:
        return bool(self._phrase)

    @property
    def closed(self) -> int:
        """How many phrases were closed (or dropped) so far: the open one's number."""
        return self._closed

    def open_phrase(self) -> np.ndarray | None:
        """The open phrase so far, as it would close now (``None`` before it has speech enough)."""
        if self._speech_windows * WINDOW_MS < self.min_speech_ms:
            return None
        return np.asarray(np.concatenate(self._phrase[:self._through_speech + self.tail_ms // WINDOW_MS]))

    def push(self, windows: list[np.ndarray], probabilities: list[float]) -> list[np.ndarray]:
        """The windows' samples and their probabilities in; the phrases that closed out."""
        closed = []
        for window, probability in zip(windows, probabilities, strict=True):
            if not self._phrase:
                if probability >= self.threshold:
                    self._phrase = [*self._before, window]
                    self._before, self._speech_windows, self._quiet_windows = [], 1, 0
                    self._through_speech = len(self._phrase)
                else:
                    self._before = [*self._before, window][-max(0, self.padding_ms // WINDOW_MS):]
                continue
            self._phrase.append(window)
            if probability >= self.threshold:
                self._speech_windows += 1
                self._through_speech = len(self._phrase)
            if probability >= self.threshold - 0.15:
                self._quiet_windows = 0
            else:
                self._quiet_windows += 1
            long = len(self._phrase) * WINDOW >= self.max_phrase_sec * RATE
            if self._quiet_windows * WINDOW_MS >= self.pause_ms or long:
                phrase = self._close()
                if phrase is not None:
                    closed.append(phrase)
        return closed

    def flush(self) -> np.ndarray | None:
        """The phrase still open (at the end of the input), if it has speech."""
        return self._close() if self._phrase else None

    def _close(self) -> np.ndarray | None:
        phrase = self._phrase[:self._through_speech + self.tail_ms // WINDOW_MS]
        enough = self._speech_windows * WINDOW_MS >= self.min_speech_ms
        self._phrase, self._speech_windows, self._quiet_windows = [], 0, 0
        self._closed += 1
        return np.concatenate(phrase) if enough else None


class PhraseStream:
    """A stream's samples -> its phrases: the VAD's probabilities fed to a :class:`PhraseCutter`."""

    def __init__(self, vad: SileroVad | LoudnessVad, cutter: PhraseCutter | None = None) -> None:
        self._probability: SpeechProbability | LoudnessProbability = vad.stream()
        self._cutter = cutter or PhraseCutter()
        self._pending = np.zeros(0, dtype=np.int16)

    @property
    def in_phrase(self) -> bool:
        return self._cutter.in_phrase

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """int16 samples at 16 kHz in; the phrases that closed (int16) out."""
        self._pending = np.concatenate([self._pending, samples])
        whole = len(self._pending) // WINDOW * WINDOW
        windows = [self._pending[at:at + WINDOW] for at in range(0, whole, WINDOW)]
        self._pending = self._pending[whole:]
        return self._cutter.push(windows, self._probability.push(np.concatenate(windows))) if windows else []

    def flush(self) -> np.ndarray | None:
        self._pending = np.zeros(0, dtype=np.int16)  # under a window: not speech the VAD could see
        return self._cutter.flush()

    @property
    def closed(self) -> int:
        return self._cutter.closed

    def open_phrase(self) -> np.ndarray | None:
        return self._cutter.open_phrase()


class LoudnessVad:
    """The fallback when Silero's model is missing: a window is speech when it is loud.

    Noise and music open phrases here; it only keeps voice working on an
    installation whose setup did not make the speech models.
    """

    def stream(self) -> LoudnessProbability:
        return LoudnessProbability()


class LoudnessProbability:
    """One stream: 1.0 for each whole window whose loudness is speech's, else 0.0."""

    #: RMS of int16 samples that counts as speech (speech at a normal level is ~1000-5000).
    SPEECH_RMS = 300.0

    def __init__(self) -> None:
        self._pending = np.zeros(0, dtype=np.int16)

    def push(self, samples: np.ndarray) -> list[float]:
        self._pending = np.concatenate([self._pending, samples])
        whole = len(self._pending) // WINDOW * WINDOW
        windows = self._pending[:whole].astype(np.float64).reshape(-1, WINDOW)
        self._pending = self._pending[whole:]
        return [float(rms >= self.SPEECH_RMS) for rms in np.sqrt(np.mean(windows * windows, axis=1))]
