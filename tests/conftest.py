"""Shared fixtures: the real engine, started once per test session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.vllm_engine import VllmEngine, VllmEngineConfig, open_vllm_engine


@pytest.fixture(scope="session")
async def vllm_engine() -> AsyncIterator[VllmEngine]:
    """The embedded default engine (SmolLM2-135M-Instruct on the CPU)."""
    config = VllmEngineConfig(
        model=str(ensure_default_model()), served_model_name="SmolLM2-135M-Instruct"
    )
    engine = await open_vllm_engine(config)
    try:
        yield engine
    finally:
        await engine.aclose()
