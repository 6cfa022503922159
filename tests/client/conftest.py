"""Client fixtures: a real gateway on a loopback port (scripted engine), real Redis, the fault proxy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from gateway.runtime.app import create_app
from gateway.settings import Settings
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import live_server, make_settings
from tests.gateway.conftest import redis_server_url, redis_url  # noqa: F401 - the real Redis fixtures


@dataclass
class LiveGateway:
    url: str
    engine: ScriptedEngine
    settings: Settings

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None
        return port


@pytest.fixture
def engine() -> ScriptedEngine:
    # A pause between words: an answer stream is still running when the proxy cuts it.
    return ScriptedEngine(Script(word_delay_sec=0.02))


@pytest.fixture
def settings(redis_url: str) -> Settings:  # noqa: F811 - pytest's fixture injection
    return make_settings(redis_url=redis_url, tend_interval_sec=0.05)


@pytest.fixture
def gateway(settings: Settings, engine: ScriptedEngine) -> Iterator[LiveGateway]:
    with live_server(create_app(settings, engine=engine)) as url:
        yield LiveGateway(url, engine, settings)
