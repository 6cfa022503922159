"""What every adapter's session shares: request checks and the event stream's end rule."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from omni_adapter.port import (
    AudioDelta,
    Capabilities,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    Usage,
)


def check_servable(capabilities: Capabilities, request: EngineRequest) -> None:
    """Reject a request for a model or an output modality the engine does not serve."""
    if request.model not in capabilities.model_names:
        raise EngineRejectedError(f"model {request.model!r} is not served by this engine")
    unsupported = set(request.output_modalities) - capabilities.output_modalities
    if unsupported:
        raise EngineRejectedError(f"this engine does not produce {', '.join(sorted(unsupported))}")
    if request.tools and request.tool_choice != "none" and not capabilities.tools:
        raise EngineRejectedError("this engine does not call functions (tools)")
    if request.sampling.response_format is not None and not capabilities.structured_outputs:
        raise EngineRejectedError("this engine does not hold an answer to a grammar (response_format, "
                                  "structured_outputs)")
    if request.raw_prompt and not capabilities.raw_prompt:
        raise EngineRejectedError("this engine takes chat messages only, not a raw prompt (/v1/completions)")


class SessionEvents:
    """A session's outputs: deltas, then exactly one ``Finished`` or ``EngineError``.

    Whatever comes after the end is dropped, so racing paths (an abort during
    the last output, a failure after a stop string) cannot add a second end.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[OutputEvent] = asyncio.Queue()
        self.ended = False

    def emit(self, event: TextDelta | AudioDelta | ToolCallDelta) -> None:
        if not self.ended:
            self._queue.put_nowait(event)

    def finish(self, reason: FinishReason, usage: Usage) -> None:
        self._end(Finished(reason, usage))

    def fail(self, error: EngineError) -> None:
        self._end(error)

    def _end(self, event: Finished | EngineError) -> None:
        if not self.ended:
            self.ended = True
            self._queue.put_nowait(event)

    async def stream(self) -> AsyncIterator[OutputEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished | EngineError):
                return
