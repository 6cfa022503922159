"""The Realtime WebSocket's audio formats: pcm16 at 24 kHz, and G.711 for telephony.

The protocol's own format, ``audio/pcm`` (pcm16 mono at 24 kHz), is what the
connection hears and speaks. A session may set ``audio/pcmu`` (G.711 μ-law) or
``audio/pcma`` (A-law) at 8 kHz for its input, its output or both, as a phone
bridge does: a Twilio Media Stream carries μ-law at 8 kHz, and OpenAI's
telephony examples hand it to the Realtime API as it comes. Here the WebSocket
transport translates (the session decides nothing about it):

    input_audio_buffer.append, input_audio parts (pcmu) ─► decode (libavcodec, via PyAV) ─► 8 → 24 kHz (soxr) ─► the connection
    response.output_audio.delta ◄─ encode ◄─ 24 → 8 kHz ◄─ the connection's pcm16

Each direction keeps its resampler's state across events, so the audio is
resampled as one stream; an answer's last ~15 ms, still in the filter at its
end, go out as one more delta before its ``response.output_audio.done``. A WebRTC call's audio is its RTP codec's (Opus, as
negotiated), whatever the session says. Other formats are refused in
``session.update`` (``config.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fractions
from typing import Any, Literal

import numpy as np

from gateway.api.realtime import events as ev
from omni_adapter.audio import StreamResampler

PCM = "audio/pcm"
PCMU = "audio/pcmu"
PCMA = "audio/pcma"
FORMATS = (PCM, PCMU, PCMA)
#: The beta protocol's names (``input_audio_format``, ``output_audio_format``).
BETA_NAMES = {"pcm16": PCM, "g711_ulaw": PCMU, "g711_alaw": PCMA}
#: The protocol's pcm16 rate, and G.711's.
PCM_RATE = 24_000
G711_RATE = 8_000
_CODECS: dict[str, Literal["pcm_mulaw", "pcm_alaw"]] = {PCMU: "pcm_mulaw", PCMA: "pcm_alaw"}


def format_object(kind: str) -> dict[str, Any]:
    """A format as the GA session object shows it."""
    return {"type": kind, "rate": PCM_RATE} if kind == PCM else {"type": kind}


def _codec(kind: str, mode: Literal["r", "w"]) -> Any:
    from av import CodecContext

    codec = CodecContext.create(_CODECS[kind], mode)
    codec.format, codec.layout, codec.sample_rate = "s16", "mono", G711_RATE
    if mode == "w":
        codec.time_base = fractions.Fraction(1, G711_RATE)
    return codec


class G711Decoder:
    """A session's G.711 input as the pcm16 at 24 kHz the connection hears."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._codec = _codec(kind, "r")
        self._resampler = StreamResampler(PCM_RATE)

    def pcm(self, encoded: bytes) -> bytes:
        from av.packet import Packet

        if not encoded:
            return b""
        frames = self._codec.decode(Packet(encoded))
        samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames]).astype("<i2")
        return self._resampler.push(samples.tobytes(), G711_RATE).tobytes()

    def flush(self) -> bytes:
        """The end of a recording: what the resampler's filter still holds."""
        return self._resampler.flush().tobytes()


