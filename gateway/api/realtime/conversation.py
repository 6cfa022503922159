"""A Realtime conversation's items, and the chat history the model sees of them.

Items are kept in OpenAI's shapes (``message`` of a role, ``function_call``,
``function_call_output``), without audio bytes: an audio part keeps its
transcript and its length, which is what the model is given and what a
truncation cuts. ``previous_item_id`` places an item (``root``: first);
``delete``, ``retrieve`` and ``truncate`` act on them by id.

``messages`` turns items into the chat history of the next answer;
``without_oldest`` is what truncation keeps (the connection decides how
many to drop; the instructions are not items and always stay). Keys that
start with ``_`` are the gateway's own (what the recognizer heard in a user's
audio item: the history has it even when the client asked for no transcription).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from gateway import errors
from gateway.service.models import ChatMessage, ToolCall

#: ``previous_item_id`` that places an item first.
ROOT = "root"


class Conversation:
    def __init__(self, items: Iterable[dict[str, Any]] = ()) -> None:
        self.items: list[dict[str, Any]] = list(items)

    # --- the items -----------------------------------------------------------

    def last_id(self) -> str | None:
        return self.items[-1]["id"] if self.items else None

    def index(self, item_id: str) -> int | None:
        return next((i for i, item in enumerate(self.items) if item["id"] == item_id), None)

    def add(self, item: dict[str, Any], previous_item_id: str | None = None) -> str | None:
        """Place ``item`` after ``previous_item_id`` (default: last); returns the id before it."""
        if any(other["id"] == item["id"] for other in self.items):
            raise errors.InvalidRequest(f"an item with id {item['id']!r} is already in the conversation",
                                        param="item.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == ROOT:
            at = 0
        elif (found := self.index(previous_item_id)) is not None:
            at = found + 1
        else:
            raise errors.ItemNotFound(f"no item {previous_item_id!r} to place this item after",
                                      param="previous_item_id")
        self.items.insert(at, item)
        return self.items[at - 1]["id"] if at else None

    def put(self, item: dict[str, Any]) -> str | None:
        """Add ``item`` at the end, or in its place when one with its id is there (an answer
        replayed after a reconnect); returns the id before it."""
        found = self.index(item["id"])
        if found is None:
            return self.add(item)
        self.items[found] = item
        return self.items[found - 1]["id"] if found else None

    def get(self, item_id: str, not_found: type[errors.ItemNotFound] = errors.ItemNotFound) -> dict[str, Any]:
        found = self.index(item_id)
        if found is None:
            raise not_found(f"no item {item_id!r} in the conversation", param="item_id")
        return self.items[found]

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id, errors.ItemDeleteNotFound))

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> int:
        """Cut an assistant audio part to what was heard; returns the end kept (clamped to its length).

        The part's transcript keeps the words spoken up to ``audio_end_ms``
        (sentences by their audio, words within a sentence by their share of
        its time), so the next answer's history says only what the user heard.
        """
        item = self.get(item_id, errors.ItemTruncateNotFound)
        parts = item.get("content") or []
        if item.get("role") == "assistant" and not 0 <= content_index < len(parts):
            raise errors.InvalidRequest(f"content_index {content_index} is not a part of the item (it has "
                                        f"{len(parts)})", param="content_index")
        if item.get("role") != "assistant" or parts[content_index].get("type") != "output_audio":
            raise errors.InvalidRequest("only an assistant message's audio can be truncated",
                                        param="content_index")
        part = parts[content_index]
        spoken: list[list[Any]] = part.get("spoken") or []
        total = spoken[-1][0] if spoken else 0
        end = max(0, min(audio_end_ms, total))
        part["transcript"] = heard(spoken, end)
        part["spoken"] = [[end, part["transcript"]]]  # what is left: all of it heard, by ``end``
        return end

    # --- the history the model sees -------------------------------------------

    def messages(self, items: Iterable[dict[str, Any]] | None = None) -> list[ChatMessage]:
        """The chat history of ``items`` (default: all): calls join the assistant's message."""
        out: list[ChatMessage] = []
        for item in self.items if items is None else items:
            if item["type"] == "message":
                text = item_text(item)
                if text:
                    out.append(ChatMessage(role=item["role"], content=text))
            elif item["type"] == "function_call":
                call = ToolCall(id=item["call_id"], function={"name": item["name"], "arguments": item["arguments"]})
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls is not None:
                    last.tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif item["type"] == "function_call_output":
                out.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
        return out

    def keep_last(self, count: int) -> None:
        """Drop all but the newest ``count`` items."""
        del self.items[:max(0, len(self.items) - count)]

    def keep_only(self, kept: list[dict[str, Any]], of: list[dict[str, Any]]) -> None:
        """Drop the items of ``of`` that ``kept`` leaves out (truncation)."""
        gone = {i["id"] for i in of} - {i["id"] for i in kept}
        self.items = [i for i in self.items if i["id"] not in gone]

    def to_json(self) -> str:
        return json.dumps(self.items)

    @classmethod
    def from_json(cls, text: str) -> Conversation:
        return cls(json.loads(text))


def without_oldest(items: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The items after the oldest ``count`` (the outputs of dropped calls go with them)."""
    gone_calls = {i["call_id"] for i in items[:count] if i["type"] == "function_call"}
    return [i for i in items[count:] if not (i["type"] == "function_call_output" and i["call_id"] in gone_calls)]


def item_text(item: dict[str, Any]) -> str:
    """What a message item says: its texts and audio transcripts (what was heard, for the user's), joined."""
    said = [part.get("text") or part.get("transcript") or
            (item.get("_heard", "") if part.get("type") == "input_audio" else "")
            for part in item.get("content") or ()]
    return " ".join(s for s in said if s)


def heard(spoken: list[list[Any]], end_ms: int) -> str:
    """The words of ``spoken`` ([end ms, text] per sentence) heard by ``end_ms``."""
    said, start = [], 0
    for until, text in spoken:
        if until <= end_ms:
            said.append(text)
        elif end_ms > start:
            words = text.split()
            said.append(" ".join(words[:len(words) * (end_ms - start) // (until - start)]))
            break
        else:
            break
        start = until
    return " ".join(s for s in said if s).strip()


def public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as events show it (our bookkeeping, the spoken timeline, left out)."""
    shown = {k: v for k, v in item.items() if not k.startswith("_")}
    if "content" in shown:
        shown["content"] = [{k: v for k, v in part.items() if k != "spoken"} for part in shown["content"]]
    return shown
