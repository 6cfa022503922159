"""The CPU Talker stage: phrase splitting, espeak-ng, and the Thinker->Talker session."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from omni_adapter.port import (
    AudioDelta,
    EngineError,
    EngineRequest,
    Finished,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    Usage,
)
from omni_adapter.scripted import Script, ScriptedEngine, ScriptedSession, text_capabilities
from omni_adapter.talker import (
    EspeakTalker,
    HibariTalker,
    PhraseSplitter,
    SaysInput,
    TalkingEngine,
    TalkingSession,
    with_talker,
    without_lead_in,
)

# --- phrase splitting --------------------------------------------------------


def split_stream(pieces: Sequence[str], max_chars: int = 200) -> list[list[str]]:
    """What the splitter returns after each piece, then at the flush."""
    splitter = PhraseSplitter(max_chars)
    return [splitter.push(p) for p in pieces] + [splitter.flush()]


def split_tokens(text: str) -> list[str]:
    """The phrases of a text streamed a word at a time."""
    splitter = PhraseSplitter()
    out = [phrase for word in text.replace(" ", " |").split("|") for phrase in splitter.push(word)]
    return out + splitter.flush()


def test_the_first_phrase_is_a_few_words_at_a_natural_break() -> None:
    assert split_tokens("The capital of France is Paris. It is known for the Eiffel Tower, which was "
                        "built in 1889, and for its museums.") == [
        "The capital", "of France is Paris.", "It is known for the Eiffel Tower,", "which was built in 1889,",
        "and for its museums."]
    assert split_tokens("Sure, here it is.") == ["Sure, here it is."]  # a one-word clause is too short
    assert split_tokens("Spiders have eight legs and two body parts.") == [
        "Spiders have eight legs", "and two body parts."]
    # No break word: the first phrase still ends after six words.
    assert split_tokens("Bright golden yellow autumn leaves fall slowly today.")[0] == \
        "Bright golden yellow autumn leaves fall"


def test_a_sentence_is_cut_once_the_space_after_it_arrives() -> None:
    assert split_stream(["Hello", " there.", " How", " are you?", " Fine"]) == [
        [], [], ["Hello there."], [], ["How are you?"], ["Fine"]]


def test_decimals_abbreviation_like_dots_and_quotes() -> None:
    assert split_stream(["It costs 3.", "5 euros. ", '"Really?" ', "Yes"]) == [
        [], ["It costs 3.5 euros."], ['"Really?"'], [], ["Yes"]]


def test_line_breaks_end_a_sentence_and_silence_is_dropped() -> None:
    assert split_stream(["- one\n", "- two\n\n", "... ", "!"]) == [["- one"], ["- two"], [], [], []]


def test_run_on_text_is_cut_at_a_space_near_the_limit() -> None:
    out = split_stream(["aaaa bbbb cccc dddd eeee"], max_chars=10)
    assert out == [["aaaa bbbb", "cccc"], ["dddd eeee"]]


# --- espeak-ng -----------------------------------------------------------------


async def test_espeak_speaks_faster_or_slower_within_its_own_range() -> None:
    """``-s`` is 175 words a minute times the speed, kept within 80..450 (espeak-ng's own)."""
    talker = EspeakTalker.find()
    assert talker is not None
    assert [talker.words_per_minute(s) for s in (0.25, 0.5, 1.0, 1.5, 2.0, 4.0)] == [80, 88, 175, 262, 350, 450]
    text = "Please set a timer for ten minutes."
    normal, fast = await talker.speak(text), await talker.speak(text, 2.0)
    assert 0.4 < len(fast) / len(normal) < 0.6
    fastest = await talker.speak(text, 4.0)  # 450 words a minute, then atempo for the rest
    assert 0.2 < len(fastest) / len(normal) < 0.3


async def test_espeak_speaks_a_phrase_as_pcm16_at_its_own_rate() -> None:
    talker = EspeakTalker.find()
    assert talker is not None, "espeak-ng is not installed (scripts/setup.sh installs it)"
    short = await talker.speak("Hello.")
    long = await talker.speak("Hello. This is a much longer sentence, spoken by the talker.")
    for pcm in (short, long):
        samples = np.frombuffer(pcm, dtype="<i2")
        assert np.abs(samples).max() > 1_000, "silence"
    # Around 175 words a minute: a word is a few tenths of a second.
    assert talker.sample_rate == 22_050
    assert 0.2 < len(short) / 2 / talker.sample_rate < 2.0
    assert len(long) > 3 * len(short)


# --- the Thinker -> Talker session -----------------------------------------------


THINKER_DONE = Finished("stop", Usage(3, 4))


def fake_thinker(answer: list[str], delay_sec: float = 0.02,
                 end: Finished | EngineError = THINKER_DONE) -> ScriptedSession:
    """Yields a fixed answer with a pause before each delta, once its input ends."""
    return ScriptedSession(script=Script(answer=lambda *_: answer, word_delay_sec=delay_sec, end=end))


@dataclass
class FakeTalker:
    """One 10 ms sample of value ``len(text)`` per character, after a pause."""

    delay_sec: float = 0.0
    fail_on: str | None = None
    sample_rate: int = 16_000
    spoken: list[str] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)

    def close(self) -> None:
        return None

    async def speak(self, text: str, speed: float = 1.0) -> bytes:
        await asyncio.sleep(self.delay_sec)
        if text == self.fail_on:
            raise RuntimeError("no voice")
        self.spoken.append(text)
        self.speeds.append(speed)
        return np.full(len(text) * 160, len(text), dtype="<i2").tobytes()


