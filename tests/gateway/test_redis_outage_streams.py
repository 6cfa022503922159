"""Answer streams open while Redis goes away for a few seconds and comes back (real servers).

A rolling-deploy probe restarted Redis (gracefully, AOF, ~3 s down) while
answers streamed: every open stream ended with an ``error`` event
``store_unavailable``, and omni_client's ``answer()`` raised, while the
sessions themselves went on to complete. A stream now waits the outage out
(gateway/output/sse.py) and goes on after the last frame it sent; only an
outage past ``STORE_OUTAGE_SEC`` ends it, with an error a client resumes from.

Each test runs its own ``redis-server`` (restarted, or paused with ``CLIENT
PAUSE``), a real gateway under uvicorn and the scripted engine; a stream's
ids are checked against the session's output stream in Redis: every frame
once, in order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import pytest
import redis

from gateway.store.keys import session_keys
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, SseEvent, content_of, live_app, make_settings, parse_sse
from tests.gateway.test_api import append, create
from tests.redis_server import RedisProcess, redis_process

pytestmark = pytest.mark.redis

#: What the chart configures for its Redis (helm/omni-gateway/templates/redis.yaml).
AOF = ("--appendonly", "yes", "--appendfsync", "everysec")
#: A stream looks at its session when no frame came for ``READ_BLOCK_MS`` (5 s): here every
#: 300 ms, so a few seconds' outage certainly falls on a look. In production it does whenever
#: frames stopped for a while before it (input still arriving, a sidecar answering in bursts).
LOOK_MS = 300
#: An answer of ~3.6 s (a word every 30 ms), long enough to stream on across the outages below.
INPUT = " ".join(f"w{i}" for i in range(120))
ANSWER = f"echo: {INPUT}"


@pytest.fixture(autouse=True)
def look_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.output.sse.READ_BLOCK_MS", LOOK_MS)


@dataclass
class Read:
    status: int
    headers: httpx.Headers
    events: list[SseEvent]
    #: Frames that arrived once the outage was over.
    after_outage: int
    #: Keep-alive comments that arrived during the outage.
    pings_during: int


async def read_across(client: httpx.AsyncClient, method: str, path: str, outage: Callable[[], Awaitable[None]],
                      *, after_frames: int = 3, **request: object) -> Read:
    """A whole SSE response; ``outage`` starts once ``after_frames`` frames arrived, the reading going on."""
    lines: list[str] = []
    frames = after = pings = 0
    over = asyncio.Event()

    async def then_over() -> None:
        await outage()
        over.set()

    disturbance: asyncio.Task[None] | None = None
    async with client.stream(method, path, **request) as response:  # type: ignore[arg-type]
        async for line in response.aiter_lines():
            lines.append(line)
            pings += line.startswith(": ping") and disturbance is not None and not over.is_set()
            if line.startswith("data: "):
                frames += 1
                after += over.is_set()
                if frames == after_frames:
                    disturbance = asyncio.create_task(then_over())
    assert disturbance is not None, "the stream ended before the outage"
    await disturbance
    return Read(response.status_code, response.headers, parse_sse("\n".join(lines)), after, pings)


async def restart(server: RedisProcess, down_sec: float) -> None:
    """What a rolling deploy of Redis does: SIGTERM (the AOF fsynced), down a while, started again
    on the same folder (the AOF replayed)."""
    await asyncio.to_thread(server.stop)
    await asyncio.sleep(down_sec)
    await asyncio.to_thread(server.start)


async def pause(server: RedisProcess, sec: float) -> None:
    """Every client's commands held for ``sec`` (``CLIENT PAUSE ... ALL``): calls time out, then go on."""
    with redis.Redis(port=server.port) as admin:
        admin.client_pause(int(sec * 1000), all=True)
    await asyncio.sleep(sec)


def stored_ids(server: RedisProcess, session_id: str) -> list[str]:
    with redis.Redis(port=server.port) as admin:
        return [entry_id.decode() for entry_id, _ in admin.xrange(session_keys(session_id).output)]


