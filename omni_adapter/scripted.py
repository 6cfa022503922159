"""A scripted engine: the engine port without inference, for tests and benchmarks.

Like httpx's ``MockTransport`` beside its real transports, this is the one
fake of :mod:`omni_adapter.port` (``Engine`` / ``EngineSession``) that the
gateway's tests, its benchmarks and your own tests share. A session records
what it is fed and, once the input ends, answers by its :class:`Script`: by
default ``echo: <input>`` word by word, then ``Finished("stop")``.

Plug it into the app where a real engine would go::

    from gateway.runtime.app import create_app
    from gateway.settings import Settings
    from omni_adapter.scripted import Script, ScriptedEngine

    engine = ScriptedEngine(Script(word_delay_sec=0.05))
    app = create_app(Settings(redis_url="redis://localhost:6379/0"), engine=engine)
    # ... drive the app (e.g. httpx.ASGITransport), then look at the engine:
    assert engine.sessions[0].fed[0].data == b"hello"

A script's options, not subclasses, give the other behaviours a test needs:

- ``answer``: the answer as a function of the request and the input text;
- ``word_delay_sec``: a pause before each delta (a slow engine);
- ``error_after_words`` / ``crash_after_words``: an ``EngineError`` event, or
  an exception out of ``events()`` (an adapter whose task died);
- ``hang``: never finish until aborted;
- ``end``: the finish reason, or the exact last event;
- ``calls``: the function calls the answer makes, as ``(name, arguments)``,
  after its text, when the request has tools (finish reason ``tool_calls``).

The engine has ``healthy`` (``check_health`` raises when false),
``refuse_with`` (``open_session`` raises it) and ``capabilities``; each
session keeps ``fed``, ``fed_at`` (when each chunk arrived), ``ended`` and
``aborted`` for a test to assert on. Swapping ``engine.script`` changes the
sessions opened after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from omni_adapter.port import (
    Capabilities,
    EngineDeadError,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    FinishReason,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    ToolCallDelta,
    Usage,
)


class Deltas(Protocol):
    """The text deltas of an answer, read one by one as each is emitted.

    A list does; so does a lazy sequence whose items are made when read
    (after their delay), e.g. stamped with the time they are emitted.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> str: ...


#: The answer to a request, given its input (text as is, ``<audio>`` etc. for the rest).
Answer = Callable[[EngineRequest, str], Deltas]
#: The function calls of an answer, given the request and its input: ``(name, arguments JSON)``.
Calls = Callable[[EngineRequest, str], list[tuple[str, str]]]


def echo(request: EngineRequest, text: str) -> list[str]:
    """``echo: <input>``, one delta a word (with the space before it)."""
    words = f"echo: {text}".split(" ")
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def text_capabilities(model: str = "scripted") -> Capabilities:
    """Text in, text out, prefilled incrementally, one model name."""
    return Capabilities(input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}),
                        incremental=True, model_names=(model,), tools=True, raw_prompt=True)


@dataclass
class Script:
    """How sessions answer; the delta indexes below count from the answer's start."""

    answer: Answer = echo
    #: Yield an ``EngineError`` instead of the delta at this index.
    error_after_words: int | None = None
    #: That error's code (``invalid_request``: the engine refused the request as the client's mistake).
    error_code: str = "engine_error"
    #: Raise (as an adapter task that dies would) instead of the delta at this index.
    crash_after_words: int | None = None
    #: Never finish on its own (until aborted): for cancel-during-generation tests.
    hang: bool = False
    #: A pause before each delta.
    word_delay_sec: float = 0.0
    #: The last event: a finish reason (usage: input characters, answer deltas)
    #: or the event itself.
    end: FinishReason | Finished | EngineError = "stop"
    #: Function calls after the text, when the request may call its tools.
    calls: Calls | None = None


def _standalone_request() -> EngineRequest:
    return EngineRequest("scripted", "scripted", (), SamplingOptions())