async def collect(session: TalkingSession) -> list[OutputEvent]:
    await session.end_input()
    return [event async for event in session.events()]


async def test_audio_follows_each_sentence_while_text_keeps_streaming() -> None:
    thinker = fake_thinker(["One.", " Two", " three.", " Four", " five", " six."], delay_sec=0.05)
    events = await collect(TalkingSession(thinker, FakeTalker()))

    kinds = [type(e).__name__ for e in events]
    # "One." is spoken before the rest of the text has arrived.
    assert kinds.index("AudioDelta") < max(i for i, k in enumerate(kinds) if k == "TextDelta")
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "One. Two three. Four five six."
    audio = [e for e in events if isinstance(e, AudioDelta)]
    assert [a.transcript for a in audio] == ["One.", "Two three.", "Four five six."]
    assert all(a.sample_rate == 16_000 and len(a.pcm16) == len(a.transcript) * 320 for a in audio)
    assert events[-1] == Finished("stop", Usage(3, 4))


async def test_after_a_hand_off_the_unspoken_end_of_the_text_so_far_is_spoken_first() -> None:
    talker = FakeTalker()
    session = TalkingSession(fake_thinker([" it is Paris."]), talker, unspoken_prefix="The capital of France,")
    events = await collect(session)
    assert talker.spoken == ["The capital", "of France, it is Paris."]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == " it is Paris."  # text is not repeated


async def test_an_answer_made_again_is_spoken_from_where_the_audio_so_far_ended() -> None:
    """After a hand-off an answer held to JSON or calling a function is made again from its start
    (gateway/work/said_again.py): what the earlier holder's audio said is not said twice."""
    talker = FakeTalker()
    again = fake_thinker(["The capital", " of France,", " it is Paris."])
    events = await collect(TalkingSession(again, talker, spoken_chars=len("The capital")))
    assert " ".join(talker.spoken) == "of France, it is Paris."  # in the phrases the splitter makes
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The capital of France, it is Paris."


async def test_finished_waits_for_the_last_sentence_to_be_spoken() -> None:
    events = await collect(TalkingSession(fake_thinker(["Hi there"]), FakeTalker(delay_sec=0.2)))
    assert [type(e).__name__ for e in events] == ["TextDelta", "AudioDelta", "Finished"]


async def test_a_talker_failure_fails_the_answer() -> None:
    events = await collect(TalkingSession(fake_thinker(["Fine.", " Broken.", " Never."]),
                                          FakeTalker(fail_on="Broken.")))
    assert isinstance(events[-1], EngineError) and "speech synthesis failed" in events[-1].message
    assert not any(isinstance(e, Finished) for e in events)


async def test_a_thinker_error_passes_through() -> None:
    error = EngineError("boom", code="engine_error")
    events = await collect(TalkingSession(fake_thinker(["Hello."], end=error), FakeTalker()))
    assert events[-1] == error


async def test_abort_while_speaking_ends_the_events_without_more_audio() -> None:
    talker = FakeTalker(delay_sec=10)
    session = TalkingSession(fake_thinker(["Hello."]), talker)
    await session.end_input()
    events: list[OutputEvent] = []

    async def consume() -> None:
        async for event in session.events():
            events.append(event)

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.2)  # text done, the talker is busy
    await session.abort()
    await asyncio.wait_for(consumer, 2)
    assert [type(e).__name__ for e in events] == ["TextDelta", "Finished"]
    assert events[-1].finish_reason == "abort"  # type: ignore[union-attr]
    assert talker.spoken == []


def test_an_engine_that_speaks_itself_gets_no_cpu_talker() -> None:
    """A vLLM-Omni sidecar (``engine_audio``) has its own Talker: the factory's with_talker leaves it."""
    speaking = ScriptedEngine(capabilities=replace(text_capabilities(), output_modalities=frozenset({"text", "audio"})))
    assert with_talker(speaking) is speaking


