"""A Listener stage on the CPU: hear spoken input while it streams.

The embedded default is a text model. This module gives it speech input the
way vLLM-Omni's audio encoder does for an omni model, but as text: the audio
of each chunk is resampled to 16 kHz (one stateful resampler per session),
cut into phrases at pauses by a voice-activity detector (Silero VAD), and
each phrase is recognized as soon as it ends (Moonshine, not a streaming
model); its words go into the Thinker session as text right away, so a long
spoken question is prefilled phrase by phrase while it is spoken:

    audio chunk ─► 16 kHz (soxr stream) ─► VAD ─► phrase at a pause ─► recognizer ─► words
    text chunk  ───────────────────────────── (ends the open phrase first) ──────────┐   │
                                                                                     ▼   ▼
                                                              Thinker EngineSession.feed(text)

A typed text chunk, and the end of input, end the phrase still open, so the
words keep the order they were said and typed in. While a phrase is open, an idle
Listener guesses at it in the background; the guess's tokens are the draft
its closing recognition checks in one pass (``DraftingRecognizer``). All of it runs on the
Listener's own small thread pool, never the default one; onnxruntime
releases the GIL while its models run, so the event loop keeps its turns.

What was heard is told as it grows (``InputTranscript``) with the pieces fed
and how far the audio is heard, so a new holder of the session (a resume
after parking, a takeover) feeds those pieces again instead of hearing all
the audio again (``EngineRequest.heard``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from omni_adapter.audio import StreamResampler, pcm16_of
from omni_adapter.port import (
    Engine,
    EngineRejectedError,
    EngineRequest,
    EngineSession,
    Finished,
    HeardInput,
    InputChunk,
    InputTranscript,
    OutputEvent,
    Usage,
)
from omni_adapter.stage import EngineStage
from omni_adapter.vad import LoudnessVad, PhraseStream, SileroVad

logger = logging.getLogger(__name__)

#: The recognizers' rate (their models').
LISTEN_RATE = 16_000
#: Threads that resample, detect speech and recognize for every session of the
#: process: one per core of this machine; more would only split the same cores.
LISTENER_THREADS = 2

RecognizerName = Literal["moonshine", "pocketsphinx"]


class Recognizer(Protocol):
    """Speech to text, one phrase at a time (thread-safe)."""

    def transcribe(self, samples: np.ndarray) -> str:
        """The words of one phrase: int16 samples at 16 kHz."""
        ...


#: A recognizer's own tokens for a phrase (opaque to the Listener).
Draft = tuple[int, ...]


@runtime_checkable
class DraftingRecognizer(Recognizer, Protocol):
    """A recognizer that finishes a phrase sooner given a draft: what a guess at its start said."""

    def recognize(self, samples: np.ndarray, draft: Draft = ()) -> tuple[str, Draft]:
        """The words of one phrase and their draft for a longer recognition of the same phrase."""
        ...


class MoonshineRecognizer:
    """Moonshine base-en (``omni_adapter/moonshine.py``): 0 % WER on our clean clips."""

    def __init__(self, model: Any) -> None:
        self._model = model

    @classmethod
    def load(cls) -> MoonshineRecognizer | None:
        from omni_adapter.speech_models import cached_speech_models

        models = cached_speech_models()
        return cls(_moonshine(models.moonshine)) if models is not None else None

    def transcribe(self, samples: np.ndarray) -> str:
        return self.recognize(samples)[0]

    def recognize(self, samples: np.ndarray, draft: Draft = ()) -> tuple[str, Draft]:
        text, ids = self._model.recognize(samples.astype(np.float32) / 32768.0, draft)
        return str(text), tuple(ids)


@functools.cache
def _moonshine(folder: Path) -> Any:
    """One Moonshine per process, however many engines are wrapped in a Listener
    (a test process wraps many): its weights are ~300 MB, read-only, and
    onnxruntime sessions are thread-safe."""
    from omni_adapter.moonshine import Moonshine

    return Moonshine(folder)


class PocketsphinxRecognizer:
    """pocketsphinx's US English model, in a process of its own.

    It takes ~30 MB where Moonshine takes ~350 MB, but it misheard a fifth of
    the words of our noisy clips, and it holds the GIL for all of a decode (a
    5 s phrase stalled the event loop 1.8 s, bench/README.md): in the
    gateway's process it would starve every other session. So its decoder
    lives in one worker process; the Listener's threads (two) bound the
    phrases waiting for it.
    """

    def __init__(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        import pocketsphinx  # noqa: F401  (fails here, not in the worker, when it is missing)

        self._worker = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_load_pocketsphinx)
        self._worker.submit(_decode_with_pocketsphinx, b"").result()  # loaded now, not in the first phrase

    @classmethod
    def load(cls) -> PocketsphinxRecognizer | None:
        try:
            return cls()
        except ImportError:
            return None

    def transcribe(self, samples: np.ndarray) -> str:
        return str(self._worker.submit(_decode_with_pocketsphinx, samples.astype("<i2").tobytes()).result())

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


#: The worker process's decoder (pocketsphinx's worker only).
_decoder: Any = None


def _load_pocketsphinx() -> None:
    global _decoder
    from pocketsphinx import Decoder

    _decoder = Decoder(samprate=LISTEN_RATE, loglevel="FATAL")


def _decode_with_pocketsphinx(pcm16: bytes) -> str:
    if not pcm16:
        return ""
    _decoder.start_utt()
    _decoder.process_raw(pcm16, False, True)
    _decoder.end_utt()
    hypothesis = _decoder.hyp()
    return hypothesis.hypstr if hypothesis is not None else ""


class Hearing:
    """What every listening session of the process shares: the recognizer, the VAD, the threads."""

    def __init__(self, recognizer: Recognizer, vad: SileroVad | LoudnessVad,
                 threads: int = LISTENER_THREADS) -> None:
        self.recognizer = recognizer
        self.vad = vad
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="listener")
        #: Jobs on the threads now (counted on the event loop): guesses run only when there are none.
        self.busy = 0
        #: The sessions hearing audio now (input not ended): guesses run only while there is one.
        self.speaking: weakref.WeakSet[ListeningSession] = weakref.WeakSet()

    @classmethod
    def load(cls, name: RecognizerName = "moonshine") -> Hearing | None:
        """The recognizer asked for (else the other one), Silero VAD (else loudness); ``None`` when
        no recognizer is installed."""
        loaders = {"moonshine": MoonshineRecognizer.load, "pocketsphinx": PocketsphinxRecognizer.load}
        order = [name, *(other for other in loaders if other != name)]
        recognizer: Recognizer | None = None
        for candidate in order:
            recognizer = loaders[candidate]()
            if recognizer is not None:
                if candidate != name:
                    logger.warning("the %s recognizer is not available: hearing with %s", name, candidate)
                break
        if recognizer is None:
            return None
        vad: SileroVad | LoudnessVad | None = SileroVad.load()
        if vad is None:
            logger.warning("Silero VAD's model is not cached (scripts/setup.sh): phrases are cut by loudness")
            vad = LoudnessVad()
        return cls(recognizer, vad)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.recognizer, PocketsphinxRecognizer):
            self.recognizer.close()


class ListeningSession:
    """A Thinker session that also takes spoken input; see the module docstring."""

    def __init__(self, thinker: EngineSession, hearing: Hearing, heard: HeardInput | None = None) -> None:
        heard = heard or HeardInput()
        self._thinker = thinker
        #: Only hearing (a transcription): no speech in the audio is an empty transcript, not an error.
        self._answers = not isinstance(thinker, NoAnswer)
        self._hearing = hearing
        self._resampler = StreamResampler(LISTEN_RATE)
        self._phrases = PhraseStream(hearing.vad)
        self._text_so_far = ""
        self._heard_audio = False
        #: What an earlier holder heard: fed again as it was, without hearing that audio.
        self._replay: dict[int, list[str]] = defaultdict(list)
        for sequence_id, text in heard.pieces:
            self._replay[sequence_id].append(text)
        self._replay_through = heard.through
        self._pieces: list[str] = [text for _, text in heard.pieces]
        self._untold: list[tuple[int, str]] = []
        self._through = heard.through
        self._last_sequence_id = -1
        #: Set when words were settled: ``events`` tells the transcript so far.
        self._heard_words = asyncio.Event()
        #: The open phrase's number and what the latest guess at it said.
        self._draft: tuple[int, Draft] = (-1, ())
        self._guessing = False
        self._guess: asyncio.Future[None] | None = None

    @property
    def input_transcript(self) -> str:
        return " ".join(self._pieces)

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        texts: list[InputChunk] = []
        for chunk in chunks:
            if chunk.modality not in ("audio", "text"):
                raise EngineRejectedError(f"this engine does not take {chunk.modality} input")
            self._last_sequence_id = chunk.sequence_id
            if chunk.sequence_id <= self._replay_through:
                words = " ".join(self._replay.pop(chunk.sequence_id, []))
                self._heard_audio |= chunk.modality == "audio"
            elif chunk.modality == "audio":
                self._hearing.speaking.add(self)
                words, so_far = await self._in_thread(self._hear, chunk)
                self._settle(chunk.sequence_id, words)
                self._maybe_guess(so_far)
            else:
                words = await self._end_phrase_off_the_loop()
                self._settle(chunk.sequence_id, words)
            if words:
                texts.append(self._as_text(chunk.sequence_id, words))
            if chunk.modality == "text":
                texts.append(chunk)
                self._text_so_far += chunk.data.decode("utf-8", errors="replace")
        if texts:
            await self._thinker.feed(texts)

    async def end_input(self) -> None:
        self._hearing.speaking.discard(self)
        words = await self._end_phrase_off_the_loop()
        self._settle(self._last_sequence_id, words, through=self._last_sequence_id)
        if words:
            await self._thinker.feed([self._as_text(self._last_sequence_id, words)])
        if self._answers and self._heard_audio and not self._text_so_far.strip():
            raise EngineRejectedError("no speech was recognized in the audio input")
        await self._thinker.end_input()

    async def events(self) -> AsyncIterator[OutputEvent]:
        """The transcript each time it grows while the input arrives, then the answer.

        The answer begins after the end of input, when the transcript is
        final, so the full transcript always comes before the answer.
        """
        answer = aiter(self._thinker.events())
        first = asyncio.ensure_future(anext(answer, None))
        heard: asyncio.Future[Any] | None = None
        try:
            while not first.done():
                heard = asyncio.ensure_future(self._heard_words.wait())
                await asyncio.wait({first, heard}, return_when=asyncio.FIRST_COMPLETED)
                heard.cancel()
                self._heard_words.clear()
                if self._untold and not first.done():
                    yield self._tell()
        finally:
            # No-ops once they are done; the caller stopped reading otherwise.
            first.cancel()
            if heard is not None:
                heard.cancel()
        if self._untold:
            yield self._tell()
        event = first.result()
        if event is None:
            return
        yield event
        async for event in answer:
            yield event

    async def abort(self) -> None:
        self._hearing.speaking.discard(self)
        await self._thinker.abort()

    # -- internals --------------------------------------------------------------------

    async def _end_phrase_off_the_loop(self) -> str:
        """The words of the open phrase; without one (a typed session, a pause at the end of
        the speech), no trip to the Listener's threads, which may be busy recognizing other
        sessions' phrases, and ``end_input`` follows the last feed without a wait, so the
        engine takes the last words with its final input."""
        if not self._heard_audio or not self._phrases.in_phrase:
            return ""
        return str(await self._in_thread(self._end_phrase))

    async def _in_thread(self, work: Any, *args: Any) -> Any:
        self._hearing.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._hearing.executor, work, *args)
        finally:
            self._hearing.busy -= 1

    def _maybe_guess(self, so_far: tuple[int, np.ndarray] | None) -> None:
        """Recognize the open phrase so far, in the background, when the Listener has nothing else to do.

        Moonshine is not a streaming model: the phrase the end of input
        closes is recognized after it, and that is most of what the end of
        speech waits for before the answer starts. A guess at the phrase so
        far is a draft for that recognition: the decoder checks the draft's
        tokens in one pass instead of writing them one step each (about half
        the time for a question; the words are the same, bench/README.md).
        Guesses run one at a time in the process, only when the Listener's
        threads are idle and only while one session speaks: with several
        voices at once a guess took a thread a closing phrase then waited
        for, and the cores the engine was short of (bench/README.md).
        """
        recognizer = self._hearing.recognizer
        if (so_far is None or self._guessing or self._hearing.busy or len(self._hearing.speaking) > 1
                or not isinstance(recognizer, DraftingRecognizer)):
            return
        self._guessing = True
        phrase, samples = so_far

        async def guess() -> None:
            try:
                _, draft = await self._in_thread(recognizer.recognize, samples, self._draft_for(phrase))
                self._draft = (phrase, draft)
            except Exception:  # a guess only saves time; the phrase's own recognition says what failed
                logger.warning("a guess at an open phrase failed", exc_info=True)
            finally:
                self._guessing = False

        self._guess = asyncio.ensure_future(guess())  # kept: the loop holds tasks weakly

    def _draft_for(self, phrase: int) -> Draft:
        number, draft = self._draft
        return draft if number == phrase else ()

    def _recognize(self, samples: np.ndarray, phrase: int) -> str:
        """(Listener thread) The words of a phrase, with the draft of the latest guess at it."""
        recognizer = self._hearing.recognizer
        if isinstance(recognizer, DraftingRecognizer):
            return recognizer.recognize(samples, self._draft_for(phrase))[0].strip()
        return recognizer.transcribe(samples).strip()

    def _settle(self, sequence_id: int, words: str, through: int | None = None) -> None:
        if words:
            self._pieces.append(words)
            self._untold.append((sequence_id, words))
        if through is not None or not self._phrases.in_phrase:
            # Nothing of the audio so far is left unheard: a new holder may start after it.
            self._through = through if through is not None else sequence_id
        if words or through is not None:
            self._heard_words.set()

    def _tell(self) -> InputTranscript:
        pieces, self._untold = tuple(self._untold), []
        return InputTranscript(self.input_transcript, HeardInput(pieces, self._through))

    def _hear(self, chunk: InputChunk) -> tuple[str, tuple[int, np.ndarray] | None]:
        """(Listener thread) The words of the phrases this chunk's audio ended, and the phrase
        still open (its number and samples so far) if it has speech."""
        pcm, rate = pcm16_of(chunk)
        if rate <= 0:
            raise EngineRejectedError("audio needs a sample rate above 0")
        self._heard_audio = True
        first = self._phrases.closed
        phrases = self._phrases.push(self._resampler.push(pcm, rate))
        words = " ".join(filter(None, (self._recognize(p, n) for n, p in enumerate(phrases, start=first))))
        so_far = self._phrases.open_phrase()
        return words, (self._phrases.closed, so_far) if so_far is not None else None

    def _end_phrase(self) -> str:
        """(Listener thread) The words of the phrase still open, if any."""
        number = self._phrases.closed
        phrase = self._phrases.flush()
        tail = self._resampler.flush()
        if phrase is None:
            return ""
        return self._recognize(np.concatenate([phrase, tail]), number)

    def _as_text(self, sequence_id: int, words: str) -> InputChunk:
        # Words join what came before with a space, as they were spoken.
        text = words if not self._text_so_far or self._text_so_far[-1].isspace() else " " + words
        self._text_so_far += text
        return InputChunk(sequence_id, "text", text.encode())


class NoAnswer:
    """The Thinker's place in a session that only hears (no output modalities): it takes the
    words and, at the end of the input, ends without an answer."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()
        self._reason: Literal["stop", "abort"] = "stop"

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        pass

    async def end_input(self) -> None:
        self._ended.set()

    async def events(self) -> AsyncIterator[OutputEvent]:
        await self._ended.wait()
        yield Finished(self._reason, Usage(0, 0))

    async def abort(self) -> None:
        self._reason = "abort"
        self._ended.set()


