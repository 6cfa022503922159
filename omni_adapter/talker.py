"""A Talker stage on the CPU: speak the Thinker's text while it streams.

vLLM-Omni splits a speaking model into a Thinker (text) and a Talker (audio)
stage; the engine then yields text and audio for one request. This module
gives any text engine the same boundary:

    Thinker EngineSession ──TextDelta──► PhraseSplitter ──phrase──► Talker
            │                                                         │
            └──────────── TextDelta ──────► events() ◄── AudioDelta ──┘

so the gateway relays ``AudioDelta`` the same way whether it comes from
vLLM-Omni's own Talker or from this one. Text is never held back for audio;
each phrase is spoken as soon as it is complete (the first one after a few
words), one at a time so audio stays in order, and the ``Finished`` event
waits for the last phrase. Audio leaves at the voice's own rate; the gateway
resamples each session's audio as one stream (gateway/output/audio.py).

After a hand-off the new holder speaks first what the old one wrote but did
not speak (``EngineRequest.unspoken_prefix``), so the audio says the whole answer.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import re
import shutil
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from omni_adapter.audio import OPENAI_PCM16_RATE, parse_wav, pcm16_from_waveform, retimed
from omni_adapter.port import (
    AudioDelta,
    Engine,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineSession,
    Finished,
    InputChunk,
    OutputEvent,
    TextDelta,
    Usage,
)
from omni_adapter.stage import EngineStage

logger = logging.getLogger(__name__)

#: End of a sentence: terminal punctuation (and closing quotes/brackets)
#: followed by whitespace, or a line break. The whitespace must have arrived,
#: so "3." in "3.5" is not cut while the next token is still coming.
_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
#: End of a clause: a comma, semicolon, colon or dash, followed by whitespace.
_CLAUSE_END = re.compile(r"[,;:—–]+[\"')\]]*\s+|\s[-–—]\s+")
#: Words a phrase starts with more often than not: the first phrase may end before one.
_BREAK_WORDS = frozenset({
    "and", "or", "but", "so", "because", "which", "that", "who", "where", "when", "while", "if",
    "is", "are", "was", "were", "has", "have", "had", "can", "will", "would", "should", "could",
    "in", "on", "at", "of", "for", "with", "to", "from", "by", "as", "than"})
#: The first phrase: a clause of at least this many words, else the words up to
#: a break word once there are this many, else this many words at most.
FIRST_CLAUSE_WORDS, FIRST_BREAK_WORDS, FIRST_MAX_WORDS = 2, 2, 6
#: Later phrases: a sentence, or a clause of at least this many words.
CLAUSE_WORDS = 4
#: Speak a run-on text in pieces of about this many characters, cut at a
#: space, so audio latency stays bounded without punctuation.
MAX_PHRASE_CHARS = 160


class PhraseSplitter:
    """Cuts streamed text into phrases to speak as soon as each one is complete.

    The first phrase is short (a clause, or a few words up to a natural
    break), so the first sound comes after a few tokens instead of a whole
    sentence: on this CPU a 25-token sentence is over a second of decoding.
    Later phrases are sentences, or clauses of a few words, so the next
    piece of audio is ready before the one playing ends.
    """

    def __init__(self, max_chars: int = MAX_PHRASE_CHARS) -> None:
        self._max_chars = max_chars
        self._pending = ""
        self._first = True

    def push(self, text: str) -> list[str]:
        self._pending += text
        phrases: list[str] = []
        while (cut := self._cut()) is not None:
            phrases.append(self._pending[:cut])
            self._pending = self._pending[cut:]
            self._first = False
        return _speakable(phrases)

    def flush(self) -> list[str]:
        rest, self._pending = self._pending, ""
        return _speakable([rest])

    def _cut(self) -> int | None:
        """Where the next phrase ends in the pending text, if it is complete."""
        text = self._pending
        ends = [m.end() for m in [_SENTENCE_END.search(text)] if m]
        clause_words = FIRST_CLAUSE_WORDS if self._first else CLAUSE_WORDS
        ends += [m.end() for m in _CLAUSE_END.finditer(text) if len(text[:m.start()].split()) >= clause_words][:1]
        if ends:
            return min(ends)
        if self._first:
            words = list(re.finditer(r"\S+(?=\s)", text))  # complete words: the space after them arrived
            for i, word in enumerate(words[FIRST_BREAK_WORDS:FIRST_MAX_WORDS], start=FIRST_BREAK_WORDS):
                if word.group().lower() in _BREAK_WORDS:
                    return words[i - 1].end()
            if len(words) > FIRST_MAX_WORDS:
                return words[FIRST_MAX_WORDS - 1].end()
        if len(text) > self._max_chars:
            cut = text.rfind(" ", 0, self._max_chars)
            return cut if cut > 0 else self._max_chars
        return None


def _speakable(pieces: list[str]) -> list[str]:
    """Trimmed pieces with something to say (punctuation alone is silence)."""
    return [p.strip() for p in pieces if any(c.isalnum() for c in p)]


class Talker(Protocol):
    """Turns one phrase into speech."""

    #: The rate of the pcm16 that ``speak`` returns.
    sample_rate: int

    async def speak(self, text: str, speed: float = 1.0) -> bytes:
        """``text`` spoken at ``speed`` times the voice's own pace (kept within what it says well)."""
        ...

    def close(self) -> None: ...


