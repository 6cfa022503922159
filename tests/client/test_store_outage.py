"""omni_client's answer() while the gateway's Redis goes away and comes back (real servers).

The rolling-deploy probe's case: Redis restarted (gracefully, AOF, ~3 s
down) while ``answer()`` streamed raised ``SessionFailed`` although the
session completed. Now the gateway's stream waits the outage out; if Redis
stays away past the gateway's bound the stream ends ``resumable``, and the
client reads on from its last event id, retrying the ``store_unavailable``
503s of its resume for up to ``RetryPolicy.store_outage_sec``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from gateway.runtime.app import create_app
from gateway.settings import Settings
from omni_adapter.scripted import Script, ScriptedEngine
from omni_client import AsyncClient, Client, RetryPolicy, ServerError, TextDelta
from omni_client.answer import SseEvent, resumable_end
from tests.gateway.client import live_app, live_server, make_settings
from tests.redis_server import RedisProcess, redis_process

pytestmark = pytest.mark.redis

AOF = ("--appendonly", "yes", "--appendfsync", "everysec")
#: An answer of ~3.6 s (a word every 30 ms): it streams on across the outages below.
INPUT = " ".join(f"w{i}" for i in range(120))
ANSWER = f"echo: {INPUT}"


@pytest.fixture(autouse=True)
def look_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream looks at its session every 300 ms without frames (5 s in production), so an
    outage of seconds certainly meets a look, as it does when frames stopped before it."""
    monkeypatch.setattr("gateway.output.sse.READ_BLOCK_MS", 300)


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    with redis_process(extra=AOF) as server:
        yield server


def settings_for(server: RedisProcess) -> Settings:
    return make_settings(redis_url=server.url, redis_timeout_sec=0.5, tend_interval_sec=0.05)


def restart(server: RedisProcess, down_sec: float, done: threading.Event) -> None:
    """A rolling deploy of Redis: SIGTERM (the AOF fsynced), down a while, started on the same folder."""
    server.stop()
    threading.Event().wait(down_sec)
    server.start()
    done.set()


def test_answer_streams_on_across_a_redis_restart(redis_server: RedisProcess) -> None:
    """The probe's script: the sync client, Redis restarted 3 s while the answer streams."""
    engine = ScriptedEngine(Script(word_delay_sec=0.03))
    with live_server(create_app(settings_for(redis_server), engine=engine)) as url, Client(url) as client:
        session = client.create_session(temperature=0)
        session.send(INPUT, end_of_input=True)
        back = threading.Event()
        restarting = threading.Thread(target=restart, args=(redis_server, 3.0, back))
        text: list[str] = []
        after_outage = 0
        for event in session.answer():
            if isinstance(event, TextDelta):
                text.append(event.text)
                after_outage += back.is_set()
                if len(text) == 3:
                    restarting.start()
        restarting.join()
        result = session.result(wait=10)
    assert after_outage > 0
    assert "".join(text) == ANSWER == result.text and result.state == "completed"


async def test_answer_resumes_a_stream_redis_outlasted_and_waits_out_the_503s(
        redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis away 5 s, past the gateway's bound (1 s here): the stream ends resumable, the
    resume meets 503 store_unavailable until Redis is back, more than ``attempts`` allows."""
    monkeypatch.setattr("gateway.store.connection.STORE_OUTAGE_SEC", 1.0)
    seen: list[tuple[str, int]] = []

    async def record(response: httpx.Response) -> None:
        seen.append((response.request.url.path, response.status_code))

    # One try after the first, a second later (Retry-After): given up within the outage, but for
    # store_outage_sec.
    retry = RetryPolicy(attempts=2, backoff_sec=0.05, max_backoff_sec=0.2)
    engine = ScriptedEngine(Script(word_delay_sec=0.03))
    async with live_app(settings_for(redis_server), engine) as url, \
            httpx.AsyncClient(base_url=url, timeout=30, event_hooks={"response": [record]}) as http:
        client = AsyncClient(retry=retry, http_client=http)
        session = await client.create_session(temperature=0)
        await session.send(INPUT, end_of_input=True)
        back = threading.Event()
        text: list[str] = []
        restarting: asyncio.Task[None] | None = None
        async for event in session.answer():
            if isinstance(event, TextDelta):
                text.append(event.text)
                if len(text) == 3:
                    restarting = asyncio.create_task(asyncio.to_thread(restart, redis_server, 5.0, back))
        assert restarting is not None
        await restarting
        result = await session.result(wait=10)
    events = [status for path, status in seen if path.endswith("/events")]
    assert events.count(503) > retry.attempts  # the resume outlasted the count: the outage was waited out
    assert "".join(text) == ANSWER == result.text


def test_which_stream_ends_are_resumed() -> None:
    def error(body: str, id: str | None = None) -> SseEvent:
        return SseEvent(id, "error", body)

    ended = resumable_end(error('{"error": {"code": "store_unavailable", "message": "m", "resumable": true}}'))
    assert isinstance(ended, ServerError) and ended.status == 503 and ended.code == "store_unavailable"
    assert resumable_end(error('{"error": {"code": "replica_stopping", "message": "m"}}'))  # an older gateway
    assert resumable_end(error('{"error": {"code": "store_unavailable", "message": "m"}}'))  # an older gateway
    assert resumable_end(error('{"error": {"code": "something_new", "message": "m", "resumable": true}}'))
    # A session's own failure is one of its frames: it has an id, and it is final.
    assert resumable_end(error('{"error": {"code": "store_unavailable", "message": "m"}}', id="1-0")) is None
    assert resumable_end(error('{"error": {"code": "engine_error", "message": "m"}}')) is None
    assert resumable_end(SseEvent(None, None, '{"error": {"code": "replica_stopping"}}')) is None


def test_a_store_outage_is_waited_out_past_the_attempts_for_a_bounded_time() -> None:
    policy = RetryPolicy(attempts=2, store_outage_sec=10)
    assert policy.delay(5) is None
    assert policy.delay(5, 1.0, store_outage_for=9.0) == 1.0
    assert policy.delay(5, 1.0, store_outage_for=10.0) is None
    assert RetryPolicy(attempts=2, store_outage_sec=0).delay(5, 1.0, store_outage_for=0.0) is None
