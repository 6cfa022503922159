"""Token counts kept along a session's text input, so an update tokenizes only what it changes.

A replacement (update mode) answers with the tokens of the streamed input it
keeps and the tokens of the new input. Tokenizing the whole input for that
on every PUT costs O(input) per PUT, O(input²) over a session that keeps
updating. Counts per chunk cannot simply be summed: BPE merges across chunk
boundaries (``"Hel" + "lo"`` is one token). What does compose is a count up
to a *settled* point: a pre-token boundary no later text can move (the
boundaries the streaming tokenizer commits at while feeding the engine,
``omni_adapter/text_stream.py``). For every text

    tokens(text) == tokens(text[:settled]) + tokens(text[settled:])

So a mark, kept for a sequence id ``j``, holds the tokens of the input up to
the last settled point before chunk ``j`` and the bytes from there to chunk
``j`` (``pending``: usually the last word or two of chunk ``j - 1``). A
replacement of chunk ``j`` then counts ``mark.tokens`` plus the tokens of
``pending`` and the chunks from ``j`` on, old and new: work in proportion to
the replaced chunk and what follows it.

Marks are hints kept beside the chunks' digests (``store/lua/mark_tokens.lua``),
written only while the chunks they were counted from are unchanged; the
first replacement of a session counts from the start and marks every chunk,
and from then on each append marks the next one. Where a mark is missing (a
session from before marks, a chunk that arrived out of order, text with no
settled point for :data:`MAX_PENDING_BYTES`) the count starts from the
beginning again: slower, never different.
"""

from __future__ import annotations

import base64
import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.store.records import ChunkRecord
from omni_adapter.port import RequestChecks

#: A mark whose pending text grew this long (a base64 blob, one endless word)
#: is not kept: storing it with every chunk would cost more than counting again.
MAX_PENDING_BYTES = 8192


@dataclass(frozen=True)
class TokenMark:
    """The tokens of the input up to a settled point, and the bytes from there on."""

    tokens: int
    #: Input after the settled point, as bytes: a chunk may end inside a character.
    pending: bytes = b""

    def to_field(self) -> str:
        """``<tokens>:<pending, base64>``, as stored."""
        return f"{self.tokens}:{base64.b64encode(self.pending).decode()}"

    @classmethod
    def from_field(cls, value: str) -> TokenMark:
        tokens, _, pending = value.partition(":")
        return cls(int(tokens), base64.b64decode(pending))

    @property
    def keepable(self) -> bool:
        return len(self.pending) <= MAX_PENDING_BYTES


#: The mark of sequence id 0: nothing before it.
START = TokenMark(0)


def advance(checks: RequestChecks, mark: TokenMark, payload: bytes) -> TokenMark:
    """The mark after one more chunk: only ``pending`` and the chunk are tokenized."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(mark.pending + payload)
    chars, tokens = checks.settled_tokens(text)
    # Bytes of a character the chunk ends inside stay bytes, for the next chunk.
    undecoded: bytes = decoder.getstate()[0]
    return TokenMark(mark.tokens + tokens, text[chars:].encode() + undecoded)


def marks_along(checks: RequestChecks, mark: TokenMark, payloads: Sequence[bytes]) -> list[TokenMark]:
    """The marks after each of ``payloads`` in turn, starting from ``mark``."""
    marks = []
    for payload in payloads:
        mark = advance(checks, mark, payload)
        marks.append(mark)
    return marks


def kept_and_total(checks: RequestChecks, mark: TokenMark, old_tail: bytes, new_tail: bytes) -> tuple[int, int]:
    """Tokens the old and new input share at their start, and the new input's tokens,
    where both are the text before ``mark`` followed by their tail."""
    old = (mark.pending + old_tail).decode("utf-8", errors="replace")
    new = (mark.pending + new_tail).decode("utf-8", errors="replace")
    kept, total = checks.common_prefix_tokens(old, new)
    return mark.tokens + kept, mark.tokens + total


def count_update(checks: RequestChecks, mark: TokenMark, stored: Sequence[ChunkRecord],
                 replacement: ChunkRecord) -> tuple[int, int, list[tuple[str, TokenMark]]]:
    """Kept and new tokens of a replacement, and the marks after each chunk of the new input.

    ``mark`` is the mark of ``stored[0]`` (or of the replaced chunk, when
    ``stored`` is empty); ``stored`` runs to the end of the contiguous input.
    The marks come as (the chunk's content sha256, the mark after it).
    """
    new = [replacement if c.sequence_id == replacement.sequence_id else c for c in stored]
    at = next((i for i, c in enumerate(stored) if c.sequence_id == replacement.sequence_id), len(stored))
    marks = marks_along(checks, mark, [c.payload for c in new])
    kept, total = kept_and_total(checks, marks[at - 1] if at else mark,
                                 b"".join(c.payload for c in stored[at:]), b"".join(c.payload for c in new[at:]))
    return kept, total, [(c.content_digest, m) for c, m in zip(new, marks, strict=True)]
