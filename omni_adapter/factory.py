"""Open the engine an installation asked for; import its library only then."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from omni_adapter.port import Engine

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EngineChoice:
    kind: str = "vllm"
    #: A local model folder; ``None`` means the embedded default.
    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_space_gib: int = 2


async def open_engine(choice: EngineChoice) -> Engine:
    if choice.kind != "vllm":
        raise ValueError(f"unknown engine {choice.kind!r}")
    from omni_adapter.model_bootstrap import ensure_default_model
    from omni_adapter.talker import with_talker
    from omni_adapter.vllm_engine import VllmEngineConfig, open_vllm_engine

    if choice.model:
        model, name = choice.model, choice.served_model_name or Path(choice.model).name
    else:
        # Downloading and converting the default takes a while the first time;
        # keep the event loop free meanwhile.
        model = str(await asyncio.to_thread(ensure_default_model))
        name = choice.served_model_name or DEFAULT_SERVED_NAME
    thinker = await open_vllm_engine(VllmEngineConfig(
        model=model, served_model_name=name, dtype=choice.dtype,
        max_model_len=choice.max_model_len, kv_cache_space_gib=choice.kv_cache_space_gib))
    # A text model speaks through the CPU Talker (espeak-ng), if installed.
    return with_talker(thinker)
