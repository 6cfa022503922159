"""The Listener with real parts: hibari speaks, Silero VAD cuts phrases, Moonshine hears them."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from omni_adapter.audio import resample
from omni_adapter.listener import LISTEN_RATE, Hearing, ListeningSession, PocketsphinxRecognizer
from omni_adapter.moonshine import Moonshine
from omni_adapter.port import EngineRejectedError, HeardInput, InputChunk, InputTranscript
from omni_adapter.scripted import ScriptedSession
from tests.loop_lag import assert_loop_keeps_up
from tests.voice import SPEECH_RATE, hearing, pieces, recognize, speech, word_error_rate

QUESTION = "What is the capital of France?"
TWO_PHRASES = "Please tell me a short story about a dog. Then explain why the sky is blue."


def audio_chunks(pcm: bytes, start: int = 0, ms: int = 200, rate: int = SPEECH_RATE) -> list[InputChunk]:
    return [InputChunk(seq, "audio", piece, format="pcm16", sample_rate=rate)
            for seq, piece in enumerate(pieces(pcm, rate, ms), start=start)]


class CountingRecognizer:
    """The real recognizer, counting the phrases it is given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls = 0

    def transcribe(self, samples: np.ndarray) -> str:
        self.calls += 1
        return self.inner.transcribe(samples)  # type: ignore[attr-defined,no-any-return]


def test_hibari_speech_is_recognized() -> None:
    assert word_error_rate(QUESTION, recognize(speech(QUESTION), SPEECH_RATE)) == 0.0


class DecoderSteps:
    """Moonshine's decoder, counting its runs (each one reads all of its weights)."""

    def __init__(self, moonshine: Moonshine) -> None:
        self.inner, self.runs = moonshine._decoder, 0
        self.moonshine = moonshine

    def run(self, *args: Any) -> Any:
        self.runs += 1
        return self.inner.run(*args)

    def __enter__(self) -> DecoderSteps:
        self.moonshine._decoder = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.moonshine._decoder = self.inner


