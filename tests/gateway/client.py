"""Helpers to drive the app in-process: client fixture factory and SSE parsing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from openai import AsyncOpenAI

from gateway.runtime.app import create_app
from gateway.runtime.processes import uvicorn_config
from gateway.settings import Settings
from gateway.work.draining import Draining
from omni_adapter.port import Engine
from tests.redis_server import free_port

BASE = "/v1/streaming_input/sessions"


def make_settings(**overrides: object) -> Settings:
    """Settings for tests: limits off unless a test sets them (the suite shares one Redis).

    Redis calls get 10 s, not 2: on a starved 2-core CI machine (an engine
    generating beside the test) the event loop can stall past 2 s, and a
    test that is not about Redis timeouts must not see a 503 for it. The
    tests of timeouts set their own. For the same reason load shedding is
    off (a stalled loop would shed); the tests of shedding turn it on.
    """
    base: dict[str, object] = {"max_sessions_per_identity": 0, "rate_limit_rps": 0, "max_open_sessions": 0,
                               "shutdown_grace_sec": 0, "redis_timeout_sec": 10.0,
                               "max_in_flight_requests": 0, "max_loop_lag_sec": 0}
    return Settings(**{**base, **overrides})


@asynccontextmanager
async def app_client(settings: Settings, engine: Engine,
                     draining: Draining | None = None) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, engine=engine, draining=draining)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


def openai_client(client: httpx.AsyncClient) -> AsyncOpenAI:
    """The official OpenAI client, talking to the app through ``client``."""
    return AsyncOpenAI(base_url=client.base_url.join("/v1"), api_key="unused", http_client=client, max_retries=0)


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """The app under uvicorn on a loopback port (real sockets, real disconnects); its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the app did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@asynccontextmanager
async def live_app(settings: Settings, engine: Engine) -> AsyncIterator[str]:
    """The app under uvicorn on a loopback port, in this event loop (WebSockets need a
    real server; an in-process engine is bound to this loop); its URL."""
    port = free_port()
    # The server's own configuration (serve's), on a loopback port.
    async with served(uvicorn_config(create_app(settings, engine=engine), settings, host="127.0.0.1", port=port,
                                     log_level="warning")):
        yield f"http://127.0.0.1:{port}"


@asynccontextmanager
async def served(config: uvicorn.Config) -> AsyncIterator[None]:
    """uvicorn serving ``config`` in this event loop, from when it listens until the block ends."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for this
        assert not task.done(), "the app did not start"
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


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


async def state_once_cancelled(client: httpx.AsyncClient, session_id: str, within_sec: float = 5.0) -> str:
    """The session's state once it is ``cancelled``, or whatever it is after ``within_sec``
    (a client that left: its session is cancelled soon after, not at once)."""
    deadline = time.monotonic() + within_sec
    while True:
        state = str((await client.get(f"{BASE}/{session_id}")).json()["state"])
        if state == "cancelled" or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)
