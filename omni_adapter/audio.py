"""Audio in the shapes the engines and the gateway exchange.

Input chunks arrive as raw pcm16 (little-endian, mono, 16 kHz unless the chunk
says otherwise) or as WAV files; engines want WAV (OpenAI ``input_audio``) or a
float32 waveform with its sample rate (vLLM's ``(array, sr)`` audio item).
Output leaves the adapters as pcm16 bytes (``AudioDelta``) and leaves the
gateway as OpenAI's ``pcm16``: 16-bit little-endian mono at 24 kHz, no header.
Only the standard library here, plus numpy where samples are computed on
(imported lazily).
"""

from __future__ import annotations

import io
import struct
import wave
from typing import TYPE_CHECKING, Any

from omni_adapter.port import EngineRejectedError, InputChunk

if TYPE_CHECKING:
    import numpy as np

#: What a pcm16 chunk without ``sample_rate`` is taken to be (the OpenAI input rate).
DEFAULT_INPUT_SAMPLE_RATE = 16_000
#: The rate OpenAI clients assume for ``pcm16`` output audio.
OPENAI_PCM16_RATE = 24_000


def pcm16_of(chunk: InputChunk) -> tuple[bytes, int]:
    """The chunk's samples as mono pcm16 and their sample rate.

    Raises ``EngineRejectedError`` for formats other than pcm16 and 16-bit WAV.
    """
    fmt = (chunk.format or "pcm16").lower()
    if fmt in ("pcm16", "pcm"):
        if len(chunk.data) % 2:
            raise EngineRejectedError("pcm16 audio must hold whole 16-bit samples")
        return chunk.data, chunk.sample_rate or DEFAULT_INPUT_SAMPLE_RATE
    if fmt == "wav":
        return _read_wav(chunk.data)
    raise EngineRejectedError(f"audio format {chunk.format!r} is not supported (pcm16 or wav)")


def _read_wav(data: bytes) -> tuple[bytes, int]:
    try:
        with wave.open(io.BytesIO(data)) as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise EngineRejectedError(f"not a readable WAV file: {exc}") from exc
    if width != 2:
        raise EngineRejectedError("WAV audio must be 16-bit PCM")
    if rate <= 0:  # resampling divides by it
        raise EngineRejectedError("WAV sample rate must be positive")
    if channels == 1:
        return frames, rate
    # Downmix: the engines take mono.
    import numpy as np

    samples = np.frombuffer(frames, dtype="<i2").reshape(-1, channels)
    return samples.mean(axis=1).round().astype("<i2").tobytes(), rate


def wav_of(pcm16: bytes, sample_rate: int) -> bytes:
    """A mono 16-bit WAV file around pcm16 samples."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm16)
    return buffer.getvalue()


def waveform_of(pcm16: bytes) -> np.ndarray:
    """pcm16 samples as float32 in [-1, 1), the way vLLM's realtime API converts them."""
    import numpy as np

    return np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0


def pcm16_from_waveform(waveform: np.ndarray) -> bytes:
    """A float waveform in [-1, 1] as pcm16 bytes (clipped, like vLLM-Omni's encoder)."""
    import numpy as np

    clipped = np.clip(waveform.astype(np.float32, copy=False), -1.0, 1.0)
    return (clipped * 32767.0).astype("<i2").tobytes()


