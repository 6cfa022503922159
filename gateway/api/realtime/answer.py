"""One Realtime response: a turn's answer frames as OpenAI Realtime response events.

The session writes ``chat.completion.chunk`` frames (``gateway/output``);
this turns them into the event sequence an OpenAI Realtime client expects:

    response.created
    response.output_item.added · conversation.item.added · response.content_part.added
    response.output_text.delta*            (text only), or
    response.output_audio_transcript.delta* + response.output_audio.delta*   (audio)
    response.output_text.done | response.output_audio_transcript.done + response.output_audio.done
    response.content_part.done · response.output_item.done · conversation.item.done
    response.done                          (status, usage)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.api.realtime import events as ev

Send = Callable[[dict[str, Any]], Awaitable[None]]


class Answer:
    def __init__(self, send: Send, modalities: list[str], response_id: str, item_id: str) -> None:
        self._send = send
        self.response_id = response_id
        self.item_id = item_id
        self._modalities = modalities
        self._audio = "audio" in modalities
        self._text: list[str] = []
        self._usage: dict[str, Any] | None = None
        self.ended = False

    @property
    def text(self) -> str:
        return "".join(self._text)

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict[str, Any]:
        if self._audio:
            return {"type": "audio", "transcript": self.text}
        return {"type": "text", "text": self.text}

    def _item(self, status: str) -> dict[str, Any]:
        content = ({"type": "output_audio", "transcript": self.text} if self._audio
                   else {"type": "output_text", "text": self.text})
        return ev.assistant_item(self.item_id, [content], status)

    async def begin(self) -> None:
        await self._send(ev.event("response.created",
                                  response=ev.response(self.response_id, "in_progress", self._modalities)))
        await self._send(ev.event("response.output_item.added", response_id=self.response_id, output_index=0,
                                  item=self._item("in_progress")))
        await self._send(ev.event("conversation.item.added", item=self._item("in_progress")))
        await self._send(ev.event("response.content_part.added", **self._where(), part=self._part()))

    async def on_text(self, delta: str) -> None:
        self._text.append(delta)
        kind = "response.output_audio_transcript.delta" if self._audio else "response.output_text.delta"
        await self._send(ev.event(kind, **self._where(), delta=delta))

    async def on_audio(self, data: str) -> None:
        if self._audio:
            await self._send(ev.event("response.output_audio.delta", **self._where(), delta=data))

    def on_usage(self, usage: dict[str, Any]) -> None:
        self._usage = ev.usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    async def end(self, status: str = "completed", reason: str | None = None,
                  error: dict[str, Any] | None = None) -> None:
        """Close every open part, then ``response.done``.

        ``status``: completed, cancelled (``reason`` client_cancelled or
        turn_detected) or failed (``error``: the envelope's type, code, message).
        """
        if self.ended:
            return
        self.ended = True
        item_status = "completed" if status == "completed" else "incomplete"
        if self._audio:
            await self._send(ev.event("response.output_audio_transcript.done", **self._where(), transcript=self.text))
            await self._send(ev.event("response.output_audio.done", **self._where()))
        else:
            await self._send(ev.event("response.output_text.done", **self._where(), text=self.text))
        await self._send(ev.event("response.content_part.done", **self._where(), part=self._part()))
        item = self._item(item_status)
        await self._send(ev.event("response.output_item.done", response_id=self.response_id, output_index=0,
                                  item=item))
        await self._send(ev.event("conversation.item.done", item=item))
        details = None if status == "completed" else {"type": status, "reason": reason, "error": error}
        await self._send(ev.event("response.done", response=ev.response(
            self.response_id, status, self._modalities, [item], self._usage, details)))