class G711Encoder:
    """The connection's pcm16 at 24 kHz as a session's G.711 output."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._codec = _codec(kind, "w")
        self._resampler = StreamResampler(G711_RATE)

    def encode(self, pcm: bytes) -> bytes:
        return self._encoded(self._resampler.push(pcm, PCM_RATE))

    def flush(self) -> bytes:
        """The end of one answer's audio: what the resampler's filter still holds (~15 ms)."""
        return self._encoded(self._resampler.flush())

    def _encoded(self, samples: np.ndarray) -> bytes:
        from av import AudioFrame

        if not len(samples):
            return b""
        frame = AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype="<i2").reshape(1, -1), format="s16",
                                        layout="mono")
        frame.sample_rate = G711_RATE
        return b"".join(bytes(packet) for packet in self._codec.encode(frame))


class Transcoder:
    """The WebSocket's audio translation for one connection; pcm16 passes untouched."""

    def __init__(self) -> None:
        self._decoder: G711Decoder | None = None
        self._encoder: G711Encoder | None = None

    async def client_event(self, message: dict[str, Any], input_format: str) -> dict[str, Any]:
        """The audio of an ``input_audio_buffer.append``, or of a user item's ``input_audio``
        parts, in G.711 as pcm16; anything else as it came (bad audio too: the connection
        refuses it with its own error). A big event is translated in a worker thread: the
        event cap holds over three minutes of μ-law, about 50 ms to decode, resample and
        encode again, while every other session waits on the event loop."""
        if input_format == PCM:
            return message
        if _audio_chars(message) < OFF_LOOP_CHARS:
            return self._translated(message, input_format)
        return await asyncio.to_thread(self._translated, message, input_format)

    def _translated(self, message: dict[str, Any], input_format: str) -> dict[str, Any]:
        kind = message.get("type")
        if kind == "input_audio_buffer.append":
            if self._decoder is None or self._decoder.kind != input_format:
                self._decoder = G711Decoder(input_format)
            return {**message, "audio": _as_pcm(message.get("audio"), self._decoder, whole=False)}
        item = message.get("item")
        if kind == "conversation.item.create" and isinstance(item, dict) and isinstance(item.get("content"), list):
            # Each part is a recording of its own: a decoder (and resampler) of its own.
            parts = [{**part, "audio": _as_pcm(part.get("audio"), G711Decoder(input_format), whole=True)}
                     if isinstance(part, dict) and part.get("type") == "input_audio" else part
                     for part in item["content"]]
            return {**message, "item": {**item, "content": parts}}
        return message

    def server_events(self, event: dict[str, Any], output_format: str) -> list[dict[str, Any]]:
        """``event`` as sent: a ``response.output_audio.delta`` in the session's output format, and
        the answer's last audio (the resampler's tail) as one more delta before its ``done``."""
        kind = event.get("type")
        if kind == "response.created":
            self._encoder = None  # a new answer: nothing of a cut one (barge-in) is left to say
        if output_format == PCM or kind not in ("response.output_audio.delta", "response.output_audio.done"):
            return [event]
        if self._encoder is None or self._encoder.kind != output_format:
            self._encoder = G711Encoder(output_format)
        if kind == "response.output_audio.delta":
            encoded = self._encoder.encode(base64.b64decode(event["delta"]))
            return [{**event, "delta": base64.b64encode(encoded).decode()}]
        tail = self._encoder.flush()
        if not tail:
            return [event]
        where = {k: event[k] for k in ("response_id", "item_id", "output_index", "content_index") if k in event}
        return [ev.event("response.output_audio.delta", **where, delta=base64.b64encode(tail).decode()), event]


#: Events carrying this much base64 G.711 from on (24 s of μ-law, ~5 ms of work) are translated
#: off the loop, as the connection decodes big pcm16 appends (``connection.OFF_LOOP_CHARS``).
OFF_LOOP_CHARS = 256 * 1024


def _audio_chars(message: dict[str, Any]) -> int:
    """How much base64 audio an event carries: its own, or its item's parts'."""
    audio = message.get("audio")
    item = message.get("item")
    parts = item.get("content") if isinstance(item, dict) else None
    pieces = [audio, *(part.get("audio") for part in parts if isinstance(part, dict))] if isinstance(parts, list) \
        else [audio]
    return sum(len(piece) for piece in pieces if isinstance(piece, str))


def _as_pcm(audio: Any, decoder: G711Decoder, *, whole: bool) -> Any:
    """Base64 G.711 as base64 pcm16 at 24 kHz (``whole``: a recording, to its last sample; else
    a piece of a stream, the filter's tail coming with the next); not base64: as it came."""
    if not isinstance(audio, str):
        return audio
    try:
        encoded = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        return audio
    pcm = decoder.pcm(encoded) + (decoder.flush() if whole else b"")
    return base64.b64encode(pcm).decode()
