"""The scripted engine's own options (it stands in for the engine in the gateway's tests)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from omni_adapter.port import (
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    Usage,
)
from omni_adapter.scripted import Script, ScriptedEngine, ScriptedSession, text_capabilities

REQUEST = EngineRequest("r1", "scripted", (), SamplingOptions())


async def answer_to(session: ScriptedSession, text: bytes = b"hello big world") -> list[OutputEvent]:
    await session.feed([InputChunk(0, "text", text)])
    await session.end_input()
    async with asyncio.timeout(5):
        return [event async for event in session.events()]


def texts(events: list[OutputEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta)]


async def test_echoes_the_input_word_by_word_once_it_ends() -> None:
    engine = ScriptedEngine()
    session = engine.open_session(REQUEST)
    events = await answer_to(session)
    assert texts(events) == ["echo:", " hello", " big", " world"]
    assert events[-1] == Finished("stop", Usage(prompt_tokens=15, completion_tokens=4))
    assert engine.sessions == [session] and session.ended and not session.aborted
    assert [c.data for c in session.fed] == [b"hello big world"] and len(session.fed_at) == 1


async def test_the_answer_is_a_function_of_the_request_and_the_input() -> None:
    script = Script(answer=lambda request, text: [request.request_id, ":", text.upper()], end="length")
    events = await answer_to(ScriptedEngine(script).open_session(REQUEST), b"hi")
    assert texts(events) == ["r1", ":", "HI"]
    assert events[-1] == Finished("length", Usage(2, 3))


async def test_the_end_can_be_an_exact_event() -> None:
    error = EngineError("boom")
    events = await answer_to(ScriptedSession(script=Script(end=error)))
    assert events[-1] == error


async def test_other_modalities_are_refused_unless_the_capabilities_take_them() -> None:
    audio = InputChunk(0, "audio", b"\0\0", format="pcm16", sample_rate=16_000)
    with pytest.raises(EngineRejectedError):
        await ScriptedEngine().open_session(REQUEST).feed([audio])
    caps = replace(text_capabilities(), input_modalities=frozenset({"text", "audio"}))
    session = ScriptedEngine(capabilities=caps).open_session(REQUEST)
    await session.feed([audio, InputChunk(1, "text", b" hi")])
    assert session.input_text == "<audio> hi"


async def test_an_error_event_after_some_words() -> None:
    events = await answer_to(ScriptedSession(script=Script(error_after_words=2)))
    assert texts(events) == ["echo:", " hello"]
    assert events[-1] == EngineError("scripted failure", code="engine_error")


async def test_a_crash_after_some_words() -> None:
    with pytest.raises(ValueError, match="scripted crash"):
        await answer_to(ScriptedSession(script=Script(crash_after_words=2)))


async def test_a_hanging_answer_ends_only_when_aborted() -> None:
    session = ScriptedSession(script=Script(hang=True))
    events: list[OutputEvent] = []

    async def consume() -> None:
        events.extend([event async for event in session.events()])

    await session.end_input()
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert not consumer.done() and texts(events) == []  # collected only at the end
    await session.abort()
    await asyncio.wait_for(consumer, 1)
    assert texts(events) == ["echo:", " "] and not any(isinstance(e, Finished) for e in events)


async def test_abort_before_the_end_of_input_ends_the_events_with_nothing() -> None:
    session = ScriptedSession()
    await session.abort()
    assert [event async for event in session.events()] == []


async def test_words_are_paced_and_lazy_deltas_are_read_when_emitted() -> None:
    class Clock:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> str:
            return str(time.perf_counter())

    started = time.perf_counter()
    events = await answer_to(ScriptedSession(script=Script(answer=lambda *_: Clock(), word_delay_sec=0.05)))
    stamps = [float(t) - started for t in texts(events)]
    assert stamps[0] >= 0.05 and all(b - a >= 0.04 for a, b in zip(stamps, stamps[1:], strict=False))


async def test_after_a_hand_off_the_answer_continues_after_its_prefix() -> None:
    request = replace(REQUEST, assistant_prefix="echo: hello")
    events = await answer_to(ScriptedSession(request))
    assert texts(events) == [" big", " world"]
    assert events[-1] == Finished("stop", Usage(15, 4))


async def test_the_engine_refuses_reports_health_and_records_nothing_when_asked() -> None:
    engine = ScriptedEngine(refuse_with=EngineRejectedError("no"))
    with pytest.raises(EngineRejectedError):
        engine.open_session(REQUEST)
    engine = ScriptedEngine(record=False)
    await engine.check_health()
    engine.healthy = False
    with pytest.raises(RuntimeError):
        await engine.check_health()
    session = engine.open_session(REQUEST)
    assert texts(await answer_to(session)) == ["echo:", " "]  # it kept no input to echo
    assert engine.sessions == [] and session.fed == []