def test_the_talking_engine_adds_audio_output_and_asks_the_thinker_for_text() -> None:
    thinker = ScriptedEngine()
    engine = TalkingEngine(thinker, FakeTalker())
    assert engine.capabilities.output_modalities == {"text", "audio"}
    assert engine.capabilities.input_modalities == thinker.capabilities.input_modalities
    request = EngineRequest("r1", "scripted", (), SamplingOptions(), output_modalities=("text", "audio"))
    assert isinstance(engine.open_session(request), TalkingSession)
    assert thinker.sessions[-1].request.output_modalities == ("text",)
    plain = engine.open_session(EngineRequest("r2", "scripted", (), SamplingOptions()))
    assert plain is thinker.sessions[-1]




async def test_the_talking_engine_speaks_at_the_requests_speed_and_the_thinker_never_sees_it() -> None:
    thinker = ScriptedEngine(Script(answer=lambda *_: ["One. ", "Two three."]))
    talker = FakeTalker()
    engine = TalkingEngine(thinker, talker)
    assert engine.capabilities.speech_speed and not thinker.capabilities.speech_speed
    request = EngineRequest("r1", "scripted", (), SamplingOptions(), output_modalities=("text", "audio"),
                            speech_speed=1.25)
    session = engine.open_session(request)
    assert isinstance(session, TalkingSession)
    assert thinker.sessions[-1].request.speech_speed == 1.0, "the Thinker writes text: speed is the Talker's"
    await collect(session)
    said = engine.open_session(replace(request, request_id="r2", speak_input=True, speech_speed=0.5))
    assert isinstance(said, TalkingSession)
    await said.feed([InputChunk(0, "text", b"Hello there.")])
    await collect(said)
    assert talker.spoken == ["One.", "Two three.", "Hello there."]
    assert talker.speeds == [1.25, 1.25, 0.5]


async def test_hibari_speaks_faster_or_slower_by_itself_then_by_atempo() -> None:
    """hibari's own speed within 0.5..1 (faster it speeds up less than asked, then drops consonants;
    the docstring of ``HibariTalker.SPEEDS`` has the measurements), FFmpeg's atempo for the rest."""
    talker = HibariTalker.load()
    assert talker is not None
    text = "Please set a timer for ten minutes."
    voiced = {speed: len(talker.voice(text, speed)) for speed in (0.25, 0.5, 1.0, 1.5)}
    assert 1.9 < voiced[0.5] / voiced[1.0] < 2.1
    assert voiced[0.25] == voiced[0.5] and voiced[1.5] == voiced[1.0], "hibari itself: within what it says right"
    said = {speed: len(await talker.speak(text, speed)) for speed in (0.25, 0.5, 1.0, 1.25, 2.0, 4.0)}
    for speed in (0.25, 1.25, 2.0, 4.0):  # the length asked, within 5 %
        assert abs(said[speed] / said[1.0] * speed - 1) < 0.05, (speed, said)
    talker.close()


def test_silence_before_a_phrase_is_cut_to_a_short_lead_in() -> None:
    rate = 1000
    audio = np.concatenate([np.zeros(300), np.full(100, 0.5), np.zeros(400)])
    out = without_lead_in(audio, rate, lead_sec=0.03)
    assert len(out) == 30 + 100 + 400 and out[30] == 0.5 and out[29] == 0.0
    assert without_lead_in(np.zeros(50), rate).size == 50, "all silence: left as it is"


def test_hibaris_answer_sounds_at_once() -> None:
    """hibari opens each phrase with ~0.3 s of silence: the first sound of an answer came
    0.3 s after its first audio."""
    talker = HibariTalker.load()
    assert talker is not None
    for text in ("The capital", "of France is Paris."):
        samples = np.abs(np.frombuffer(talker._synthesize(text), dtype="<i2")) > 100
        assert np.argmax(samples) / talker.sample_rate <= 0.05, text
    talker.close()


async def test_text_to_speech_says_the_input_as_it_arrives_and_after_a_hand_off_only_the_rest() -> None:
    """``SaysInput``: the input's text is the answer, passed on per chunk (UTF-8 cut anywhere);
    a new holder, given what was published, says only what comes after it."""
    said = "Café opens early."
    data = said.encode()
    for skip in (0, len("Café ")):
        session = SaysInput(skip)
        await session.feed([InputChunk(0, "text", data[:4]), InputChunk(1, "text", data[4:9])])
        await session.feed([InputChunk(2, "text", data[9:])])
        await session.end_input()
        events = [event async for event in session.events()]
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == said[skip:]
        assert events[-1] == Finished("stop", Usage(0, 0))
