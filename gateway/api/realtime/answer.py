"""One Realtime response: a session's answer frames as OpenAI Realtime response events.

The session writes ``chat.completion.chunk`` frames (``gateway/output``);
this turns them into the event sequence an OpenAI Realtime client expects.
A response's output is items, each opened when its first delta comes and
closed before the next one opens:

    response.created
    a message (text or audio):
      response.output_item.added · conversation.item.added · response.content_part.added
      response.output_text.delta*            (text), or
      response.output_audio_transcript.delta* + response.output_audio.delta*   (audio)
      response.output_text.done | response.output_audio_transcript.done + response.output_audio.done
      response.content_part.done · response.output_item.done · conversation.item.done
    a function call, for each call:
      response.output_item.added · conversation.item.added
      response.function_call_arguments.delta* · response.function_call_arguments.done
      response.output_item.done · conversation.item.done
    response.done                          (status, usage, every output item)

An answer in the conversation adds its items to it as they open (so the
next turn's history has them); an out-of-band one (``conversation: none``)
sends no ``conversation.item.*`` events and adds nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.api.realtime import events as ev
from gateway.api.realtime.conversation import Conversation, public

Send = Callable[[dict[str, Any]], Awaitable[None]]

#: pcm16 mono at 24 kHz: bytes per millisecond.
BYTES_PER_MS = 48


class Answer:
    def __init__(self, send: Send, modalities: list[str], response_id: str,
                 conversation: Conversation | None, metadata: dict[str, str] | None = None,
                 max_output_tokens: int | None = None) -> None:
        self._send = send
        self.response_id = response_id
        self._modalities = modalities
        self._audio = "audio" in modalities
        #: The conversation it adds its items to; ``None``: out of band.
        self._conversation = conversation
        self._metadata = metadata
        self._max_output_tokens = max_output_tokens
        self.items: list[dict[str, Any]] = []
        #: The item receiving deltas (a message, or the call of ``_call_index``).
        self._open: dict[str, Any] | None = None
        self._call_index: int | None = None
        self._text: list[str] = []
        self._spoken: list[list[Any]] = []
        self._audio_ms = 0
        self._usage: dict[str, Any] | None = None
        self._cut_off = False
        self.ended = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [i for i in self.items if i["type"] == "function_call"]

    @property
    def message_id(self) -> str | None:
        return next((i["id"] for i in self.items if i["type"] == "message"), None)

    def saved(self) -> dict[str, Any]:
        """What a reconnect needs to go on with it (the rest is replayed from the frames)."""
        return {"response_id": self.response_id, "modalities": self._modalities,
                "in_conversation": self._conversation is not None, "metadata": self._metadata}

    def _response(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        body = ev.response(self.response_id, status, self._modalities, [public(i) for i in self.items],
                           self._usage, details)
        body["conversation_id"] = "conv_default" if self._conversation is not None else None
        body["max_output_tokens"] = "inf" if self._max_output_tokens is None else self._max_output_tokens
        if self._metadata is not None:
            body["metadata"] = self._metadata
        return body

    async def begin(self) -> None:
        await self._send(ev.event("response.created", response=self._response("in_progress")))

    # --- items ----------------------------------------------------------------

    def _next_item_id(self) -> str:
        # Made from the response's id, so a reconnect's replay names its items as before.
        return f"item_{self.response_id.removeprefix('resp_')}_{len(self.items)}"

    async def _add(self, item: dict[str, Any]) -> None:
        await self._close()
        self.items.append(item)
        self._open = item
        output_index = len(self.items) - 1
        await self._send(ev.event("response.output_item.added", response_id=self.response_id,
                                  output_index=output_index, item=public(item)))
        if self._conversation is not None:
            previous = self._conversation.put(item)
            await self._send(ev.event("conversation.item.added", previous_item_id=previous, item=public(item)))

    def _where(self, item: dict[str, Any] | None = None) -> dict[str, Any]:
        """Where the events of ``item`` (default: the open one, which is the last) belong."""
        item = item or self._open
        assert item is not None
        return {"response_id": self.response_id, "item_id": item["id"], "output_index": self.items.index(item)}

    def _part(self) -> dict[str, Any]:
        if self._audio:
            return {"type": "audio", "transcript": self.text}
        return {"type": "text", "text": self.text}

    async def _message(self) -> None:
        """The message item, opened at its first delta."""
        if self._open is not None and self._open["type"] == "message":
            return
        content: dict[str, Any] = {"type": "output_audio", "transcript": ""} if self._audio \
            else {"type": "output_text", "text": ""}
        await self._add(ev.assistant_item(self._next_item_id(), [content], "in_progress"))
        await self._send(ev.event("response.content_part.added", **self._where(), content_index=0,
                                  part=self._part()))

    async def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "message":
            text, part = self.text, item["content"][0]
            if self._audio:
                part.update(transcript=text, spoken=self._spoken)
                await self._send(ev.event("response.output_audio_transcript.done", **where, content_index=0,
                                          transcript=text))
                await self._send(ev.event("response.output_audio.done", **where, content_index=0))
            else:
                part["text"] = text
                await self._send(ev.event("response.output_text.done", **where, content_index=0, text=text))
            await self._send(ev.event("response.content_part.done", **where, content_index=0, part=self._part()))
        else:
            await self._send(ev.event("response.function_call_arguments.done", **where,
                                      call_id=item["call_id"], name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        await self._send(ev.event("response.output_item.done", response_id=self.response_id,
                                  output_index=where["output_index"], item=public(item)))
        if self._conversation is not None:
            await self._send(ev.event("conversation.item.done", item=public(item)))

    # --- deltas ---------------------------------------------------------------

    async def on_text(self, delta: str) -> None:
        await self._message()
        self._text.append(delta)
        kind = "response.output_audio_transcript.delta" if self._audio else "response.output_text.delta"
        await self._send(ev.event(kind, **self._where(), content_index=0, delta=delta))

    async def on_audio(self, data: str, transcript: str) -> None:
        if not self._audio:
            return
        await self._message()
        self._audio_ms += len(data) * 3 // 4 // BYTES_PER_MS
        if transcript or not self._spoken:
            self._spoken.append([self._audio_ms, transcript])
        else:
            self._spoken[-1][0] = self._audio_ms
        await self._send(ev.event("response.output_audio.delta", **self._where(), content_index=0, delta=data))

    async def on_tool_call(self, call: dict[str, Any]) -> None:
        """One ``tool_calls`` delta of the frames: a new call opens its item, the rest add arguments."""
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index != self._call_index:
            self._call_index = index
            await self._add({"id": self._next_item_id(), "object": "realtime.item", "type": "function_call",
                             "status": "in_progress", "call_id": call.get("id") or ev.new_id("call"),
                             "name": function.get("name") or "", "arguments": ""})
        item = self._open
        assert item is not None
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            await self._send(ev.event("response.function_call_arguments.delta", **self._where(),
                                      call_id=item["call_id"], delta=arguments))

    def on_usage(self, usage: dict[str, Any]) -> None:
        self._usage = ev.usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def on_finish(self, finish_reason: str) -> None:
        """The answer's finish reason: one cut off at ``max_output_tokens`` ends ``incomplete``."""
        self._cut_off = finish_reason == "length"

    async def end(self, status: str = "completed", reason: str | None = None,
                  error: dict[str, Any] | None = None) -> None:
        """Close the open item, then ``response.done``.

        ``status``: completed (incomplete, ``max_output_tokens``, when it was cut off there),
        cancelled (``reason`` client_cancelled or turn_detected) or failed (``error``: the
        envelope's type, code, message).
        """
        if self.ended:
            return
        self.ended = True
        if status == "completed" and self._cut_off:  # as OpenAI: its items are incomplete too
            status, reason = "incomplete", "max_output_tokens"
        await self._close("completed" if status == "completed" else "incomplete")
        details = None if status == "completed" else {"type": status, "reason": reason, "error": error}
        await self._send(ev.event("response.done", response=self._response(status, details)))
