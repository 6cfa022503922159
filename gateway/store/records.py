"""What the store keeps and returns: chunk records, frames, leases and script outcomes.

The session's meta hash is ``session_hash``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway.domain.states import SessionState
from omni_adapter.port import Modality


@dataclass(frozen=True)
class ChunkRecord:
    """One input chunk as stored: a JSON header line, then the raw payload."""

    sequence_id: int
    modality: Modality
    payload: bytes
    format: str | None = None
    mime_type: str | None = None
    sample_rate: int | None = None
    end_of_input: bool = False
    #: Duration of audio input, for ``min_length: {"audio_ms": N}``.
    audio_ms: int = 0
    #: The fewest prompt tokens this chunk adds (0 when the engine cannot say):
    #: counted against the model's context before the chunk is stored.
    min_tokens: int = 0
    #: The sha256 of header and payload, and the stored blob, when made ahead
    #: (``prepared``): a big chunk's are made in a worker thread, not on the event loop.
    content_sha256: str = field(default="", compare=False)
    blob: bytes = field(default=b"", compare=False, repr=False)

    def _header(self) -> dict[str, Any]:
        return {
            "m": self.modality,
            "f": self.format,
            "t": self.mime_type,
            "r": self.sample_rate,
            "e": self.end_of_input,
            "a": self.audio_ms,
        }

    def to_blob(self) -> bytes:
        # json.dumps never emits a raw newline, so the first one ends the header.
        return self.blob or json.dumps(self._header(), separators=(",", ":")).encode() + b"\n" + self.payload

    @classmethod
    def from_blob(cls, sequence_id: int, blob: bytes) -> ChunkRecord:
        header, _, payload = blob.partition(b"\n")
        h = json.loads(header)
        return cls(sequence_id, h["m"], payload, h["f"], h["t"], h["r"], h["e"], h["a"])

    def _content_sha256(self) -> str:
        sha = hashlib.sha256(json.dumps(self._header(), sort_keys=True).encode())
        sha.update(self.payload)
        return sha.hexdigest()

    def prepared(self) -> ChunkRecord:
        """This record with its hash and blob made now (where the time is no one's wait)."""
        return dataclasses.replace(self, content_sha256=self._content_sha256(), blob=self.to_blob())

    @property
    def content_digest(self) -> str:
        """The sha256 of header and payload: what dedupe compares."""
        return self.content_sha256 or self._content_sha256()

    def digest_record(self) -> str:
        """``<sha256>:<bytes>:<audio ms>:<min tokens>``: identity for dedupe, sizes for counting."""
        return f"{self.content_digest}:{len(self.payload)}:{self.audio_ms}:{self.min_tokens}"


@dataclass(frozen=True)
class InputOutcome:
    """The result of a create / append / finish that was accepted."""

    state: SessionState
    previous_state: SessionState
    #: True when this call started the session's engine work.
    started: bool
    next_sequence_id: int
    duplicate: bool = False
    missing_sequence_ids: list[int] = field(default_factory=list)
    #: Set when the calling replica took the lease on that work with this call.
    lease: Lease | None = None
    #: Engine work started earlier has no live owner: schedule it again.
    unowned: bool = False
    #: An accepted append: the token mark kept for its sequence id, if any
    #: (update mode counts tokens along the input: service/token_marks.py).
    token_mark: str | None = None


@dataclass(frozen=True)
class Lease:
    """A replica's hold on one session's engine work; ``epoch`` fences off older holders."""

    replica: str
    epoch: int


class Renewal(Enum):
    """What renewing a lease found."""

    RENEWED = "renewed"
    #: Someone else holds the work now (another replica claimed it, or it was released or parked).
    TAKEN = "taken"
    #: The session ended (or its keys expired): the work has nothing left to do.
    ENDED = "ended"


def event_id_key(event_id: str) -> tuple[int, int]:
    """A frame id ("<ms>-<seq>") in stream order; as strings "9-0" would sort after "10-0"."""
    ms, seq = event_id.split("-")
    return int(ms), int(seq)


@dataclass(frozen=True)
class Frame:
    """One SSE frame as stored in the output stream."""

    id: str
    event: str
    data: str
    #: The stream ends after this frame ([DONE] or an error).
    last: bool