def test_a_draft_saves_decoder_steps_and_changes_no_word() -> None:
    moonshine = hearing().recognizer._model  # type: ignore[attr-defined]
    phrase = np.frombuffer(resample(speech(QUESTION)[:-SPEECH_RATE], SPEECH_RATE, LISTEN_RATE), dtype="<i2")
    samples = phrase.astype(np.float32) / 32768
    with DecoderSteps(moonshine) as plain:
        text, ids = moonshine.recognize(samples)
    assert word_error_rate(QUESTION, text) == 0.0 and plain.runs == len(ids) + 1
    _, guessed = moonshine.recognize(samples[:len(samples) * 2 // 3])  # a guess while the phrase was spoken
    wrong = tuple(reversed(ids))
    for draft, most_runs in [(guessed, plain.runs // 2), (ids, 2), (wrong, plain.runs + 1), (ids[:3], plain.runs - 2)]:
        with DecoderSteps(moonshine) as drafted:
            assert moonshine.recognize(samples, draft) == (text, ids), draft
        assert drafted.runs <= most_runs, (draft, drafted.runs)


class DraftsSeen:
    """The real recognizer, recording the draft each phrase was recognized with."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drafts: list[tuple[int, ...]] = []

    def transcribe(self, samples: np.ndarray) -> str:
        return str(self.inner.transcribe(samples))

    def recognize(self, samples: np.ndarray, draft: tuple[int, ...] = ()) -> tuple[str, tuple[int, ...]]:
        self.drafts.append(draft)
        return self.inner.recognize(samples, draft)  # type: ignore[no-any-return]


async def test_the_last_phrase_is_recognized_with_a_guess_as_its_draft() -> None:
    seen = DraftsSeen(hearing().recognizer)
    ears = Hearing(seen, hearing().vad)  # type: ignore[arg-type]
    thinker = ScriptedSession()
    session = ListeningSession(thinker, ears)
    for chunk in audio_chunks(speech(QUESTION)[:-SPEECH_RATE]):  # no pause at its end: the end of input closes it
        await session.feed([chunk])
        await asyncio.sleep(0.2)  # the pace of speech: the Listener is idle between chunks
    guesses = len(seen.drafts)
    await session.end_input()
    assert thinker.input_text == QUESTION
    assert guesses >= 2 and len(seen.drafts) == guesses + 1
    assert seen.drafts[-1], "the end of input's recognition had no draft"
    ears.close()


async def test_the_end_after_a_pause_takes_no_trip_to_the_listener_threads() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, hearing())
    for chunk in audio_chunks(speech(QUESTION)):  # ends in 0.5 s of silence: the phrase closed
        await session.feed([chunk])
    trips = []
    session._end_phrase = lambda: trips.append(1) or ""  # type: ignore[method-assign]
    await session.end_input()
    assert thinker.input_text == QUESTION and thinker.ended and not trips


async def test_no_guesses_while_two_voices_speak_at_once() -> None:
    """Several voices keep the Listener's threads and the engine's cores for what is due."""
    seen = DraftsSeen(hearing().recognizer)
    ears = Hearing(seen, hearing().vad)  # type: ignore[arg-type]
    thinkers = [ScriptedSession(), ScriptedSession()]
    sessions = [ListeningSession(thinker, ears) for thinker in thinkers]
    for chunk in audio_chunks(speech(QUESTION)[:-SPEECH_RATE]):
        for session in sessions:
            await session.feed([chunk])
        await asyncio.sleep(0.2)
    for session in sessions:
        await session.end_input()
    assert [thinker.input_text for thinker in thinkers] == [QUESTION, QUESTION]
    assert seen.drafts == [(), ()]  # the two closing recognitions, and no guess
    ears.close()


async def test_a_phrase_is_fed_as_soon_as_it_ends_not_at_the_end_of_input() -> None:
    thinker = ScriptedSession()  # stands in for the text engine session: records its input
    session = ListeningSession(thinker, hearing())
    chunks = audio_chunks(speech(TWO_PHRASES))
    first_sentence_fed_at = None
    for chunk in chunks:
        await session.feed([chunk])
        if first_sentence_fed_at is None and "dog" in thinker.input_text:
            first_sentence_fed_at = chunk.sequence_id
    await session.end_input()
    assert word_error_rate(TWO_PHRASES, thinker.input_text) == 0.0, thinker.input_text
    # The first sentence was prefilled while the second was still being spoken.
    assert first_sentence_fed_at is not None and first_sentence_fed_at < len(chunks) - 8, first_sentence_fed_at


async def test_spoken_and_typed_chunks_reach_the_thinker_as_text_in_order() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, hearing())
    await session.feed([InputChunk(0, "text", b"Please answer: ")])
    for chunk in audio_chunks(speech(QUESTION)[:-SPEECH_RATE], start=1):  # no pause at its end
        await session.feed([chunk])
    await session.feed([InputChunk(99, "text", b" Thanks.")])  # ends the open phrase first
    await session.end_input()
    assert thinker.ended
    assert thinker.input_text.startswith("Please answer: What is")
    assert thinker.input_text.endswith("France? Thanks."), thinker.input_text
    assert session.input_transcript == QUESTION


async def test_silence_and_noise_are_not_speech() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, hearing())
    rng = np.random.default_rng(0)
    noise = (rng.normal(0, 3000, SPEECH_RATE * 10)).astype("<i2").tobytes()  # loud hiss, 10 s
    silence = bytes(2 * SPEECH_RATE * 60)
    async with asyncio.timeout(60):
        for chunk in audio_chunks(noise + silence, ms=5000):
            await session.feed([chunk])
        with pytest.raises(EngineRejectedError, match="no speech"):
            await session.end_input()
    assert thinker.input_text == ""


async def test_recognition_and_synthesis_stay_off_the_event_loop() -> None:
    from omni_adapter.talker import HibariTalker

    talker = HibariTalker.load()  # loaded and warmed at engine start, like the recognizer
    assert talker is not None
    audio = speech(TWO_PHRASES)

    async def hear_and_speak() -> None:
        session = ListeningSession(ScriptedSession(), hearing())

        async def hear() -> None:
            for chunk in audio_chunks(audio):
                await session.feed([chunk])
            await session.end_input()

        await asyncio.gather(hear(), talker.speak("The capital of France is Paris. It is a large city on the Seine."))

    await assert_loop_keeps_up(hear_and_speak, bound_sec=0.05)


async def test_the_transcript_is_told_as_it_grows_before_the_input_ends() -> None:
    thinker = ScriptedSession()
    session = ListeningSession(thinker, hearing())
    told: list[str] = []

    async def read() -> None:
        async for event in session.events():
            if isinstance(event, InputTranscript):
                told.append(event.text)

    reader = asyncio.create_task(read())
    for chunk in audio_chunks(speech(TWO_PHRASES)):
        await session.feed([chunk])
        await asyncio.sleep(0)  # the reader's turn, as the event loop gives it between appends
    during_input = list(told)
    await session.end_input()
    await asyncio.wait_for(reader, 30)
    assert during_input and TWO_PHRASES.startswith(during_input[0].split(".")[0])
    assert word_error_rate(TWO_PHRASES, told[-1]) == 0.0
    assert all(later.startswith(earlier) and later != earlier for earlier, later in itertools.pairwise(told))


async def test_a_resumed_session_does_not_hear_its_audio_again() -> None:
    counting = CountingRecognizer(hearing().recognizer)
    ears = Hearing(counting, hearing().vad, threads=1)  # type: ignore[arg-type]
    chunks = audio_chunks(speech(TWO_PHRASES) + speech(QUESTION))
    first = ListeningSession(ScriptedSession(), ears)
    told: list[InputTranscript] = []
    both_told = asyncio.Event()

    async def collect() -> None:
        async for event in first.events():
            if isinstance(event, InputTranscript):
                told.append(event)
                if sum(len(t.heard.pieces) for t in told) >= 2:
                    both_told.set()

    reader = asyncio.create_task(collect())
    # The two phrases end about two thirds in (their last chunk found by the VAD, which a
    # machine's float rounding may move by one); the question ends near the end.
    cut = len(chunks) * 3 // 4
    for chunk in chunks[:cut]:
        await first.feed([chunk])
        await asyncio.sleep(0)
    # Both phrases are heard in the recognizer's thread, which the feed above outpaces (a
    # real client's audio comes at its own pace): wait for them, not for a moment.
    await asyncio.wait_for(both_told.wait(), 30)
    await first.abort()
    reader.cancel()
    heard = HeardInput(tuple(p for t in told for p in t.heard.pieces), told[-1].heard.through)
    assert heard.through >= cut // 2 and counting.calls >= 2

    calls_before = counting.calls
    thinker = ScriptedSession()
    resumed = ListeningSession(thinker, ears, heard)
    for chunk in chunks:  # a resume feeds the whole input again
        await resumed.feed([chunk])
    await resumed.end_input()
    assert word_error_rate(TWO_PHRASES + " " + QUESTION, thinker.input_text) == 0.0, thinker.input_text
    assert counting.calls - calls_before <= 2  # only the phrases after `through`
    ears.close()


async def test_pocketsphinx_is_a_setting_and_decodes_in_a_process_of_its_own() -> None:
    ears = Hearing.load("pocketsphinx")
    assert ears is not None and isinstance(ears.recognizer, PocketsphinxRecognizer)
    thinker = ScriptedSession()

    async def hear() -> None:
        session = ListeningSession(thinker, ears)
        for chunk in audio_chunks(speech(TWO_PHRASES)):
            await session.feed([chunk])
        await session.end_input()

    try:
        # It holds the GIL for all of a decode: in this process the loop would stall for seconds.
        await assert_loop_keeps_up(hear, bound_sec=0.05)
    finally:
        ears.close()
    assert "short story about a dog" in thinker.input_text.lower(), thinker.input_text