class TalkerError(Exception):
    """Speech synthesis failed."""


class EspeakTalker:
    """``espeak-ng`` in a subprocess per phrase: 22050 Hz pcm16 (the gateway resamples it).

    A speed scales its words a minute (``-s``, 175 at 1), within ``WORDS_PER_MINUTE``; the
    rest of a speed beyond is FFmpeg's ``atempo`` on what it said (``retimed``)."""

    sample_rate = 22_050
    #: Its own range: no slower than 80 words a minute (it raises a lower ``-s`` to it), and 450 at
    #: most (above it espeak-ng squeezes the audio afterwards; at 525 the recognizer lost most words).
    WORDS_PER_MINUTE = (80, 450)

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

    def words_per_minute(self, speed: float) -> int:
        low, high = self.WORDS_PER_MINUTE
        return min(high, max(low, round(self._words_per_minute * speed)))

    async def speak(self, text: str, speed: float = 1.0) -> bytes:
        # The text goes in on stdin, never as an argument, so it cannot be
        # read as an option.
        process = await asyncio.create_subprocess_exec(
            self._executable, "--stdout", "-v", self._voice, "-s", str(self.words_per_minute(speed)),
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
        if rate != self.sample_rate:
            raise TalkerError(f"espeak-ng wrote {rate} Hz audio, not {self.sample_rate}")
        beyond = self._words_per_minute * speed / self.words_per_minute(speed)  # the rest of the speed
        return pcm if abs(beyond - 1) < 0.01 else await asyncio.to_thread(retimed, pcm, rate, beyond)

    def close(self) -> None:
        return None


#: hibari pads every phrase with ~0.3 s of silence before the voice (and ~0.35 s
#: after it): 0.3 s more before the first sound of an answer, and a 0.6 s hole
#: between phrases. Kept before the voice: a short lead in. The pause after it
#: stays: it is the time the next phrase has to arrive before a player runs dry
#: (a first phrase is two words or so).
LEAD_SEC = 0.03
#: Quieter than this (about -50 dBFS) is silence.
SILENCE_LEVEL = 0.003


def without_lead_in(audio: np.ndarray, rate: int, lead_sec: float = LEAD_SEC) -> np.ndarray:
    """``audio`` with at most ``lead_sec`` of silence before the voice."""
    voiced = np.flatnonzero(np.abs(audio) > SILENCE_LEVEL)
    return audio[max(0, int(voiced[0]) - int(lead_sec * rate)):] if voiced.size else audio


class HibariTalker:
    """hibari-tts: a neural English voice (distilled from Kokoro-82M, ONNX,
    inside its wheel), 24 kHz float audio, about 25x realtime on a busy CPU.

    Synthesis is CPU work, so it runs on a thread of its own, one phrase at a
    time per process: two at once would only split the same cores, and the
    default thread pool stays free for the rest of the gateway.
    """

    sample_rate = OPENAI_PCM16_RATE
    #: The voice inside the wheel; the others would be downloaded from a hub.
    VOICE = "heart"
    #: The speeds it says right by itself; beyond them FFmpeg's ``atempo`` does the rest. Measured on
    #: tests/wer.py's sentences through the recognizer (length against speed 1; words misheard):
    #: hibari slows exactly (0.5: 2.0x, 1%) but speeds up less than asked (1.25: 0.87x, 1.3: 0.85x)
    #: and from 1.35 drops short consonants ("please" heard "lee"; 10-20% of words up to 1.5, 26% at
    #: 2); below 0.5 words go unheard (0.25: 28%). atempo on its speed 1: 1.25 is 0.79x (0%), 1.5
    #: 0.66x (2%), 2 0.50x (13%).
    SPEEDS = (0.5, 1.0)

    def __init__(self, tts: Any) -> None:
        if tts.sample_rate != self.sample_rate:
            raise ValueError(f"hibari speaks at {tts.sample_rate} Hz, not {self.sample_rate}")
        self._tts = tts
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="talker")

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

    async def speak(self, text: str, speed: float = 1.0) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._synthesize, text, speed)

    def voice(self, text: str, speed: float = 1.0) -> np.ndarray:
        """hibari's waveform for ``text`` as it makes it (with its padding of silence), at ``speed``
        within ``SPEEDS`` (hibari's own: its phonemes' lengths divided by it)."""
        low, high = self.SPEEDS
        try:  # seeded: the same text always sounds the same
            return np.asarray(self._tts(text, speed=min(high, max(low, speed)), seed=0))
        except Exception as exc:
            raise TalkerError(f"hibari could not speak {text[:40]!r}: {exc}") from exc

    def _synthesize(self, text: str, speed: float = 1.0) -> bytes:
        """At ``speed``: hibari's own pace within ``SPEEDS``, and FFmpeg's ``atempo`` (pitch kept) for
        the rest of a speed beyond them (1.5 is hibari at 1, 1.5x as fast; 0.25 hibari at 0.5, halved)."""
        low, high = self.SPEEDS
        own = min(high, max(low, speed))
        pcm = pcm16_from_waveform(without_lead_in(self.voice(text, own), self.sample_rate))
        return retimed(pcm, self.sample_rate, speed / own)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class TalkingSession:
    """A Thinker session whose text is also spoken; see the module docstring."""

    def __init__(self, thinker: EngineSession, talker: Talker, unspoken_prefix: str = "",
                 spoken_chars: int = 0, speed: float = 1.0) -> None:
        self._thinker = thinker
        self._talker = talker
        self._speed = speed
        self._unspoken_prefix = unspoken_prefix
        #: The answer's first characters, spoken by an earlier holder: not spoken again.
        self._spoken_chars = spoken_chars
        self._out: asyncio.Queue[OutputEvent] = asyncio.Queue()
        self._phrases: asyncio.Queue[str | None] = asyncio.Queue()
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
        """Pass text on at once; hand complete phrases to the speaker."""
        try:
            await self._relay_thinker(speaker)
        except Exception as exc:
            logger.exception("the thinker failed")
            self._out.put_nowait(EngineError(f"the engine failed: {type(exc).__name__}"))

    async def _relay_thinker(self, speaker: asyncio.Task[None]) -> None:
        splitter = PhraseSplitter()
        for phrase in splitter.push(self._unspoken_prefix):  # after a hand-off: spoken first
            self._phrases.put_nowait(phrase)
        skip = self._spoken_chars
        async for event in self._thinker.events():
            if isinstance(event, TextDelta):
                self._out.put_nowait(event)
                unsaid, skip = event.text[skip:], max(0, skip - len(event.text))
                for phrase in splitter.push(unsaid):
                    self._phrases.put_nowait(phrase)
            elif isinstance(event, Finished):
                if event.finish_reason != "abort":
                    for phrase in splitter.flush():
                        self._phrases.put_nowait(phrase)
                    self._phrases.put_nowait(None)
                    # The answer is finished once its last phrase is spoken.
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
        while (phrase := await self._phrases.get()) is not None:
            try:
                pcm = await self._talker.speak(phrase, self._speed)
            except Exception as exc:
                logger.warning("speech synthesis failed: %s", exc)
                self._out.put_nowait(EngineError(f"speech synthesis failed: {exc}"))
                raise
            self._out.put_nowait(AudioDelta(pcm, self._talker.sample_rate, transcript=phrase))


