"""One streamed question: send paced chunks, print the answer as it comes, time it.

Sends are pipelined (up to ``IN_FLIGHT`` unacknowledged), so a slow
acknowledgement does not hold back the pace; the answer is read at the
same time, so nothing of it waits for the input to be sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from omni_client.answer import AudioDelta, TextDelta, Transcript
from omni_client.async_client import AsyncClient, AsyncSession
from omni_client.inputs import PacedChunk
from omni_client.progress import Progress

#: Chunks sent and not yet acknowledged, at most (well inside the gateway's out-of-order window).
IN_FLIGHT = 8


@dataclass
class Timing:
    started: float = field(default_factory=time.monotonic)
    input_ended: float | None = None
    first_text: float | None = None
    first_audio: float | None = None
    answered: float | None = None

    def after_input(self, moment: float | None) -> str:
        if moment is None or self.input_ended is None:
            return "-"
        return f"{max(0.0, moment - self.input_ended):.2f} s"

    def report(self, chunks: int, kind: str) -> str:
        total = (self.answered or time.monotonic()) - self.started
        lines = [f"{chunks} {kind} chunks sent in {(self.input_ended or self.started) - self.started:.2f} s",
                 f"first token {self.after_input(self.first_text)} after end of input"]
        if self.first_audio is not None:
            lines.append(f"first audio {self.after_input(self.first_audio)} after end of input")
        lines.append(f"answer done {self.after_input(self.answered)} after end of input; total {total:.2f} s")
        return "\n".join(lines)


@dataclass
class Answer:
    text: str = ""
    audio: bytearray = field(default_factory=bytearray)
    transcript: str = ""


class Printer:
    """Answer text to stdout as it streams; held back while the progress bar owns the terminal."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._held: list[str] | None = []

    def write(self, text: str) -> None:
        if self._held is not None:
            self._held.append(text)
            return
        self._out.write(text)
        self._out.flush()

    def release(self) -> None:
        held, self._held = self._held or [], None
        self.write("".join(held))


async def stream(client: AsyncClient, body: dict[str, Any], chunks: list[PacedChunk], *, realtime: bool,
                 progress: Progress, printer: Printer, timing: Timing,
                 on_session: Any = None) -> tuple[AsyncSession, Answer]:
    session = await client.create_session(**body)
    if on_session is not None:
        on_session(session)
    answer = Answer()
    reader = asyncio.create_task(_read(session, answer, printer, timing))
    try:
        await _send(session, chunks, realtime, progress, timing)
        timing.input_ended = time.monotonic()
        await session.finish()
        progress.close()
        printer.release()
        await reader
    finally:
        reader.cancel()
    timing.answered = time.monotonic()
    return session, answer


async def _send(session: AsyncSession, chunks: list[PacedChunk], realtime: bool, progress: Progress,
                timing: Timing) -> None:
    """Every chunk, paced; the first failure (after the client's retries) stops the rest."""
    room = asyncio.Semaphore(IN_FLIGHT)
    failures: list[BaseException] = []

    async def send(paced: PacedChunk) -> None:
        try:
            await session.send(paced.chunk)
            progress.on_acked()
        except Exception as exc:
            failures.append(exc)
        finally:
            room.release()

    tasks = []
    try:
        for paced in chunks:
            if realtime:
                await asyncio.sleep(max(0.0, timing.started + paced.ready_at - time.monotonic()))
            await room.acquire()
            if failures:
                break
            progress.on_sent()
            tasks.append(asyncio.create_task(send(paced)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    if failures:
        raise failures[0]


async def _read(session: AsyncSession, answer: Answer, printer: Printer, timing: Timing) -> None:
    async for event in session.answer():
        if isinstance(event, TextDelta):
            timing.first_text = timing.first_text or time.monotonic()
            answer.text += event.text
            printer.write(event.text)
        elif isinstance(event, AudioDelta):
            timing.first_audio = timing.first_audio or time.monotonic()
            answer.audio += event.data
        elif isinstance(event, Transcript):
            answer.transcript = event.text
