"""The answer as the client yields it, read from the gateway's SSE frames and its result."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from omni_client.audio import ANSWER_RATE, read_wav
from omni_client.errors import APIError, ServerError, SessionFailed, from_envelope


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class AudioDelta:
    """A piece of the spoken answer: pcm16 mono at ``sample_rate``."""

    data: bytes
    transcript: str = ""
    sample_rate: int = ANSWER_RATE


@dataclass(frozen=True)
class Transcript:
    """What the gateway has heard of the audio input so far (grows while it arrives)."""

    text: str


@dataclass(frozen=True)
class Finished:
    reason: str


@dataclass(frozen=True)
class UsageReport:
    prompt_tokens: int
    completion_tokens: int


AnswerEvent = TextDelta | AudioDelta | Transcript | Finished | UsageReport


@dataclass(frozen=True)
class SseEvent:
    id: str | None
    event: str | None
    data: str


class SseParser:
    """Server-sent events from lines (the blank line ends an event; ``:`` lines are pings)."""

    def __init__(self) -> None:
        self._fields: dict[str, str] = {}
        self._data: list[str] = []

    def line(self, line: str) -> SseEvent | None:
        if line:
            if not line.startswith(":"):
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "data":
                    self._data.append(value)
                else:
                    self._fields[name] = value
            return None
        event = SseEvent(self._fields.get("id"), self._fields.get("event"), "\n".join(self._data)) \
            if self._data else None
        self._fields, self._data = {}, []
        return event


#: Errors a gateway ends a stream with while the session goes on, so the stream is resumed,
#: not failed: its replica stopped before the answer did, or its Redis stayed away too long.
#: A gateway marks them ``resumable``; older ones did not, and said ``store_unavailable``
#: at any Redis hiccup.
RESUMABLE_CODES = frozenset({"replica_stopping", "store_unavailable"})


def resumable_end(sse: SseEvent) -> APIError | None:
    """The error that ended the stream, not the session (read on from the last event id); else None.

    Such an error is the gateway's word about this stream, so it has no id;
    a session's own failure is one of its frames, with an id, and is final.
    """
    if sse.event != "error" or sse.id is not None:
        return None
    envelope = _json(sse.data)
    error = envelope.get("error")
    if not isinstance(error, dict) or not (error.get("resumable") is True or error.get("code") in RESUMABLE_CODES):
        return None
    return from_envelope(ServerError, 503, envelope)


def events_of(sse: SseEvent) -> list[AnswerEvent]:
    """One frame's answer events; an ``error`` event raises :class:`SessionFailed`."""
    if sse.event == "error":
        raise from_envelope(SessionFailed, 0, _json(sse.data))
    if sse.data == "[DONE]":
        return []
    frame = _json(sse.data)
    if sse.event == "transcript":
        return [Transcript(str(frame.get("input_transcript") or ""))]
    found: list[AnswerEvent] = []
    for choice in frame.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            found.append(TextDelta(delta["content"]))
        if audio := delta.get("audio"):
            found.append(AudioDelta(base64.b64decode(audio.get("data") or ""), audio.get("transcript") or ""))
        if choice.get("finish_reason"):
            found.append(Finished(choice["finish_reason"]))
    if usage := frame.get("usage"):
        found.append(UsageReport(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)))
    return found


@dataclass(frozen=True)
class Result:
    """A session's outcome (``GET .../result``); ``completion`` is the raw ``chat.completion``."""

    session_id: str
    state: str
    text: str = ""
    finish_reason: str | None = None
    #: The spoken answer as pcm16 mono at ``sample_rate`` (empty when not spoken).
    audio: bytes = b""
    sample_rate: int = ANSWER_RATE
    input_transcript: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    completion: dict[str, Any] | None = None


def result_of(body: dict[str, Any]) -> Result:
    """A terminal result; a failed or expired session raises :class:`SessionFailed`."""
    if body.get("error"):
        raise from_envelope(SessionFailed, 0, {"error": body["error"]})
    completion = body.get("completion")
    message: dict[str, Any] = {}
    finish_reason = None
    if completion and completion.get("choices"):
        message = completion["choices"][0].get("message") or {}
        finish_reason = completion["choices"][0].get("finish_reason")
    audio, rate = b"", ANSWER_RATE
    if (spoken := message.get("audio")) and spoken.get("data"):
        audio, rate = read_wav(base64.b64decode(spoken["data"]))
    return Result(body["session_id"], body["state"], message.get("content") or "", finish_reason, audio, rate,
                  body.get("input_transcript"), (completion or {}).get("usage") or {}, completion)


def _json(data: str) -> dict[str, Any]:
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
