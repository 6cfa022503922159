"""Start policies: when a session's engine work opens (RFC 5.1).

The decision itself runs inside the append/finish Lua scripts, where the
counters live; this module names the policies and turns a session's
``min_length`` into the thresholds those scripts compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

#: What ``min_length`` can count: payload bytes, chunks, or audio duration.
MinLengthKind = Literal["bytes", "chunks", "audio_ms"]


class StartPolicy(StrEnum):
    #: Open the engine session as soon as the first chunk is contiguous.
    ON_FIRST_CHUNK = "on_first_chunk"
    #: Open it once enough contiguous input arrived (bytes, chunks or audio ms).
    ON_MIN_LENGTH = "on_min_length"
    #: Buffer until input is complete: the non-streaming baseline.
    ON_END_ONLY = "on_end_only"


@dataclass(frozen=True)
class StartThresholds:
    """Contiguous input needed before the engine opens; 0 means "no limit of this kind"."""

    bytes: int = 0
    chunks: int = 0
    audio_ms: int = 0

    @classmethod
    def for_policy(
        cls, policy: StartPolicy, min_length: Mapping[MinLengthKind, int] | None, default_bytes: int
    ) -> StartThresholds | None:
        """Thresholds for an early policy; ``None`` for ``on_end_only``."""
        if policy is StartPolicy.ON_END_ONLY:
            return None
        if policy is StartPolicy.ON_FIRST_CHUNK:
            return cls(chunks=1)
        if not min_length:
            return cls(bytes=default_bytes)
        return cls(bytes=min_length.get("bytes", 0), chunks=min_length.get("chunks", 0),
                   audio_ms=min_length.get("audio_ms", 0))