@dataclass
class ScriptedSession:
    """One request; made by the engine, or on its own to stand in for a stage's inner session."""

    request: EngineRequest = field(default_factory=_standalone_request)
    script: Script = field(default_factory=Script)
    accepts: frozenset[str] = frozenset({"text"})
    #: Keep the input in ``fed`` and ``fed_at``; without it the answer sees no input.
    record: bool = True
    fed: list[InputChunk] = field(default_factory=list)
    #: ``time.perf_counter()`` when each chunk of ``fed`` reached the session.
    fed_at: list[float] = field(default_factory=list)
    ended: bool = False
    aborted: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        now = time.perf_counter()
        for chunk in chunks:
            if chunk.modality not in self.accepts:
                raise EngineRejectedError(f"no {chunk.modality} input")
        if self.record:
            self.fed.extend(chunks)
            self.fed_at.extend([now] * len(chunks))

    async def end_input(self) -> None:
        self.ended = True
        self._wake.set()

    async def abort(self) -> None:
        self.aborted = True
        self._wake.set()

    @property
    def input_text(self) -> str:
        return b"".join(c.data if c.modality == "text" else f"<{c.modality}>".encode()
                        for c in self.fed).decode()

    async def events(self) -> AsyncIterator[OutputEvent]:
        await self._wake.wait()
        if self.aborted:
            return
        script, text = self.script, self.input_text
        deltas = script.answer(self.request, text)
        for i in range(_resume_at(deltas, self.request.assistant_prefix), len(deltas)):
            if script.error_after_words == i:
                yield EngineError("scripted failure", code=script.error_code)
                return
            if script.crash_after_words == i:
                raise ValueError("scripted crash: an unparsable line from the engine")
            await asyncio.sleep(script.word_delay_sec)
            if self.aborted:
                return
            yield TextDelta(deltas[i])
        if script.hang:
            self._wake.clear()
            await self._wake.wait()  # set again only by abort()
        if self.aborted:
            return
        called = script.calls(self.request, text) if script.calls and self.request.tools \
            and self.request.tool_choice != "none" else []
        for index, (name, arguments) in enumerate(called):
            half = len(arguments) // 2  # the arguments in two deltas, as a model streams them
            yield ToolCallDelta(index, f"call_scripted_{index}", name, "")
            yield ToolCallDelta(index, arguments=arguments[:half])
            yield ToolCallDelta(index, arguments=arguments[half:])
        if isinstance(script.end, str):
            reason: FinishReason = "tool_calls" if called and script.end == "stop" else script.end
            yield Finished(reason, Usage(prompt_tokens=len(text), completion_tokens=len(deltas)))
        else:
            yield script.end


def _resume_at(deltas: Deltas, assistant_prefix: str) -> int:
    """The first delta after the answer so far (replayed after a hand-off).

    Like a real engine given the answer so far as the assistant's prefix,
    generation continues after it.
    """
    index = covered = 0
    while covered < len(assistant_prefix) and index < len(deltas):
        covered += len(deltas[index])
        index += 1
    return index


@dataclass
class ScriptedEngine:
    script: Script = field(default_factory=Script)
    capabilities: Capabilities = field(default_factory=text_capabilities)
    #: Every session opened, in order (when ``record``).
    sessions: list[ScriptedSession] = field(default_factory=list)
    healthy: bool = True
    #: Dead for good (``EngineDeadError``), as a vLLM engine whose core process died.
    dead: bool = False
    #: Raised by open_session, to test how the gateway handles a refusal.
    refuse_with: Exception | None = None
    #: Keep the sessions and their input; a long-running server (a benchmark
    #: measuring memory per session) turns it off to hold nothing per session.
    record: bool = True

    def open_session(self, request: EngineRequest) -> ScriptedSession:
        if self.refuse_with is not None:
            raise self.refuse_with
        session = ScriptedSession(request, self.script, self.capabilities.input_modalities, self.record)
        if self.record:
            self.sessions.append(session)
        return session

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("scripted engine marked dead")
        if not self.healthy:
            raise RuntimeError("scripted engine marked unhealthy")

    async def aclose(self) -> None:
        return None
