"""A Listener stage on the CPU: hear spoken input while it streams.

The embedded default is a text model. This module gives it speech input the
way vLLM-Omni's audio encoder does for an omni model, but as text: each audio
chunk is recognized as it arrives (pocketsphinx, models inside its wheel),
and the words the recognizer has *settled* go into the Thinker session as
text right away, so a spoken question is prefilled while it is spoken:

    audio chunk ──► pcm16 16 kHz ──► Recognizer (worker thread) ──► settled words
    text chunk  ───────────────────────────────────────────────┐        │
                                                               ▼        ▼
                                                 Thinker EngineSession.feed(text)

A word is settled once it is not among the last two words of the partial
hypothesis and has kept its place there for two updates in a row (the
recognizer still revises the tail), or when the utterance ends: at a text
chunk, or at the end of input. Words once fed cannot be taken back, so the
final hypothesis only adds the words after them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from omni_adapter.audio import pcm16_of, resample
from omni_adapter.port import (
    Engine,
    EngineRejectedError,
    EngineRequest,
    EngineSession,
    InputChunk,
    InputTranscript,
    OutputEvent,
)
from omni_adapter.stage import EngineStage

logger = logging.getLogger(__name__)

#: The recognizer's rate (its acoustic model's).
LISTEN_RATE = 16_000
#: The trailing words of a partial hypothesis that are never settled yet.
UNSETTLED_TAIL = 2
#: Updates a word must keep its place for before it is settled.
STABLE_UPDATES = 2
#: Samples are decoded in slices of this many bytes (100 ms): pocketsphinx
#: holds the GIL while it decodes, so the event loop gets a turn between slices.
DECODE_SLICE_BYTES = LISTEN_RATE // 10 * 2
#: Slices quieter than this (RMS of int16 samples, about -54 dBFS) are not
#: decoded: decoding silence costs as much CPU as speech (ten minutes of it
#: took over a minute), and it has nothing to recognize.
SILENCE_RMS = 64.0


class Recognizer:
    """One utterance stream of pocketsphinx: pcm16 at 16 kHz in, settled words out.

    Not thread-safe; a session calls it from one worker thread at a time.
    """

    def __init__(self, decoder: Any) -> None:
        self._decoder = decoder
        self._in_utterance = False
        self._settled: list[str] = []
        self._history: list[list[str]] = []
        #: Every word recognized so far, all utterances.
        self.transcript: list[str] = []

    def hear(self, pcm16: bytes) -> list[str]:
        """Process samples; return the words that became settled."""
        if not self._in_utterance:
            self._decoder.start_utt()
            self._in_utterance, self._settled, self._history = True, [], []
        for at in range(0, len(pcm16), DECODE_SLICE_BYTES):
            piece = pcm16[at:at + DECODE_SLICE_BYTES]
            if _rms(piece) < SILENCE_RMS:
                continue
            self._decoder.process_raw(piece, False, False)
            time.sleep(0)  # let another thread (the event loop) take the GIL
        hypothesis = self._decoder.hyp()
        words = hypothesis.hypstr.split() if hypothesis is not None else []
        self._history = [*self._history, words][-STABLE_UPDATES:]
        candidates = words[:max(0, len(words) - UNSETTLED_TAIL)]
        if len(self._history) < STABLE_UPDATES or candidates[:len(self._settled)] != self._settled:
            return []
        settled = len(self._settled)
        while settled < len(candidates) and all(
                len(h) > settled and h[settled] == candidates[settled] for h in self._history):
            settled += 1
        return self._settle(candidates[len(self._settled):settled])

    def end_utterance(self) -> list[str]:
        """End the utterance; return the words not settled before."""
        if not self._in_utterance:
            return []
        self._decoder.end_utt()
        self._in_utterance = False
        hypothesis = self._decoder.hyp()
        words = hypothesis.hypstr.split() if hypothesis is not None else []
        # Words already fed stay; the final hypothesis only adds what follows them.
        return self._settle(words[len(self._settled):])

    def _settle(self, words: list[str]) -> list[str]:
        self._settled += words
        self.transcript += words
        return words


def _rms(pcm16: bytes) -> float:
    samples = np.frombuffer(pcm16[:len(pcm16) // 2 * 2], dtype="<i2").astype(np.float32)
    return float(np.sqrt(np.mean(samples * samples))) if samples.size else 0.0


class RecognizerPool:
    """pocketsphinx decoders, made once and lent to one session at a time.

    Loading the models takes about 0.3 s and a few tens of MB, so sessions
    borrow a decoder for their lifetime instead of each loading its own.
    """

    def __init__(self, ready: int = 0) -> None:
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        # Made up front (at engine start): loading holds the GIL for ~0.3 s,
        # which would stall the event loop if the first sessions paid it.
        self._idle = [self._load() for _ in range(ready)]

    @staticmethod
    def _load() -> Any:
        from pocketsphinx import Decoder

        return Decoder(samprate=LISTEN_RATE, loglevel="FATAL")

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._load()

    def give_back(self, decoder: Any) -> None:
        with self._lock:
            self._idle.append(decoder)

    @staticmethod
    def available() -> bool:
        try:
            import pocketsphinx  # noqa: F401
        except ImportError:
            return False
        return True


class ListeningSession:
    """A Thinker session that also takes spoken input; see the module docstring."""

    def __init__(self, thinker: EngineSession, pool: RecognizerPool) -> None:
        self._thinker = thinker
        self._pool = pool
        self._decoder: Any = None
        self._recognizer: Recognizer | None = None
        self._text_so_far = ""
        self._heard_audio = False
        #: Set when words were settled: ``events`` tells the transcript so far.
        self._heard_words = asyncio.Event()
        #: One decoder call at a time: an abort (the runner's feed was cancelled,
        #: its worker thread still decoding) must not end the utterance or hand
        #: the decoder to another session under a running decode (a segfault).
        self._decoding = threading.Lock()

    @property
    def input_transcript(self) -> str:
        return " ".join(self._recognizer.transcript) if self._recognizer else ""

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        texts: list[InputChunk] = []
        for chunk in chunks:
            if chunk.modality == "audio":
                words = await asyncio.to_thread(self._hear, chunk)
            elif chunk.modality == "text":
                words = await asyncio.to_thread(self._end_utterance)
            else:
                raise EngineRejectedError(f"this engine does not take {chunk.modality} input")
            if words:
                texts.append(self._as_text(chunk.sequence_id, " ".join(words)))
                self._heard_words.set()
            if chunk.modality == "text":
                texts.append(chunk)
                self._text_so_far += chunk.data.decode("utf-8", errors="replace")
        if texts:
            await self._thinker.feed(texts)

    async def end_input(self) -> None:
        words = await asyncio.to_thread(self._end_utterance)
        if words:
            await self._thinker.feed([self._as_text(-1, " ".join(words))])
        await asyncio.to_thread(self._give_back)
        if self._heard_audio and not self._text_so_far.strip():
            raise EngineRejectedError("no speech was recognized in the audio input")
        await self._thinker.end_input()

    async def events(self) -> AsyncIterator[OutputEvent]:
        """The transcript each time it grows while the input arrives, then the answer.

        The answer begins after the end of input, when the transcript is
        final, so the full transcript always comes before the answer.
        """
        answer = aiter(self._thinker.events())
        first = asyncio.ensure_future(anext(answer, None))
        told = ""
        try:
            while not first.done():
                heard = asyncio.ensure_future(self._heard_words.wait())
                await asyncio.wait({first, heard}, return_when=asyncio.FIRST_COMPLETED)
                heard.cancel()
                self._heard_words.clear()
                if self.input_transcript != told and not first.done():
                    told = self.input_transcript
                    yield InputTranscript(told)
        finally:
            first.cancel()  # a no-op once it is done; the caller stopped reading otherwise
        if self._heard_audio and self.input_transcript != told:
            yield InputTranscript(self.input_transcript)
        event = first.result()
        if event is None:
            return
        yield event
        async for event in answer:
            yield event

    async def abort(self) -> None:
        await asyncio.to_thread(self._give_back)  # waits for a decode in flight, off the loop
        await self._thinker.abort()

    # -- internals (worker thread) ----------------------------------------------------

    def _hear(self, chunk: InputChunk) -> list[str]:
        pcm, rate = pcm16_of(chunk)
        if rate <= 0:
            raise EngineRejectedError("audio needs a sample rate above 0")
        samples = resample(pcm, rate, LISTEN_RATE)
        with self._decoding:
            if self._recognizer is None:
                self._decoder = self._pool.take()
                self._recognizer = Recognizer(self._decoder)
            self._heard_audio = True
            return self._recognizer.hear(samples)

    def _end_utterance(self) -> list[str]:
        with self._decoding:
            return self._recognizer.end_utterance() if self._recognizer else []

    def _as_text(self, sequence_id: int, words: str) -> InputChunk:
        # Words join what came before with a space, as they were spoken.
        text = words if not self._text_so_far or self._text_so_far[-1].isspace() else " " + words
        self._text_so_far += text
        return InputChunk(sequence_id, "text", text.encode())

    def _give_back(self) -> None:
        with self._decoding:
            self._give_back_now()

    def _give_back_now(self) -> None:
        if self._decoder is not None:
            if self._recognizer is not None and self._recognizer._in_utterance:
                self._decoder.end_utt()
            self._pool.give_back(self._decoder)
            self._decoder = None


class ListeningEngine(EngineStage):
    """A text engine plus a Listener: ``audio`` input for every session."""

    def __init__(self, thinker: Engine, pool: RecognizerPool) -> None:
        caps = thinker.capabilities
        super().__init__(thinker, replace(caps, input_modalities=caps.input_modalities | {"audio"}))
        self._pool = pool

    def open_session(self, request: EngineRequest) -> EngineSession:
        return ListeningSession(self._thinker.open_session(request), self._pool)


def with_listener(engine: Engine) -> Engine:
    """The engine with a CPU Listener when pocketsphinx is installed; as it is otherwise."""
    if "audio" in engine.capabilities.input_modalities:
        return engine
    if not RecognizerPool.available():
        logger.warning("pocketsphinx is not installed: audio input is off")
        return engine
    return ListeningEngine(engine, RecognizerPool(ready=2))
