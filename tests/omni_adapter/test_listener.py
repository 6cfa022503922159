"""The Listener with real parts: hibari speaks, pocketsphinx hears, while the audio streams."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from omni_adapter.listener import ListeningSession, Recognizer, RecognizerPool
from omni_adapter.port import EngineRejectedError, InputChunk, InputTranscript
from omni_adapter.scripted import ScriptedSession
from tests.loop_lag import assert_loop_keeps_up
from tests.voice import SPEECH_RATE, pieces, recognize, speech, word_error_rate

QUESTION = "What is the capital of France?"


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
    thinker = ScriptedSession()  # stands in for the text engine session: records its input
    session = ListeningSession(thinker, RecognizerPool())
    await session.feed([InputChunk(0, "text", b"Please answer: ")])
    for seq, piece in enumerate(pieces(speech(QUESTION), SPEECH_RATE, 200), start=1):
        await session.feed([InputChunk(seq, "audio", piece, format="pcm16", sample_rate=SPEECH_RATE)])
    before_end = thinker.input_text
    await session.end_input()
    assert thinker.ended
    assert thinker.input_text.startswith("Please answer: what is")
    assert word_error_rate("Please answer: " + QUESTION, thinker.input_text) == 0.0
    assert len(before_end.split()) >= 4  # prefill started while the question was spoken
    assert session.input_transcript == "what is the capital of france"


async def test_silence_is_a_clear_outcome_not_a_hang() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, RecognizerPool())
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
        session = ListeningSession(ScriptedSession(), pool)
        await asyncio.gather(
            session.feed([InputChunk(0, "audio", audio, format="pcm16", sample_rate=SPEECH_RATE)]),
            talker.speak("The capital of France is Paris. It is a large city on the Seine."))

    await assert_loop_keeps_up(hear_and_speak)


async def test_the_transcript_is_told_as_it_grows_before_the_input_ends() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, RecognizerPool())
    told: list[str] = []

    async def read() -> None:
        async for event in session.events():
            if isinstance(event, InputTranscript):
                told.append(event.text)

    reader = asyncio.create_task(read())
    for seq, piece in enumerate(pieces(speech(QUESTION), SPEECH_RATE, 200)):
        await session.feed([InputChunk(seq, "audio", piece, format="pcm16", sample_rate=SPEECH_RATE)])
        await asyncio.sleep(0)  # the reader's turn, as the event loop gives it between appends
    during_input = list(told)
    await session.end_input()
    await asyncio.wait_for(reader, 30)
    assert during_input and "what is the capital of france".startswith(during_input[-1])
    assert told[-1] == "what is the capital of france"
    assert all(later.startswith(earlier) and later != earlier for earlier, later in itertools.pairwise(told))
