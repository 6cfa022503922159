"""Audio files as the recognizer hears them: any container and codec FFmpeg reads (WAV, MP3,
Ogg/Opus, WebM, FLAC, M4A) decoded to 16 kHz mono pcm16 (blocking: call it in a worker thread).
``/v1/audio/transcriptions`` hears its upload so; chat's ``input_audio`` in mp3 too."""

from __future__ import annotations

import io
from typing import Any

from gateway import errors
from gateway.api.chunks import check_file_rate

#: The recognizer's rate: a file is decoded straight to it.
RATE = 16_000


#: FFmpeg's names of the containers of OpenAI's file types (and AAC, which /v1/audio/speech makes).
AUDIO_FILE_FORMATS = frozenset({"wav", "mp3", "ogg", "flac", "matroska", "webm", "mov", "mp4", "m4a", "aac",
                                "mpeg"})


def decoded(data: bytes, max_bytes: int, param: str = "file") -> bytes:
    """The file's first audio stream as 16 kHz mono pcm16 (blocking: FFmpeg decodes it); a 413 as
    soon as it holds more than a session takes (``max_bytes``: 35 minutes by default), not after
    decoding an hour of it."""
    import av

    if not data:
        raise errors.InvalidPayload("the file is empty", param=param)
    pcm = bytearray()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not set(container.format.name.split(",")) & AUDIO_FILE_FORMATS:
                # FFmpeg guesses a format for any bytes (headerless pcm reads as a game's audio):
                # only the files OpenAI takes are heard, or noise would be "transcribed".
                raise errors.InvalidPayload(
                    f"the file is not an audio file this server takes (it reads as {container.format.name!r}): send "
                    "flac, m4a, mp3, mp4, mpeg, mpga, oga, ogg, wav or webm (raw pcm has no header that says "
                    "its rate)", param=param)
            if not container.streams.audio:
                raise errors.InvalidPayload("the file has no audio", param=param)
            to_16k = _Resampler()
            for packet in container.demux(container.streams.audio[0]):
                for frame in _frames(packet):
                    check_file_rate(frame.sample_rate, "the file", param)
                    pcm += to_16k(frame)
                if len(pcm) > max_bytes:
                    raise errors.PayloadTooLarge(
                        f"the audio is longer than {max_bytes // (2 * RATE)} s, the most taken here",
                        param=param)
            pcm += to_16k(None)
    except (av.FFmpegError, ValueError) as exc:  # PyAV's own checks raise ValueError
        why = getattr(exc, "strerror", None) or exc  # FFmpeg's reason, without its error number
        raise errors.InvalidPayload(f"the file is not audio this server can decode ({why})", param=param) from exc
    if not pcm:
        raise errors.InvalidPayload("the file holds no audio samples", param=param)
    return bytes(pcm)


def _frames(packet: Any) -> list[Any]:
    """The packet's frames; none for a packet the codec cannot read, skipped as players skip it
    (where two MP3 files were joined, the second one's header reads as a broken frame)."""
    import av

    try:
        return list(packet.decode())
    except av.InvalidDataError:
        return []


class _Resampler:
    """Frames of any rate and layout as 16 kHz mono pcm16. A stream may change them midway
    (chained Ogg, joined MP3s), and PyAV's resampler is set up by the first frame it sees: a
    change starts a new one, after the old one's tail. ``None``: the end, the tail."""

    def __init__(self) -> None:
        self._resampler: Any = None
        self._input: tuple[str, str, int] | None = None

    def __call__(self, frame: Any) -> bytes:
        import av

        out = b""
        shape = None if frame is None else (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._resampler is not None and shape != self._input:
            out += b"".join(f.to_ndarray().tobytes() for f in self._resampler.resample(None))
            self._resampler = None
        if frame is None:
            return out
        if self._resampler is None:
            self._resampler, self._input = av.AudioResampler(format="s16", layout="mono", rate=RATE), shape
        return out + b"".join(f.to_ndarray().tobytes() for f in self._resampler.resample(frame))
