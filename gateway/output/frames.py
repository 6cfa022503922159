"""OpenAI ``chat.completion.chunk`` frames and the final ``chat.completion``.

The frame order is the contract of seeds/003: a role frame (only once the
answer starts), content deltas, a terminal frame with ``finish_reason``,
then ``[DONE]``. The session id is the ``id`` so an OpenAI client can parse
the stream as its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from omni_adapter.port import HeardInput, TokenLogprob, ToolCallDelta, Usage

DONE = "[DONE]"


def _dumps(obj: dict[str, Any]) -> str:
    # What json.dumps(separators=(",", ":"), ensure_ascii=False) writes, in a
    # fifth of the time: a frame per token per session.
    return orjson.dumps(obj).decode()


#: The SSE event name of the input transcript frame (EventSource's onmessage skips it).
TRANSCRIPT_EVENT = "transcript"


def content_of(data: str) -> str:
    """The text a ``chat.completion.chunk`` frame adds to the answer ('' for others)."""
    if data == DONE:
        return ""
    return "".join(choice["delta"].get("content") or "" for choice in json.loads(data).get("choices", ()))


def tool_call_deltas_of(data: str) -> list[ToolCallDelta]:
    """The pieces of function calls a ``chat.completion.chunk`` frame adds ([] for others)."""
    if data == DONE:
        return []
    return [ToolCallDelta(call["index"], call.get("id"), call["function"].get("name"), call["function"]["arguments"])
            for choice in json.loads(data).get("choices", ()) for call in choice["delta"].get("tool_calls") or ()]


def heard_of(transcript_frames: list[str]) -> HeardInput:
    """What the transcript frames say was heard: every piece, and how far the audio is heard."""
    pieces: list[tuple[int, str]] = []
    through = -1
    for data in transcript_frames:
        heard = json.loads(data).get("heard")
        if heard:
            pieces += [(int(seq), str(text)) for seq, text in heard["pieces"]]
            through = int(heard["through"])
    return HeardInput(tuple(pieces), through)


def unspoken_end(text: str, frame_data: list[str]) -> str:
    """The end of ``text`` that the audio frames among ``frame_data`` have not spoken.

    Each audio frame's transcript is the phrase it speaks, in the order of the text.
    """
    at = 0
    for data in frame_data:
        if data == DONE:
            continue
        for choice in json.loads(data).get("choices", ()):
            spoken = str((choice["delta"].get("audio") or {}).get("transcript") or "").strip()
            found = text.find(spoken, at) if spoken else -1
            if found >= 0:
                at = found + len(spoken)
    return text[at:]


def openai_logprob(token: TokenLogprob) -> dict[str, Any]:
    """OpenAI's entry of ``choices[].logprobs.content``: the token, its log probability and UTF-8
    bytes, and the likeliest tokens at its place."""
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token.encode("utf-8", "replace")),
            "top_logprobs": [{"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
                             for text, logprob in token.top]}


def logprobs_of(data: str) -> list[dict[str, Any]]:
    """The log probability entries of a published frame (none in most)."""
    if '"logprobs"' not in data:
        return []
    return [entry for choice in orjson.loads(data).get("choices") or ()
            for entry in (choice.get("logprobs") or {}).get("content") or ()]


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclass(frozen=True)
class FrameBuilder:
    session_id: str
    model: str
    created: int

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return _dumps({"id": self.session_id, "object": "chat.completion.chunk",
                       "created": self.created, "model": self.model, "choices": choices, **extra})

    def role(self) -> str:
        return self._chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> str:
        """A content delta; with its tokens' log probabilities (``openai_logprob`` entries) when the
        request asked for them."""
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        if logprobs:
            choice["logprobs"] = {"content": logprobs}
        return self._chunk([choice])

    def audio(self, audio: dict[str, Any]) -> str:
        """An OpenAI audio delta: ``{"id", "data" (base64 pcm16), "transcript", "expires_at"}``."""
        return self._chunk([{"index": 0, "delta": {"audio": audio}, "finish_reason": None}])

    def tool_call(self, delta: ToolCallDelta) -> str:
        """OpenAI's ``tool_calls`` delta: the call's id, type and name first, then its arguments."""
        call: dict[str, Any] = {"index": delta.index}
        function: dict[str, Any] = {"arguments": delta.arguments}
        if delta.id is not None:
            call.update(id=delta.id, type="function")
        if delta.name is not None:
            function["name"] = delta.name
        call["function"] = function
        return self._chunk([{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}])

    def transcript(self, text: str, heard: HeardInput | None = None) -> str:
        """The recognized spoken input: a chunk with no choices (OpenAI readers skip those,
        as they skip the usage chunk), sent as the named SSE event ``transcript``.

        ``heard``: the pieces settled since the last one and how far the audio is
        heard, which a new holder of the session reads back (:func:`heard_of`)."""
        if heard is None or (not heard.pieces and heard.through < 0):
            return self._chunk([], input_transcript=text)
        return self._chunk([], input_transcript=text,
                           heard={"pieces": [list(p) for p in heard.pieces], "through": heard.through})

    def finish(self, finish_reason: str) -> str:
        return self._chunk([{"index": 0, "delta": {}, "finish_reason": finish_reason}])

    def usage(self, usage: Usage) -> str:
        """The extra frame OpenAI sends for ``stream_options.include_usage``."""
        return self._chunk([], usage=usage_dict(usage))

    def completion(self, text: str, finish_reason: str, usage: Usage,
                   tool_calls: list[dict[str, Any]] | None = None,
                   logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The whole answer; ``logprobs``: its tokens' (OpenAI's entries), when the request asked."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message.update(content=text or None, tool_calls=tool_calls)
        return {
            "id": self.session_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": finish_reason,
            }],
            "usage": usage_dict(usage),
        }


class ToolCalls:
    """An answer's function calls, put together from their deltas (for the completion)."""

    def __init__(self, deltas: Iterable[ToolCallDelta] = ()) -> None:
        self._calls: dict[int, dict[str, Any]] = {}
        for delta in deltas:
            self.add(delta)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, delta: ToolCallDelta) -> None:
        call = self._calls.setdefault(delta.index, {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
        if delta.id is not None:
            call["id"] = delta.id
        if delta.name is not None:
            call["function"]["name"] = delta.name
        call["function"]["arguments"] += delta.arguments

    def listed(self) -> list[dict[str, Any]]:
        return [self._calls[i] for i in sorted(self._calls)]

    def by_index(self) -> dict[int, tuple[str, str]]:
        """Each call's name and arguments so far ("" for what has not come), by index."""
        return {i: (call["function"]["name"], call["function"]["arguments"]) for i, call in self._calls.items()}
