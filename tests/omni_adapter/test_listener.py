"""The Listener with real parts: hibari speaks, pocketsphinx hears, while the audio streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from omni_adapter.listener import ListeningSession, Recognizer, RecognizerPool
from omni_adapter.port import EngineRejectedError, InputChunk, OutputEvent
from tests.loop_lag import assert_loop_keeps_up
from tests.voice import SPEECH_RATE, pieces, recognize, speech, word_error_rate

QUESTION = "What is the capital of France?"


@dataclass
class RecordingThinker:
    """Stands in for the text engine session: records what it is fed, and when."""

    fed: list[tuple[str, bool]] = field(default_factory=list)
    ended: bool = False

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        self.fed += [(c.data.decode(), self.ended) for c in chunks]

    async def end_input(self) -> None:
        self.ended = True

    async def events(self) -> AsyncIterator[OutputEvent]:
        # These tests look at the input side only: the answer is empty.
        for event in ():
            yield event

    async def abort(self) -> None:
        return None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.fed)


def test_hibari_speech_is_recognized() -> None:
    assert word_error_rate(QUESTION, recognize(speech(QUESTION), SPEECH_RATE)) == 0.0


def test_settled_words_come_before_the_end_of_the_utterance() -> None:
    recognizer = Recognizer(RecognizerPool().take())
    from omni_adapter.audio import resample

    early: list[str] = []
    for piece in pieces(speech(QUESTION), SPEECH_RATE, 200):
        early += recognizer.hear(resample(piece, SPEECH_RATE, 16_000))
    late = recognizer.end_utterance()
    assert len(early) >= 3, early  # most of the question is settled while it is spoken
    assert word_error_rate(QUESTION, " ".join(early + late)) == 0.0


async def test_spoken_and_typed_chunks_reach_the_thinker_as_text_in_order() -> None:
    thinker = RecordingThinker()
    session = ListeningSession(thinker, RecognizerPool())  # type: ignore[arg-type]
    await session.feed([InputChunk(0, "text", b"Please answer: ")])
    for seq, piece in enumerate(pieces(speech(QUESTION), SPEECH_RATE, 200), start=1):
        await session.feed([InputChunk(seq, "audio", piece, format="pcm16", sample_rate=SPEECH_RATE)])
    before_end = thinker.text
    await session.end_input()
    assert thinker.ended
    assert thinker.text.startswith("Please answer: what is")
    assert word_error_rate("Please answer: " + QUESTION, thinker.text) == 0.0
    assert len(before_end.split()) >= 4  # prefill started while the question was spoken
    assert session.input_transcript == "what is the capital of france"


async def test_silence_is_a_clear_outcome_not_a_hang() -> None:
    thinker = RecordingThinker()
    session = ListeningSession(thinker, RecognizerPool())  # type: ignore[arg-type]
    silence = bytes(2 * 16_000 * 600)  # ten minutes of silence, in 10 s chunks
    async with asyncio.timeout(120):
        for seq, piece in enumerate(pieces(silence, 16_000, 10_000)):
            await session.feed([InputChunk(seq, "audio", piece, format="pcm16", sample_rate=16_000)])
        with pytest.raises(EngineRejectedError, match="no speech"):
            await session.end_input()


async def test_recognition_and_synthesis_stay_off_the_event_loop() -> None:
    from omni_adapter.talker import HibariTalker

    talker = HibariTalker.load()  # loaded and warmed at engine start, like the decoders
    assert talker is not None
    audio = speech(QUESTION * 3)
    pool = RecognizerPool(ready=3)  # made at engine start, like the talker (one per try)

    async def hear_and_speak() -> None:
        session = ListeningSession(RecordingThinker(), pool)  # type: ignore[arg-type]
        await asyncio.gather(
            session.feed([InputChunk(0, "audio", audio, format="pcm16", sample_rate=SPEECH_RATE)]),
            talker.speak("The capital of France is Paris. It is a large city on the Seine."))

    await assert_loop_keeps_up(hear_and_speak)