class ListeningEngine(EngineStage):
    """A text engine plus a Listener: ``audio`` input for every session, and sessions that
    only hear (a transcription)."""

    def __init__(self, thinker: Engine, hearing: Hearing) -> None:
        caps = thinker.capabilities
        super().__init__(thinker, replace(caps, input_modalities=caps.input_modalities | {"audio"},
                                          transcription=True))
        self.hearing = hearing

    def open_session(self, request: EngineRequest) -> EngineSession:
        if not request.output_modalities:
            if request.model not in self.capabilities.model_names:
                raise EngineRejectedError(f"model {request.model!r} is not served by this engine")
            return ListeningSession(NoAnswer(), self.hearing, request.heard)
        return ListeningSession(self._thinker.open_session(request), self.hearing, request.heard)

    async def aclose(self) -> None:
        self.hearing.close()
        await super().aclose()


def with_listener(engine: Engine, recognizer: RecognizerName = "moonshine") -> Engine:
    """The engine with a CPU Listener when a recognizer is installed; as it is otherwise."""
    if "audio" in engine.capabilities.input_modalities:
        return engine
    hearing = Hearing.load(recognizer)
    if hearing is None:
        logger.warning("no recognizer (Moonshine's converted model or pocketsphinx): audio input is off")
        return engine
    return ListeningEngine(engine, hearing)