class SaysInput:
    """The Thinker's place in a text-to-speech session (``EngineRequest.speak_input``): the
    answer is the input text, passed on as it arrives, so the Talker speaks each phrase of it
    once it is complete, while the rest streams in. After a hand-off, the answer so far
    (``skip`` characters, published already) is not said again."""

    def __init__(self, skip: int = 0) -> None:
        self._out: asyncio.Queue[OutputEvent] = asyncio.Queue()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        for chunk in chunks:
            if chunk.modality != "text":
                raise EngineRejectedError(f"text to speech takes text, not {chunk.modality}")
            self._say(self._decoder.decode(chunk.data))

    async def end_input(self) -> None:
        self._say(self._decoder.decode(b"", final=True))
        self._out.put_nowait(Finished("stop", Usage(0, 0)))  # no model made a token

    async def events(self) -> AsyncIterator[OutputEvent]:
        while True:
            event = await self._out.get()
            yield event
            if isinstance(event, Finished):
                return

    async def abort(self) -> None:
        self._out.put_nowait(Finished("abort", Usage(0, 0)))

    def _say(self, text: str) -> None:
        text, self._skip = text[self._skip:], max(0, self._skip - len(text))
        if text:
            self._out.put_nowait(TextDelta(text))


class TalkingEngine(EngineStage):
    """A text engine plus a Talker: ``audio`` output for the sessions that ask, and text to
    speech (``speak_input``)."""

    def __init__(self, thinker: Engine, talker: Talker) -> None:
        caps = thinker.capabilities
        super().__init__(thinker, replace(caps, output_modalities=caps.output_modalities | {"audio"}, speech=True,
                                          speech_speed=True))
        self._talker = talker

    def open_session(self, request: EngineRequest) -> EngineSession:
        if request.speak_input:
            if request.model not in self.capabilities.model_names:
                raise EngineRejectedError(f"model {request.model!r} is not served by this engine")
            return TalkingSession(SaysInput(len(request.assistant_prefix)), self._talker, request.unspoken_prefix,
                                  request.spoken_chars, request.speech_speed)
        if "audio" not in request.output_modalities:
            return self._thinker.open_session(request)
        text_only = replace(request, output_modalities=("text",), speech_speed=1.0)
        return TalkingSession(self._thinker.open_session(text_only), self._talker, request.unspoken_prefix,
                              request.spoken_chars, request.speech_speed)

    async def aclose(self) -> None:
        self._talker.close()
        await super().aclose()

    def check_request(self, request: EngineRequest) -> int:
        # The Thinker answers in text; speaking it is this stage's part.
        text_only = replace(request, output_modalities=("text",))
        return int(self._thinker.check_request(text_only))  # type: ignore[attr-defined]


def with_talker(engine: Engine) -> Engine:
    """The engine with a CPU Talker: hibari's neural voice, else ``espeak-ng``, else none;
    an engine that speaks itself (vLLM-Omni) as it is."""
    if "audio" in engine.capabilities.output_modalities:
        return engine
    talker: Talker | None = HibariTalker.load()
    if talker is None:
        logger.warning("hibari-tts is not installed: speaking with espeak-ng, if installed")
        talker = EspeakTalker.find()
    if talker is None:
        logger.warning("no Talker (hibari-tts or espeak-ng): audio output is off")
        return engine
    return TalkingEngine(engine, talker)
