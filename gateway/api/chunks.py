"""Turn a chunk as the client sent it (JSON or raw bytes) into a stored record.

Both forms end as the same ``ChunkRecord``, so dedupe compares the bytes the
client meant, whichever way they came.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import wave
from collections.abc import Mapping

from pydantic import ValidationError
from starlette.requests import Request

from gateway import errors
from gateway.service.models import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, ChunkIn, not_unicode
from gateway.settings import Settings
from gateway.store.records import ChunkRecord
from gateway.web.validation import read_body_capped, validation_error
from omni_adapter.port import Modality

PCM16_DEFAULT_RATE = 16_000
#: Chunk bodies from this size on are read into a record in a worker thread.
OFF_LOOP_BYTES = 256 * 1024
#: Base64 characters decoded per call (a multiple of 4: each slice decodes alone).
B64_SLICE = 1 << 20
RAW_MODALITIES: tuple[Modality, ...] = ("text", "audio", "image", "video")
#: The audio a chunk may carry (any case): what every engine reads (``omni_adapter/audio.py``).
AUDIO_CHUNK_FORMATS = frozenset({"pcm16", "pcm", "wav"})


def _ascii_int(value: str) -> int | None:
    """A plain decimal number, or None: ``str.isdigit`` also takes "²" and "٣"."""
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None


async def read_chunk(request: Request, settings: Settings) -> ChunkRecord:
    """The chunk in a request body: JSON, or raw bytes described by headers.

    A big body (``OFF_LOOP_BYTES`` or more) is parsed, decoded and hashed in a
    worker thread, base64 a slice at a time: a 16 MiB chunk is 0.1-0.3 s of
    that work, which on the event loop would hold up every other session.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/octet-stream":
        body = await read_body_capped(request, settings.max_chunk_bytes)
        if len(body) < OFF_LOOP_BYTES:
            return record_from_raw(request.headers, body, settings.max_chunk_bytes)
        headers = dict(request.headers)
        return await asyncio.to_thread(lambda: record_from_raw(headers, body, settings.max_chunk_bytes).prepared())
    if content_type in ("application/json", ""):
        body = await read_body_capped(request, settings.max_request_bytes)
        if len(body) < OFF_LOOP_BYTES:
            return _json_record(body, settings.max_chunk_bytes)
        return await asyncio.to_thread(lambda: _json_record(body, settings.max_chunk_bytes).prepared())
    raise errors.InvalidRequest("send chunks as application/json or application/octet-stream",
                                param="Content-Type")


def _json_record(body: bytes, max_chunk_bytes: int) -> ChunkRecord:
    try:
        parsed = ChunkIn.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc
    return record_from_json(parsed, max_chunk_bytes)


