"""A file as paced chunks: text cut by words or characters, a WAV cut by duration."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omni_client.audio import read_wav
from omni_client.chunks import Chunk


class InputError(Exception):
    """The input file cannot be streamed (missing, unreadable, empty, not what it claims)."""


@dataclass(frozen=True)
class PacedChunk:
    chunk: Chunk
    #: When the chunk is ready, in seconds from the start: audio once it has been
    #: "spoken" (the end of its span), text at its turn of the pace.
    ready_at: float


def load(path: str, *, chunk_ms: int, words: int, chars: int | None) -> tuple[list[PacedChunk], str]:
    """The file's chunks and its kind (``text`` / ``audio``); ``-`` reads text from stdin."""
    if path == "-":
        return text_chunks(sys.stdin.read(), chunk_ms, words, chars), "text"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if path.lower().endswith(".wav") or data[:4] == b"RIFF":
        return audio_chunks(data, path, chunk_ms), "audio"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is neither UTF-8 text nor a WAV file") from exc
    return text_chunks(text, chunk_ms, words, chars, path), "text"


def text_chunks(text: str, chunk_ms: int, words: int, chars: int | None, name: str = "stdin") -> list[PacedChunk]:
    if not text.strip():
        raise InputError(f"{name} is empty")
    if chars:
        pieces = [text[i:i + chars] for i in range(0, len(text), chars)]
    else:
        # Each word keeps the whitespace after it, so the chunks join back to the text exactly.
        tokens = re.findall(r"\s*\S+\s*", text)
        pieces = ["".join(tokens[i:i + words]) for i in range(0, len(tokens), words)]
    return [PacedChunk(Chunk("text", piece.encode()), i * chunk_ms / 1000) for i, piece in enumerate(pieces)]


def audio_chunks(data: bytes, name: str, chunk_ms: int) -> list[PacedChunk]:
    try:
        pcm, rate = read_wav(data)
    except ValueError as exc:
        raise InputError(f"{name}: {exc}") from exc
    if not pcm:
        raise InputError(f"{name} holds no audio")
    step = max(2, rate * chunk_ms // 1000 * 2)
    return [PacedChunk(Chunk("audio", pcm[i:i + step], "pcm16", rate), min(i + step, len(pcm)) / 2 / rate)
            for i in range(0, len(pcm), step)]
