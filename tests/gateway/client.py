"""Helpers to drive the app in-process: client fixture factory and SSE parsing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from asgi_lifespan import LifespanManager

from gateway.app import create_app
from gateway.draining import Draining
from gateway.settings import Settings
from omni_adapter.port import Engine

BASE = "/v1/streaming_input/sessions"


def make_settings(**overrides: object) -> Settings:
    """Settings for tests: limits off unless a test sets them (the suite shares one Redis)."""
    base: dict[str, object] = {"max_sessions_per_identity": 0, "rate_limit_rps": 0, "max_open_sessions": 0,
                               "shutdown_grace_sec": 0}
    return Settings(**{**base, **overrides})


@asynccontextmanager
async def app_client(settings: Settings, engine: Engine,
                     draining: Draining | None = None) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, engine=engine, draining=draining)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


@dataclass(frozen=True)
class SseEvent:
    id: str | None
    event: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(body: str) -> list[SseEvent]:
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
        if "data" in fields:
            events.append(SseEvent(fields.get("id"), fields.get("event"), fields["data"]))
    return events


def content_of(events: list[SseEvent]) -> str:
    text = []
    for event in events:
        if event.event is None and event.data != "[DONE]":
            for choice in event.json()["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)
