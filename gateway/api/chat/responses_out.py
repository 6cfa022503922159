"""A chat answer as a Responses API answer: the ``response`` object, and its stream events.

The session's answer is a ``chat.completion`` (stored) or ``chat.completion.chunk``
frames (streamed); this only reshapes them. Text becomes one ``message`` output item
with one ``output_text`` part, each function call a ``function_call`` item, in the
order the answer made them; a stream says each item's start, pieces and end:

    response.created, response.in_progress
    response.output_item.added (message) ─ content_part.added ─ output_text.delta ... ─
        output_text.done ─ content_part.done ─ output_item.done
    response.output_item.added (function_call) ─ function_call_arguments.delta ... ─
        function_call_arguments.done ─ output_item.done
    response.completed (response.incomplete at max_output_tokens; response.failed)

Each item stays open until the answer ends (a call's pieces may come between pieces of
text), then each is closed in output order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.responses_models import ResponsesRequest
from gateway.output.frames import DONE
from gateway.output.sse import FrameEvent


@dataclass(frozen=True)
class ResponseShape:
    """What a response object repeats of its request."""

    model: str
    created_at: int
    fields: dict[str, Any]

    @staticmethod
    def of(body: ResponsesRequest, model: str, previous_response_id: str | None = None) -> ResponseShape:
        """``previous_response_id``: the response this one continues (a WebSocket's; HTTP has none)."""
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return ResponseShape(model, int(time.time()), {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default",
            "store": False,  # nothing is kept to retrieve later
            "temperature": body.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": body.truncation or "disabled",
            "user": body.user,
        })

    def response(self, response_id: str, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output, "usage": _usage(usage) if usage else None, **self.fields,
        }


def response_of(completion: dict[str, Any], shape: ResponseShape) -> dict[str, Any]:
    """The ``response`` object of a finished ``chat.completion``."""
    choice = completion["choices"][0]
    message = choice["message"]
    status, error = _end(choice["finish_reason"])
    item_status = "completed" if status == "completed" else "incomplete"
    output = []
    if message.get("content"):
        output.append(_message_item(f"{completion['id']}_0", message["content"], item_status,
                                    (choice.get("logprobs") or {}).get("content") or []))
    output += [_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], item_status)
               for call in message.get("tool_calls") or ()]
    shape = ResponseShape(completion["model"], completion["created"], shape.fields)
    return shape.response(completion["id"], status, output, completion.get("usage"), error)


def warmup_events(shape: ResponseShape, response_id: str) -> list[ServerSentEvent]:
    """The events of a response that generates nothing (a WebSocket's ``generate: false``, which
    only prepares what a next response continues from): begun, then completed without output."""
    stream = _EventStream(shape, response_id)
    return [*stream.begun(), stream.event("response.completed", response=stream.snapshot("completed"))]


async def response_events(frames: AsyncGenerator[ServerSentEvent, None], shape: ResponseShape,
                          response_id: str) -> AsyncGenerator[ServerSentEvent, None]:
    """The session's ``chat.completion.chunk`` frames as Responses stream events."""
    stream = _EventStream(shape, response_id)
    for event in stream.begun():
        yield event
    error: dict[str, Any] | None = None
    try:
        # Closed with this generator (a client that left): its end cancels the session at once.
        async with contextlib.aclosing(frames):
            async for frame in frames:
                if frame.event == "error":  # the session failed: the answer ends here
                    error = _error(orjson.loads(str(frame.data)).get("error") or {})
                    break
                if frame.event or frame.data == DONE:  # another kind of frame (the input's transcript); the end
                    continue
                for event in stream.chunk(orjson.loads(str(frame.data))):
                    yield event
    except errors.GatewayError as exc:  # before the first frame: the session is gone, Redis is away...
        error = _error(exc.envelope()["error"])
    status, ended_early = ("failed", error) if error else _end(stream.finish_reason)
    for event in stream.close_items("completed" if status == "completed" else "incomplete"):
        yield event
    yield stream.event(f"response.{status}", response=stream.snapshot(status, ended_early))