def errors_in(events: list[SseEvent]) -> list[str]:
    return [event.data for event in events if event.event == "error"]


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[RedisProcess, httpx.AsyncClient]]:
    """A gateway on its own Redis (AOF, as the chart runs it), its Redis calls bounded by half a
    second, a keep-alive every second."""
    with redis_process(extra=AOF) as server:
        settings = make_settings(redis_url=server.url, redis_timeout_sec=0.5, tend_interval_sec=0.05,
                                 sse_ping_sec=1)
        async with live_app(settings, ScriptedEngine(Script(word_delay_sec=0.03))) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:
            yield server, client


async def test_a_stream_open_across_a_redis_restart_goes_on_from_its_last_frame(
        gateway: tuple[RedisProcess, httpx.AsyncClient]) -> None:
    server, client = gateway
    sid = await create(client)
    assert (await append(client, sid, 0, INPUT, end_of_input=True)).status_code == 202

    read = await read_across(client, "GET", f"{BASE}/{sid}/events", lambda: restart(server, 3.0))

    assert read.status == 200 and errors_in(read.events) == []
    assert read.pings_during > 0  # the connection was kept alive meanwhile
    assert read.after_outage > 0
    assert [event.id for event in read.events] == stored_ids(server, sid)  # no gap, no duplicate
    assert content_of(read.events) == ANSWER and read.events[-1].data == "[DONE]"


async def test_a_stream_whose_redis_stays_away_ends_resumable_and_resumes_without_a_gap(
        gateway: tuple[RedisProcess, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.store.connection.STORE_OUTAGE_SEC", 1.0)
    server, client = gateway
    sid = await create(client)
    assert (await append(client, sid, 0, INPUT, end_of_input=True)).status_code == 202

    read = await read_across(client, "GET", f"{BASE}/{sid}/events", lambda: restart(server, 4.0))

    *frames, end = read.events
    assert errors_in(frames) == [] and end.event == "error" and end.id is None
    error = json.loads(end.data)["error"]
    assert error["code"] == "store_unavailable" and error["resumable"] is True
    assert "Last-Event-ID" in error["message"] and sid in error["message"]
    # Redis is back (read_across waited for the restart): the rest, from the last frame received.
    resumed = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": frames[-1].id or ""})
    rest = parse_sse(resumed.text)
    assert errors_in(rest) == []
    assert [event.id for event in frames + rest] == stored_ids(server, sid)
    assert content_of(frames + rest) == ANSWER


async def test_a_chat_completion_stream_rides_out_a_paused_redis(
        gateway: tuple[RedisProcess, httpx.AsyncClient]) -> None:
    server, client = gateway
    body = {"messages": [{"role": "user", "content": INPUT}], "stream": True}

    read = await read_across(client, "POST", "/v1/chat/completions", lambda: pause(server, 2.0), json=body)

    assert read.status == 200 and errors_in(read.events) == []
    assert read.after_outage > 0
    # OpenAI's shape carries no ids: as many frames as the session stored, in order.
    assert len(read.events) == len(stored_ids(server, read.headers["X-Session-Id"]))
    assert content_of(read.events) == ANSWER and read.events[-1].data == "[DONE]"


async def test_an_upload_rides_out_a_redis_restart_in_its_records_and_its_answer(
        gateway: tuple[RedisProcess, httpx.AsyncClient]) -> None:
    server, client = gateway
    restarted = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield json.dumps({"start_policy": "on_first_chunk"}).encode() + b"\n"
        yield json.dumps({"sequence_id": 0, "text": f"{INPUT} "}).encode() + b"\n"
        await asyncio.to_thread(server.stop)  # the next record arrives while Redis is down
        yield json.dumps({"sequence_id": 1, "text": "end", "end_of_input": True}).encode() + b"\n"
        await asyncio.sleep(2.0)
        await asyncio.to_thread(server.start)
        restarted.set()

    response = await client.post("/v1/streaming_input/upload", content=body(),
                                  headers={"Content-Type": "application/x-ndjson"})
    assert restarted.is_set()
    events = parse_sse(response.text)
    assert response.status_code == 200 and errors_in(events) == []
    assert [event.id for event in events] == stored_ids(server, response.headers["X-Session-Id"])
    assert content_of(events) == f"{ANSWER} end"