def parse_wav(data: bytes) -> tuple[bytes, int]:
    """The pcm16 mono samples and sample rate of a wav file.

    Streaming writers (``espeak-ng --stdout``) cannot know the length up
    front and put a placeholder size in the header, so the ``data`` chunk is
    taken as everything after its header, whatever size it claims. Raises
    ``ValueError`` for anything but 16-bit PCM mono.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    position, rate = 12, None
    while position + 8 <= len(data):
        chunk_id, size = data[position:position + 4], struct.unpack_from("<I", data, position + 4)[0]
        body = position + 8
        if chunk_id == b"fmt ":
            audio_format, channels, rate = struct.unpack_from("<HHI", data, body)
            bits = struct.unpack_from("<H", data, body + 14)[0]
            if audio_format != 1 or channels != 1 or bits != 16:
                raise ValueError(f"expected 16-bit PCM mono, got format {audio_format}, "
                                 f"{channels} channels, {bits} bits")
            if rate <= 0:  # resampling divides by it
                raise ValueError("wav sample rate must be positive")
        elif chunk_id == b"data":
            if rate is None:
                raise ValueError("wav data chunk before its fmt chunk")
            samples = data[body:body + size] if body + size <= len(data) else data[body:]
            return samples[:len(samples) // 2 * 2], rate
        position = body + size + (size & 1)
    raise ValueError("wav file has no data chunk")


def resample(pcm16: bytes, from_rate: int, to_rate: int) -> bytes:
    """Band-limited resampling (libsoxr) of one whole piece of audio.

    For a stream that arrives in pieces use :class:`StreamResampler`: each
    piece resampled on its own ends in a click at every boundary.
    """
    if from_rate == to_rate or not pcm16:
        return pcm16
    import numpy as np
    import soxr

    return bytes(soxr.resample(np.frombuffer(pcm16, dtype="<i2"), from_rate, to_rate).astype("<i2").tobytes())


def retimed(pcm16: bytes, rate: int, tempo: float) -> bytes:
    """``pcm16`` played ``tempo`` times as fast, its pitch kept (FFmpeg's ``atempo``: WSOLA); for a
    speed beyond what a voice says by itself. atempo takes 0.5 and up, so a slower tempo is two."""
    if abs(tempo - 1) < 1e-3 or not pcm16:
        return pcm16
    from fractions import Fraction

    import av
    import av.filter
    import numpy as np

    graph = av.filter.Graph()
    stages = [graph.add_abuffer(sample_rate=rate, format="s16", layout="mono", time_base=Fraction(1, rate))]
    for step in ([tempo ** 0.5] * 2 if tempo < 0.5 else [tempo]):
        stages.append(graph.add("atempo", f"{step:.6f}"))
    stages.append(graph.add("abuffersink"))
    for before, after in zip(stages, stages[1:], strict=False):
        before.link_to(after)
    graph.configure()
    # WSOLA needs a window before the first sound to keep it: 0.1 s of silence, dropped after.
    lead = rate // 10
    samples = np.concatenate([np.zeros(lead, "<i2"), np.frombuffer(pcm16[:len(pcm16) // 2 * 2], "<i2")])
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
    graph.push(frame)
    graph.push(None)
    out = []
    while True:
        try:
            out.append(graph.pull().to_ndarray().reshape(-1).astype("<i2").tobytes())
        except (av.BlockingIOError, av.EOFError):
            return b"".join(out)[round(lead / tempo) * 2:]


class StreamResampler:
    """One audio stream resampled piece by piece, its filter state carried across pieces.

    soxr's streaming resampler: the pieces out, joined, are the whole stream
    resampled at once (less the filter's short delay, which :meth:`flush`
    gives back at the end). A change of input rate mid-stream starts a new
    filter.
    """

    def __init__(self, to_rate: int) -> None:
        self.to_rate = to_rate
        self._from_rate = 0
        self._stream: Any = None

    def push(self, pcm16: bytes, from_rate: int) -> np.ndarray:
        """The piece's samples at ``to_rate``, as int16."""
        import numpy as np

        samples = np.frombuffer(pcm16[:len(pcm16) // 2 * 2], dtype="<i2")
        if from_rate == self.to_rate and self._stream is None:
            return samples
        if from_rate != self._from_rate:
            tail = self.flush()
            self._from_rate = from_rate
            if from_rate == self.to_rate:
                return np.concatenate([tail, samples])
            import soxr

            self._stream = soxr.ResampleStream(from_rate, self.to_rate, 1, dtype="int16")
            return np.concatenate([tail, self._stream.resample_chunk(samples)])
        return self._stream.resample_chunk(samples)  # type: ignore[no-any-return]

    def flush(self) -> np.ndarray:
        """The samples still in the filter; the stream ends here."""
        import numpy as np

        stream, self._stream, self._from_rate = self._stream, None, 0
        if stream is None:
            return np.zeros(0, dtype="<i2")
        return stream.resample_chunk(np.zeros(0, dtype="<i2"), last=True)  # type: ignore[no-any-return]