class _EventStream:
    """The events of one response, numbered, and the output items they have built so far.

    The answer's text goes to a message item, each function call (by its index in the chat
    frames) to an item of its own.
    An item ends when a call begins after it (a call's arguments are whole then: a client runs
    it on ``output_item.done`` while the next one streams); the others end with the answer.
    """

    def __init__(self, shape: ResponseShape, response_id: str) -> None:
        self._shape = shape
        self._id = response_id
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._message: int | None = None  # the message item's output index
        self._calls: dict[int, int] = {}  # a call's index in the frames -> its item's output index
        self._done: set[int] = set()  # the output indexes of items already ended
        self.finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        #: Log probabilities of tokens that said nothing yet (the answer's first, a held-back stop).
        self._unsaid: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> ServerSentEvent:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return FrameEvent(data=orjson.dumps(event).decode(), event=kind)

    def begun(self) -> list[ServerSentEvent]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def snapshot(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._shape.response(self._id, status, self._output, self._usage, error)

    def chunk(self, chunk: dict[str, Any]) -> list[ServerSentEvent]:
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[ServerSentEvent] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self._unsaid += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_piece(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def close_items(self, status: str) -> list[ServerSentEvent]:
        """The end of every item not ended yet, in output order, as ``status``."""
        return [event for index in range(len(self._output)) if index not in self._done
                for event in self._close(index, status)]

    def _close(self, index: int, status: str) -> list[ServerSentEvent]:
        self._done.add(index)
        item = self._output[index]
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            part["logprobs"] += self._unsaid  # (the end of sequence's: it said nothing)
            self._unsaid = []
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events += [self.event("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]),
                       self.event("response.content_part.done", **at, part=part)]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, text: str) -> list[ServerSentEvent]:
        events = []
        if self._message is None:
            self._message = len(self._output)
            item = _message_item(f"{self._id}_{self._message}", "", "in_progress")
            item["content"] = []
            self._output.append(item)
            events.append(self.event("response.output_item.added", output_index=self._message,
                                     item=item))  # encoded now: before its part
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._message,
                                     content_index=0, part=item["content"][0]))
        item = self._output[self._message]
        logprobs, self._unsaid = self._unsaid, []
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                 content_index=0, delta=text, logprobs=logprobs))
        return events

    def _call_piece(self, call: dict[str, Any]) -> list[ServerSentEvent]:
        events = []
        function = call.get("function") or {}
        index = self._calls.get(call["index"])
        if index is None:
            # What came before this call is whole: the text so far (text after the call would be
            # a message of its own, as OpenAI's items never interleave) and the calls before it.
            for earlier in [*self._calls.values(), *([] if self._message is None else [self._message])]:
                if earlier not in self._done:
                    events += self._close(earlier, "completed")
            self._message = None
            index = self._calls[call["index"]] = len(self._output)
            self._output.append(_call_item(call.get("id") or f"call_{self._id}_{call['index']}",
                                           function.get("name") or "", "", "in_progress"))
            events.append(self.event("response.output_item.added", output_index=index, item=self._output[index]))
        item = self._output[index]
        if function.get("name"):
            item["name"] = function["name"]
        if pieces := function.get("arguments"):
            item["arguments"] += pieces
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=pieces))
        return events


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None,
                  ) -> dict[str, Any]:
    """The answer's text as an output item; its tokens' log probabilities as chat's (the same shape)."""
    return {"id": f"msg_{item_id}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _end(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """A response's status, and its error, from how the chat answer finished."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    if finish_reason == "length":
        return "incomplete", None
    # "abort" (the engine stopped the request), or no finish at all: not a whole answer.
    return "failed", {"code": "server_error", "message": "the answer ended before it was complete",
                      "type": "engine_error"}


#: The Responses API's error codes are a fixed list; the gateway's own code goes in ``type``.
_RATE_CODES = frozenset({"capacity_exhausted", "rate_limit_exceeded", "too_many_sessions", "overloaded"})


def _error(envelope: dict[str, Any]) -> dict[str, Any]:
    code = str(envelope.get("code") or "server_error")
    return {"code": "rate_limit_exceeded" if code in _RATE_CODES else "server_error",
            "message": str(envelope.get("message") or ""), "type": code}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
