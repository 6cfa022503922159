"""A Talker stage on the CPU: speak the Thinker's text while it streams.

vLLM-Omni splits a speaking model into a Thinker (text) and a Talker (audio)
stage; the engine then yields text and audio for one request. This module
gives any text engine the same boundary:

    Thinker EngineSession ──TextDelta──► SentenceSplitter ──sentence──► Talker
            │                                                             │
            └──────────── TextDelta ──────► events() ◄──── AudioDelta ────┘

so the gateway relays ``AudioDelta`` the same way whether it comes from
vLLM-Omni's own Talker or from this one. Text is never held back for audio;
each sentence is spoken as soon as it is complete, one at a time so audio
stays in order, and the ``Finished`` event waits for the last sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from omni_adapter.audio import OPENAI_PCM16_RATE, parse_wav, resample
from omni_adapter.port import (
    AudioDelta,
    Engine,
    EngineError,
    EngineRequest,
    EngineSession,
    Finished,
    InputChunk,
    OutputEvent,
    TextDelta,
)
from omni_adapter.stage import EngineStage

logger = logging.getLogger(__name__)

#: End of a sentence: terminal punctuation (and closing quotes/brackets)
#: followed by whitespace, or a line break. The whitespace must have arrived,
#: so "3." in "3.5" is not cut while the next token is still coming.
_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
#: Speak a run-on text in pieces of about this many characters, cut at a
#: space, so audio latency stays bounded without punctuation.
MAX_SENTENCE_CHARS = 200


class SentenceSplitter:
    """Cuts streamed text into sentences as soon as each one is complete."""

    def __init__(self, max_chars: int = MAX_SENTENCE_CHARS) -> None:
        self._max_chars = max_chars
        self._pending = ""

    def push(self, text: str) -> list[str]:
        self._pending += text
        sentences: list[str] = []
        while match := _SENTENCE_END.search(self._pending):
            sentences.append(self._pending[:match.end()])
            self._pending = self._pending[match.end():]
        while len(self._pending) > self._max_chars:
            cut = self._pending.rfind(" ", 0, self._max_chars)
            cut = cut if cut > 0 else self._max_chars
            sentences.append(self._pending[:cut])
            self._pending = self._pending[cut:]
        return _speakable(sentences)

    def flush(self) -> list[str]:
        rest, self._pending = self._pending, ""
        return _speakable([rest])


def _speakable(pieces: list[str]) -> list[str]:
    """Trimmed pieces with something to say (punctuation alone is silence)."""
    return [p.strip() for p in pieces if any(c.isalnum() for c in p)]


class Talker(Protocol):
    """Turns one sentence into speech."""

    #: The rate of the pcm16 that ``speak`` returns.
    sample_rate: int

    async def speak(self, text: str) -> bytes: ...


class TalkerError(Exception):
    """Speech synthesis failed."""


class EspeakTalker:
    """``espeak-ng`` in a subprocess per sentence, resampled to 24 kHz pcm16.

    espeak-ng writes 22050 Hz wav; OpenAI clients play ``pcm16`` at 24 kHz,
    so the audio is resampled here, once, instead of in every client.
    """

    sample_rate = OPENAI_PCM16_RATE

    def __init__(self, executable: str, voice: str = "en-us", words_per_minute: int = 175,
                 timeout_sec: float = 30.0) -> None:
        self._executable = executable
        self._voice = voice
        self._words_per_minute = words_per_minute
        self._timeout_sec = timeout_sec

    @classmethod
    def find(cls) -> EspeakTalker | None:
        """The talker, or ``None`` when ``espeak-ng`` is not installed."""
        executable = shutil.which("espeak-ng")
        return cls(executable) if executable else None

    async def speak(self, text: str) -> bytes:
        # The text goes in on stdin, never as an argument, so it cannot be
        # read as an option.
        process = await asyncio.create_subprocess_exec(
            self._executable, "--stdout", "-v", self._voice, "-s", str(self._words_per_minute),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            wav, err = await asyncio.wait_for(process.communicate(text.encode()), self._timeout_sec)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        if process.returncode != 0:
            raise TalkerError(f"espeak-ng exited with {process.returncode}: {err.decode(errors='replace')}")
        try:
            pcm, rate = parse_wav(wav)
        except ValueError as exc:
            raise TalkerError(f"espeak-ng wrote no usable wav: {exc}") from exc
        return resample(pcm, rate, self.sample_rate)


class HibariTalker:
    """hibari-tts: a neural English voice (distilled from Kokoro-82M, ONNX,
    inside its wheel), 24 kHz float audio, about 25x realtime on a busy CPU.

    Synthesis is CPU work, so it runs in a worker thread; one sentence at a
    time per process (a lock), because two would only split the same cores.
    """

    sample_rate = OPENAI_PCM16_RATE
    #: The voice inside the wheel; the others would be downloaded from a hub.
    VOICE = "heart"

    def __init__(self, tts: Any) -> None:
        if tts.sample_rate != self.sample_rate:
            raise ValueError(f"hibari speaks at {tts.sample_rate} Hz, not {self.sample_rate}")
        self._tts = tts
        self._lock = threading.Lock()

    @classmethod
    def load(cls) -> HibariTalker | None:
        """The talker, or ``None`` when hibari-tts is not installed."""
        try:
            from hibari import Hibari
        except ImportError:
            return None
        talker = cls(Hibari(voice=cls.VOICE, threads=1))
        talker._synthesize("Ready.")  # loads the pronunciation rules now, not in the first answer
        return talker

    async def speak(self, text: str) -> bytes:
        return await asyncio.to_thread(self._synthesize, text)

    def _synthesize(self, text: str) -> bytes:
        with self._lock:
            try:
                audio = self._tts(text, seed=0)  # seeded: the same text always sounds the same
            except Exception as exc:
                raise TalkerError(f"hibari could not speak {text[:40]!r}: {exc}") from exc
        return bytes((np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes())


class TalkingSession:
    """A Thinker session whose text is also spoken; see the module docstring."""

    def __init__(self, thinker: EngineSession, talker: Talker) -> None:
        self._thinker = thinker
        self._talker = talker
        self._out: asyncio.Queue[OutputEvent] = asyncio.Queue()
        self._sentences: asyncio.Queue[str | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        await self._thinker.feed(chunks)

    async def end_input(self) -> None:
        await self._thinker.end_input()

    async def abort(self) -> None:
        await self._thinker.abort()
        if self._tasks:
            self._tasks[0].cancel()  # the speaker: no audio after an abort

    async def events(self) -> AsyncIterator[OutputEvent]:
        speaker = asyncio.create_task(self._speak())
        self._tasks = [speaker, asyncio.create_task(self._think(speaker))]
        try:
            while True:
                event = await self._out.get()
                yield event
                if isinstance(event, Finished | EngineError):
                    return
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _think(self, speaker: asyncio.Task[None]) -> None:
        """Pass text on at once; hand complete sentences to the speaker."""
        try:
            await self._relay_thinker(speaker)
        except Exception as exc:
            logger.exception("the thinker failed")
            self._out.put_nowait(EngineError(f"the engine failed: {type(exc).__name__}"))

    async def _relay_thinker(self, speaker: asyncio.Task[None]) -> None:
        splitter = SentenceSplitter()
        async for event in self._thinker.events():
            if isinstance(event, TextDelta):
                self._out.put_nowait(event)
                for sentence in splitter.push(event.text):
                    self._sentences.put_nowait(sentence)
            elif isinstance(event, Finished):
                if event.finish_reason != "abort":
                    for sentence in splitter.flush():
                        self._sentences.put_nowait(sentence)
                    self._sentences.put_nowait(None)
                    # The answer is finished once its last sentence is spoken.
                    await asyncio.wait([speaker])
                    if speaker.cancelled():
                        event = Finished("abort", event.usage)
                    elif speaker.exception() is not None:
                        return  # the speaker has reported its error
                self._out.put_nowait(event)
                return
            elif isinstance(event, EngineError):
                self._out.put_nowait(event)
                return
            else:  # what the Thinker says besides text (the input transcript) passes on
                self._out.put_nowait(event)
        self._out.put_nowait(EngineError("the engine ended the answer without a result"))

    async def _speak(self) -> None:
        while (sentence := await self._sentences.get()) is not None:
            try:
                pcm = await self._talker.speak(sentence)
            except Exception as exc:
                logger.warning("speech synthesis failed: %s", exc)
                self._out.put_nowait(EngineError(f"speech synthesis failed: {exc}"))
                raise
            self._out.put_nowait(AudioDelta(pcm, self._talker.sample_rate, transcript=sentence))


class TalkingEngine(EngineStage):
    """A text engine plus a Talker: ``audio`` output for the sessions that ask."""

    def __init__(self, thinker: Engine, talker: Talker) -> None:
        caps = thinker.capabilities
        super().__init__(thinker, replace(caps, output_modalities=caps.output_modalities | {"audio"}))
        self._talker = talker

    def open_session(self, request: EngineRequest) -> EngineSession:
        if "audio" not in request.output_modalities:
            return self._thinker.open_session(request)
        text_only = replace(request, output_modalities=("text",))
        return TalkingSession(self._thinker.open_session(text_only), self._talker)

    def check_request(self, request: EngineRequest) -> int:
        # The Thinker answers in text; speaking it is this stage's part.
        text_only = replace(request, output_modalities=("text",))
        return int(self._thinker.check_request(text_only))  # type: ignore[attr-defined]


def with_talker(engine: Engine) -> Engine:
    """The engine with a CPU Talker: hibari's neural voice, else ``espeak-ng``, else none."""
    talker: Talker | None = HibariTalker.load()
    if talker is None:
        logger.warning("hibari-tts is not installed: speaking with espeak-ng, if installed")
        talker = EspeakTalker.find()
    if talker is None:
        logger.warning("no Talker (hibari-tts or espeak-ng): audio output is off")
        return engine
    return TalkingEngine(engine, talker)
