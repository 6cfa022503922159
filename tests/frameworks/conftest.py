"""The voice-agent frameworks' suites: each framework, unchanged but for the URL, against a
gateway on the real engine (SmolLM2 on the CPU, the Listener and the Talker) and real Redis.

The engine is the test session's one (tests/conftest.py); prompts and answers are short.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from omni_adapter.listener import with_listener
from omni_adapter.port import EngineRequest, EngineSession
from omni_adapter.stage import EngineStage
from omni_adapter.talker import with_talker
from tests.gateway.client import live_app, make_settings
from tests.gateway.conftest import redis_server_url, redis_url

__all__ = ["redis_server_url", "redis_url"]  # the real Redis fixtures, shared with tests/gateway


class RecordingEngine(EngineStage):
    """The real engine, keeping each request it is given: what the model was asked."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, engine.capabilities)
        self.requests: list[EngineRequest] = []

    def open_session(self, request: EngineRequest) -> EngineSession:
        self.requests.append(request)
        session: EngineSession = self._thinker.open_session(request)
        return session


@dataclass
class Gateway:
    url: str
    engine: RecordingEngine
    model: str = field(default="SmolLM2-135M-Instruct")

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws") + "/v1/realtime"


@pytest.fixture
async def gateway(redis_url: str, vllm_engine: Any) -> AsyncIterator[Gateway]:
    """A gateway as the embedded default composes it (Listener, Thinker, Talker)."""
    engine = RecordingEngine(with_talker(with_listener(vllm_engine)))
    async with live_app(make_settings(redis_url=redis_url), engine) as url:
        yield Gateway(url, engine)
