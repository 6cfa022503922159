"""Output coalescing (work/batcher.py): fewer publish calls, same frames, bounded wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.settings import Settings
from gateway.store.redis_store import SessionStore
from gateway.work.batcher import OutFrame, OutputBatcher
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, content_of, live_app, make_settings, parse_sse


class Recorder:
    def __init__(self, answer: bool = True, delay_sec: float = 0.0) -> None:
        self.calls: list[tuple[float, list[OutFrame]]] = []
        self.answer = answer
        self.delay_sec = delay_sec

    async def __call__(self, frames: list[OutFrame]) -> bool:
        self.calls.append((time.monotonic(), frames))
        await asyncio.sleep(self.delay_sec)
        return self.answer


def frame(n: int) -> OutFrame:
    return ("", f"d{n}", False)


async def test_frames_within_the_window_go_out_in_one_call_in_order() -> None:
    publish = Recorder()
    batcher = OutputBatcher(publish, window_sec=0.05)
    started = time.monotonic()
    # Other tasks run between the frames, but no timer does: on a busy machine five 1 ms
    # sleeps could take the whole window.
    for n in range(5):
        await batcher.add([frame(n)])
        await asyncio.sleep(0)
    await asyncio.sleep(0.2)
    assert [frames for _, frames in publish.calls] == [[frame(n) for n in range(5)]]
    waited = publish.calls[0][0] - started
    assert 0.04 <= waited < 0.5  # the window, not the close (a busy machine's timers run late)
    assert await batcher.close()


async def test_frames_added_while_a_call_is_in_flight_go_in_the_next_call() -> None:
    publish = Recorder(delay_sec=0.05)
    batcher = OutputBatcher(publish, window_sec=0.001)
    await batcher.add([frame(0)])
    await asyncio.sleep(0.02)  # the first call is in flight
    for n in range(1, 4):
        await batcher.add([frame(n)])
    assert await batcher.close()
    assert [frames for _, frames in publish.calls] == [[frame(0)], [frame(1), frame(2), frame(3)]]


async def test_without_a_window_the_caller_publishes_at_once() -> None:
    publish = Recorder()
    batcher = OutputBatcher(publish, window_sec=0)
    await batcher.add([frame(0)])
    assert [frames for _, frames in publish.calls] == [[frame(0)]]  # before add returned: no task, no wait
    await batcher.add([frame(1), frame(2)])
    assert [frames for _, frames in publish.calls] == [[frame(0)], [frame(1), frame(2)]]
    assert await batcher.close()


async def test_close_publishes_at_once_what_the_window_holds() -> None:
    publish = Recorder()
    batcher = OutputBatcher(publish, window_sec=10)
    await batcher.add([frame(0), frame(1)])
    started = time.monotonic()
    assert await batcher.close()
    assert time.monotonic() - started < 1
    assert [frames for _, frames in publish.calls] == [[frame(0), frame(1)]]


async def test_a_refused_publish_stops_the_batcher() -> None:
    publish = Recorder(answer=False)
    batcher = OutputBatcher(publish, window_sec=0)
    await batcher.add([frame(0)])
    assert not batcher.ok
    await batcher.add([frame(1)])  # dropped: the session no longer takes frames
    assert not await batcher.close()
    assert len(publish.calls) == 1


async def test_an_error_in_a_publish_is_raised_by_close() -> None:
    async def broken(frames: list[OutFrame]) -> bool:
        raise RuntimeError("a bug")

    batcher = OutputBatcher(broken, window_sec=0)
    await batcher.add([frame(0)])
    assert not batcher.ok
    with pytest.raises(RuntimeError, match="a bug"):
        await batcher.close()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url=redis_url, tend_interval_sec=0.05, output_coalesce_ms=20)


@pytest.fixture
async def counted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[int]]:
    """The number of frames each publish call carried."""
    sizes: list[int] = []
    real = SessionStore.publish

    async def publish(self: SessionStore, session_id: str, lease: object, first: int, frames: list, *args: object,
                      **kwargs: object) -> object:
        sizes.append(len(frames))
        return await real(self, session_id, lease, first, frames, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SessionStore, "publish", publish)
    yield sizes


async def test_a_fast_answer_takes_fewer_calls_and_streams_the_same_frames(
        redis_url: str, counted: list[int]) -> None:
    # An engine with no pause between deltas and a window far longer than the whole answer
    # takes: the count of calls does not hang on this machine's load. (Deltas 2 ms apart in a
    # 20 ms window failed once on a busy CI machine: each publish took as long as a delta.)
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05, output_coalesce_ms=100)
    words = " ".join(f"w{n}" for n in range(40))
    engine = ScriptedEngine(Script(word_delay_sec=0))
    async with app_client(settings, engine) as client:
        response = await client.post(BASE, json={
            "first_chunk": {"sequence_id": 0, "text": words, "end_of_input": True}})
        sid = response.json()["session_id"]
        events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
        # One frame per delta, as before: role, "echo:" and 40 words, finish, [DONE].
        assert len(events) == 1 + 41 + 2
        assert content_of(events) == f"echo: {words}"
        assert sum(counted) == len(events)
        assert len(counted) < len(events) / 3, counted
        # Ids are the Redis entry ids, increasing; a resume from any of them gets exactly the rest.
        keys = [tuple(int(p) for p in str(e.id).split("-")) for e in events]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        middle = events[17].id
        resumed = parse_sse((await client.get(f"{BASE}/{sid}/events",
                                              headers={"Last-Event-ID": str(middle)})).text)
        assert [e.id for e in resumed] == [e.id for e in events[18:]]


async def test_frames_reach_a_live_subscriber_within_the_window(settings: Settings) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=0.3))
    # A real server: the in-process transport hands over a response only when it ends.
    async with live_app(settings, engine) as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post(BASE, json={
            "first_chunk": {"sequence_id": 0, "text": "a b c", "end_of_input": True}})
        sid = response.json()["session_id"]
        arrivals: list[float] = []
        async with client.stream("GET", f"{BASE}/{sid}/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data:") and "content" in line:
                    arrivals.append(time.monotonic())
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        # Each delta is 300 ms after the last: none waits for the next one.
        assert len(arrivals) == 4 and all(gap > 0.2 for gap in gaps), gaps


def test_the_window_is_a_setting() -> None:
    assert Settings(output_coalesce_ms=0).output_coalesce_ms == 0
    with pytest.raises(ValueError):
        Settings(output_coalesce_ms=-1)


