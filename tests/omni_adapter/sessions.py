"""Driving one engine session directly, shared by the adapter tests."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from omni_adapter.port import (
    Engine,
    EngineRequest,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
)

MODEL = "SmolLM2-135M-Instruct"
#: The second name the tests' real engine is served under, as a deployment may serve one.
ALIAS = "gpt-4o-mini"
HISTORY = ({"role": "system", "content": "You answer in one short sentence."},)
_ids = itertools.count()


def request(*, history: tuple[dict[str, Any], ...] = HISTORY, **sampling: Any) -> EngineRequest:
    options = SamplingOptions(**{"temperature": 0.0, "max_tokens": 16, **sampling})
    return EngineRequest(
        request_id=f"test-{next(_ids)}", model=MODEL, messages=history, sampling=options
    )


def text_chunks(data: bytes, size: int) -> list[InputChunk]:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    return [InputChunk(sequence_id=i, modality="text", data=p) for i, p in enumerate(pieces)]


async def collect(events: Any) -> tuple[str, OutputEvent]:
    text, last = "", None
    async with asyncio.timeout(120):
        async for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            last = event
    assert last is not None
    return text, last


async def one_shot(engine: Engine, req: EngineRequest, text: str) -> tuple[str, OutputEvent]:
    session = engine.open_session(req)
    await session.feed(text_chunks(text.encode(), len(text.encode())))
    await session.end_input()
    return await collect(session.events())
