"""A rolling restart cuts no answer (issue 29, item 1).

Two replicas as ``omni-gateway serve`` runs them (an API worker beside the
engine process, here a scripted engine that answers ``echo: <question>`` a
word every 0.12 s), one Redis, the NGINX edge rendered from the production
Ingress in front. Streaming chats (the ``openai`` SDK) and Realtime turns
(a WebSocket client) are in flight when a replica gets SIGTERM; it is
started again, then the other one is. Every answer must either reach its
end, equal to the undisturbed answer (the scripted engine's echo, which no
restart changes), or end with an explicit error after which a resume
(``omni_client`` on the session's events; a Realtime reconnect with the
last event id) completes it. An answer that ends early without an error,
as SIGTERM ended every stream before, is "silently shortened": none may be.

Answers are 2-7 s long and the grace period 2 s, so some finish within it
and some are handed to the other replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import websockets
from openai import AsyncOpenAI

from omni_client import AsyncClient
from tests.gateway.test_edge import nginx
from tests.redis_server import free_port, redis_process
from tests.replicas.gateways import Gateway, ready, stop_all, wait_until

KEY = "sk-rolling"
WORD_DELAY_SEC = 0.12
CHATS_PER_WAVE, TURNS_PER_WAVE = 10, (3, 2)
TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}


def question(n: int) -> str:
    """15 to 60 words: answers of 2 to 7 s at the scripted pace."""
    return " ".join(f"w{n}-{i}" for i in range(15 + (n * 7) % 46))


def echo(text: str) -> str:
    return f"echo: {text}"


@dataclass
class Outcome:
    """One answer as its client saw it."""

    kind: str
    #: Text received before any error, then after the resume.
    text: str = ""
    #: An explicit error ended a stream (SSE ``error`` event, a closed WebSocket) and a resume followed.
    resumed: bool = False
    #: Deltas arrived: the answer was under way when the restart began.
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def chat(edge: str, n: int, outcome: Outcome) -> None:
    oai = AsyncOpenAI(base_url=f"{edge}/v1", api_key=KEY, max_retries=0, timeout=60)
    raw = await oai.chat.completions.with_raw_response.create(
        model="scripted", messages=[{"role": "user", "content": question(n)}], stream=True, temperature=0)
    session_id = raw.headers["x-session-id"]
    stream = raw.parse()
    try:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    outcome.text += choice.delta.content
                    outcome.started.set()
    except (openai.APIError, openai.APIConnectionError) as exc:
        # The explicit end of a stream cut short; the session goes on: resume it.
        body = getattr(exc, "body", None)
        assert not isinstance(body, dict) or body.get("code") == "replica_stopping", body
        async with AsyncClient(edge, KEY) as client:
            whole = await (await client.session(session_id)).text()
        assert whole.startswith(outcome.text), (outcome.text, whole)
        outcome.text, outcome.resumed = whole, True
    finally:
        await oai.close()


async def realtime_turn(edge: str, n: int, outcome: Outcome) -> None:
    url = edge.replace("http", "ws") + "/v1/realtime"
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    ws = await websockets.connect(url, subprotocols=protocols)  # type: ignore[list-item]
    session_id = json.loads(await ws.recv())["session"]["id"]
    await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": question(n)}]}}))
    await ws.send(json.dumps({"type": "response.create"}))
    last_event_id = ""
    try:
        while True:
            try:
                event = json.loads(await ws.recv())
            except websockets.ConnectionClosed:
                # The replica went away mid-turn: reconnect (through the edge, to whichever
                # replica answers) and read on after the last event seen.
                outcome.resumed = True
                ws = await reconnect(f"{url}?session_id={session_id}&last_event_id={last_event_id}", protocols)
                continue
            last_event_id = event.get("event_id", last_event_id)
            if event["type"] == "response.output_text.delta":
                outcome.text += event["delta"]
                outcome.started.set()
            assert event["type"] != "error", event
            if event["type"] == "response.done":
                return
    finally:
        await ws.close()


async def reconnect(url: str, protocols: list[str]) -> websockets.ClientConnection:
    deadline = time.monotonic() + 30
    while True:
        try:
            return await websockets.connect(url, subprotocols=protocols)  # type: ignore[list-item]
        except (OSError, websockets.InvalidStatus, websockets.InvalidHandshake):
            assert time.monotonic() < deadline, "no replica took the reconnect"
            await asyncio.sleep(0.2)


@contextmanager
def replicas(workdir: Path, redis_url: str) -> Iterator[dict[str, Gateway]]:
    env = {"OMNI_GATEWAY_REDIS_URL": redis_url, "OMNI_GATEWAY_API_KEYS": KEY, "OMNI_GATEWAY_API_WORKERS": "1",
           "OMNI_GATEWAY_RATE_LIMIT_RPS": "0", "OMNI_GATEWAY_MAX_SESSIONS_PER_IDENTITY": "0",
           "OMNI_GATEWAY_DRAIN_SEC": "0.5", "OMNI_GATEWAY_SHUTDOWN_GRACE_SEC": "2",
           "OMNI_GATEWAY_LEASE_TTL_SEC": "3", "OMNI_GATEWAY_TEND_INTERVAL_SEC": "0.1"}
    gateways = {name: Gateway(name, workdir, env, module="tests.replicas.scripted_replica",
                              args=("--engine-port", str(free_port()), "--word-delay-sec", str(WORD_DELAY_SEC)))
                for name in ("a", "b")}
    try:
        for gateway in gateways.values():
            gateway.start()
        for gateway in gateways.values():
            wait_until(lambda g=gateway: ready(g), 60, f"{gateway.name} ready", gateway.tail)  # type: ignore[misc]
        yield gateways
    finally:
        stop_all(list(gateways.values()))


def restart(gateway: Gateway) -> None:
    """SIGTERM, wait for the replica to exit by itself, start it again."""
    assert gateway.proc is not None
    gateway.terminate()
    gateway.proc.wait(timeout=60)
    # uvicorn raises the signal again once it has stopped: death by SIGTERM is its clean exit.
    assert gateway.proc.returncode in (0, -15), gateway.tail()
    gateway.start()
    wait_until(lambda: ready(gateway), 60, f"{gateway.name} ready again", gateway.tail)


@asynccontextmanager
async def wave(edge: str, first: int, turns: int, outcomes: list[Outcome]) -> AsyncIterator[None]:
    """Chats and Realtime turns under way (each has had a delta) for the body; finished after it."""
    tasks = []
    for n in range(first, first + CHATS_PER_WAVE + turns):
        kind = "chat" if n < first + CHATS_PER_WAVE else "realtime"
        outcome = Outcome(kind)
        outcomes.append(outcome)
        run: Callable[[str, int, Outcome], object] = chat if kind == "chat" else realtime_turn
        tasks.append(asyncio.ensure_future(run(edge, n, outcome)))  # type: ignore[arg-type]
    deadline = time.monotonic() + 30
    while not all(o.started.is_set() for o in outcomes[-len(tasks):]):
        for task in tasks:
            if task.done():
                task.result()  # a client that failed before its answer started says why
        assert time.monotonic() < deadline, "answers did not start"
        await asyncio.sleep(0.05)
    yield
    async with asyncio.timeout(90):
        await asyncio.gather(*tasks)


async def test_a_rolling_restart_cuts_no_answer(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    with redis_process() as redis, replicas(tmp_path, redis.url) as gateways, \
            nginx([f"127.0.0.1:{g.port}" for g in gateways.values()], tmp_path / "edge") as edge:
        n = 0
        for name, turns in zip(("a", "b"), TURNS_PER_WAVE, strict=True):
            async with wave(edge, n, turns, outcomes):
                await asyncio.to_thread(restart, gateways[name])
            n += CHATS_PER_WAVE + turns
        logs = "\n".join(g.tail(15) for g in gateways.values())
    expected = [echo(question(i)) for i in range(len(outcomes))]
    shortened = [i for i, o in enumerate(outcomes) if o.text != expected[i]]
    counts = Counter((o.kind, "resumed" if o.resumed else "complete") for o in outcomes)
    print(f"\nrolling restart: {len(outcomes)} answers in flight; "
          f"complete {sum(not o.resumed for o in outcomes)}, resumed after an error "
          f"{sum(o.resumed for o in outcomes)}, silently shortened {len(shortened)}; {dict(counts)}")
    assert not shortened, f"answers cut short: {shortened}\n{logs}"
    assert len(outcomes) == 2 * CHATS_PER_WAVE + sum(TURNS_PER_WAVE)
    assert any(o.resumed for o in outcomes), "no answer outlived its replica's grace: nothing was handed over"
    assert any(not o.resumed for o in outcomes), "no answer finished within the grace period"


pytestmark = pytest.mark.timeout(300)