def b64decode_in_slices(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)``, a slice at a time: in a worker thread the
    event loop gets the interpreter between slices (one call on 21 MB held it ~0.1 s)."""
    if len(text) <= B64_SLICE:
        return base64.b64decode(text, validate=True)
    return b"".join(base64.b64decode(text[i:i + B64_SLICE], validate=True) for i in range(0, len(text), B64_SLICE))


def record_from_json(chunk: ChunkIn, max_chunk_bytes: int) -> ChunkRecord:
    if chunk.text is not None:
        try:
            data = chunk.text.encode()
        except UnicodeEncodeError as exc:  # JSON's \ud800 escapes parse into a str UTF-8 cannot hold
            raise not_unicode("text") from exc
    else:
        try:
            data = b64decode_in_slices(chunk.payload or "")
        except (binascii.Error, ValueError) as exc:
            raise errors.InvalidPayload("payload is not valid base64", param="payload") from exc
    return _record(chunk.sequence_id, chunk.modality, data, chunk.format, chunk.mime_type,
                   chunk.sample_rate, chunk.end_of_input, max_chunk_bytes)


def record_from_raw(headers: Mapping[str, str], body: bytes, max_chunk_bytes: int) -> ChunkRecord:
    """A raw ``application/octet-stream`` chunk described by ``X-*`` headers."""
    seq = _ascii_int(headers.get("x-sequence-id", ""))
    if seq is None:
        raise errors.ValidationFailed("X-Sequence-Id must be an integer >= 0", param="X-Sequence-Id")
    modality = next((m for m in RAW_MODALITIES if m == headers.get("x-modality", "text")), None)
    if modality is None:
        raise errors.ValidationFailed(f"X-Modality must be one of {', '.join(RAW_MODALITIES)}",
                                      param="X-Modality")
    end = headers.get("x-end-of-input", "false").lower()
    if end not in ("true", "false", "1", "0"):
        raise errors.ValidationFailed("X-End-Of-Input must be true or false", param="X-End-Of-Input")
    raw_rate = headers.get("x-sample-rate")
    rate = None if raw_rate is None else _ascii_int(raw_rate)
    if raw_rate is not None and not (rate and MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE):
        raise errors.ValidationFailed(f"X-Sample-Rate must be an integer from {MIN_SAMPLE_RATE} to "
                                      f"{MAX_SAMPLE_RATE}", param="X-Sample-Rate")
    return _record(seq, modality, body, headers.get("x-format"), headers.get("x-mime-type"),
                   rate, end in ("true", "1"), max_chunk_bytes)


def _record(seq: int, modality: Modality, data: bytes, fmt: str | None, mime: str | None,
            rate: int | None, end: bool, max_chunk_bytes: int) -> ChunkRecord:
    if len(data) > max_chunk_bytes:
        raise errors.ChunkTooLarge(
            f"chunk of {len(data)} bytes exceeds the per-chunk cap of {max_chunk_bytes} bytes")
    if not data:
        raise errors.InvalidPayload("a chunk carries at least one byte", param="payload")
    audio_ms = 0
    if modality == "audio":
        kind = (fmt or "pcm16").lower()
        if kind not in AUDIO_CHUNK_FORMATS:
            # Refused here, not by the engine once the input is whole (with every chunk before it).
            raise errors.InvalidPayload(f"audio chunks are pcm16 or wav, not {kind[:32]!r}", param="format")
        audio_ms = _audio_ms(data, kind == "wav", rate)
        if kind != "wav" and rate is None:
            rate = PCM16_DEFAULT_RATE
    return ChunkRecord(seq, modality, data, fmt, mime, rate, end, audio_ms)


def check_file_rate(rate: int, source: str, param: str) -> None:
    """An audio file's own sample rate, as a chunk's is bounded: a rate of 1 Hz would be resampled
    16,000-fold (and a 2 KB file at 4 Hz would be heard, and billed, as 250 s)."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise errors.InvalidPayload(f"{source} gives a sample rate of {rate} Hz; {MIN_SAMPLE_RATE} to "
                                    f"{MAX_SAMPLE_RATE} are taken", param=param)


def _audio_ms(data: bytes, is_wav: bool, rate: int | None) -> int:
    """Duration of an audio chunk (a WAV file, or pcm16), for ``min_length: {"audio_ms": N}``."""
    if is_wav:
        try:
            with wave.open(io.BytesIO(data)) as wav:
                frames, rate, width = wav.getnframes(), wav.getframerate(), wav.getsampwidth()
        except (wave.Error, EOFError, ValueError) as exc:
            raise errors.InvalidPayload("audio payload is not a valid WAV file", param="payload") from exc
        check_file_rate(rate, "the WAV header", "payload")
        if width != 2:
            raise errors.InvalidPayload(f"WAV audio must be 16-bit PCM, not {8 * width}-bit", param="payload")
        return int(frames * 1000 / rate)
    if len(data) % 2:  # pcm16
        raise errors.InvalidPayload("pcm16 audio holds whole 16-bit samples: an even byte count",
                                    param="payload")
    return int(len(data) / 2 * 1000 / (rate or PCM16_DEFAULT_RATE))
