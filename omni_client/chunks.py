"""One chunk of input as the gateway's raw append: a body and its ``X-*`` headers.

Raw bodies, not JSON: audio needs no base64, and a retry sends exactly the
same bytes, which is what makes it a duplicate rather than a conflict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_client.audio import pcm16_of_array

#: The rate assumed for raw pcm16 bytes when the caller names none (the gateway's default).
DEFAULT_PCM_RATE = 16_000


@dataclass(frozen=True)
class Chunk:
    modality: str
    body: bytes
    format: str | None = None
    sample_rate: int | None = None

    def headers(self, sequence_id: int, end_of_input: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream", "X-Sequence-Id": str(sequence_id),
                   "X-Modality": self.modality, "X-End-Of-Input": "true" if end_of_input else "false"}
        if self.format:
            headers["X-Format"] = self.format
        if self.sample_rate:
            headers["X-Sample-Rate"] = str(self.sample_rate)
        return headers


def chunk_of(data: Any, sample_rate: int | None = None) -> Chunk:
    """What ``send`` takes, as a chunk.

    - ``str``: text;
    - ``bytes``: a WAV file's bytes if they start with ``RIFF``, else pcm16
      mono at ``sample_rate`` (16 kHz if not given);
    - a numpy array: int16 samples, or floats in [-1, 1], at ``sample_rate``;
    - a path (``pathlib.Path`` or ``os.PathLike``): a WAV file;
    - a :class:`Chunk`: as is.
    """
    if isinstance(data, Chunk):
        return data
    if isinstance(data, str):
        return Chunk("text", data.encode())
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        if raw[:4] == b"RIFF":
            return Chunk("audio", raw, "wav")
        return Chunk("audio", raw, "pcm16", sample_rate or DEFAULT_PCM_RATE)
    if isinstance(data, os.PathLike):
        raw = Path(data).read_bytes()
        if raw[:4] != b"RIFF":
            raise ValueError(f"{data}: not a WAV file (send text as a str)")
        return Chunk("audio", raw, "wav")
    if hasattr(data, "dtype") and hasattr(data, "shape"):
        return Chunk("audio", pcm16_of_array(data), "pcm16", sample_rate or DEFAULT_PCM_RATE)
    raise TypeError(f"cannot send {type(data).__name__}: give str, bytes, a numpy array or a WAV path")
