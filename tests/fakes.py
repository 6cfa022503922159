"""A scripted engine for fast tests beside the real-engine ones (never shipped)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from omni_adapter.port import (
    Capabilities,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    InputChunk,
    OutputEvent,
    TextDelta,
    Usage,
)


@dataclass
class Script:
    """How the fake answers: ``echo: <input>`` word by word, or an error."""

    error_after_words: int | None = None
    #: Raise (as an adapter task that dies would) after this many words.
    crash_after_words: int | None = None
    #: Never finish on its own (until aborted): for cancel-during-generation tests.
    hang: bool = False
    word_delay_sec: float = 0.0


@dataclass
class ScriptedSession:
    request: EngineRequest
    script: Script
    accepts: frozenset[str] = frozenset({"text"})
    fed: list[InputChunk] = field(default_factory=list)
    ended: bool = False
    aborted: bool = False
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        for chunk in chunks:
            if chunk.modality not in self.accepts:
                raise EngineRejectedError(f"no {chunk.modality} input")
        self.fed.extend(chunks)

    async def end_input(self) -> None:
        self.ended = True
        self._wake.set()

    async def abort(self) -> None:
        self.aborted = True
        self._wake.set()

    async def events(self) -> AsyncIterator[OutputEvent]:
        await self._wake.wait()
        if self.aborted:
            return
        text = b"".join(c.data if c.modality == "text" else f"<{c.modality}>".encode()
                        for c in self.fed).decode()
        words = f"echo: {text}".split(" ")
        # After a hand-off, continue after what was already emitted (like a
        # real engine given the answer so far as the assistant's prefix).
        skip = len(self.request.assistant_prefix.split(" ")) if self.request.assistant_prefix else 0
        for i, word in enumerate(words):
            if i < skip:
                continue
            if self.script.error_after_words == i:
                yield EngineError("scripted failure", code="engine_error")
                return
            if self.script.crash_after_words == i:
                raise ValueError("scripted crash: an unparsable line from the engine")
            await asyncio.sleep(self.script.word_delay_sec)
            if self.aborted:
                return
            yield TextDelta(word if i == 0 else " " + word)
        if self.script.hang:
            self._wake.clear()
            await self._wake.wait()  # set again only by abort()
        if not self.aborted:
            yield Finished("stop", Usage(prompt_tokens=len(text), completion_tokens=len(words)))


@dataclass
class ScriptedEngine:
    script: Script = field(default_factory=Script)
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}),
        incremental=True, model_names=("scripted",)))
    sessions: list[ScriptedSession] = field(default_factory=list)
    healthy: bool = True

    #: Raised by open_session, to test how the gateway handles a refusal.
    refuse_with: Exception | None = None

    def open_session(self, request: EngineRequest) -> ScriptedSession:
        if self.refuse_with is not None:
            raise self.refuse_with
        session = ScriptedSession(request, self.script, self.capabilities.input_modalities)
        self.sessions.append(session)
        return session

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("scripted engine marked unhealthy")

    async def aclose(self) -> None:
        return None
