"""The replica's one stream reader (store/stream_reader.py), on real Redis and fakeredis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import redis.asyncio as aioredis

from gateway.store import stream_reader
from gateway.store.keys import reader_wake, session_keys
from gateway.store.redis_store import SessionStore
from gateway.store.stream_reader import Entry, StreamReader


def ids(entries: list[Entry]) -> list[str]:
    return [entry_id for entry_id, _ in entries]


@asynccontextmanager
async def reader_of(client: aioredis.Redis, block_ms: int = 5_000) -> AsyncIterator[StreamReader]:
    store = SessionStore(client, timeout_sec=2.0)
    reader = StreamReader(client, reader_wake("test"), store._call, block_ms=block_ms)
    try:
        yield reader
    finally:
        await reader.aclose()


def same(entries: list[Entry]) -> list[Entry]:
    return entries


async def blocked_clients(client: aioredis.Redis) -> int:
    info = await client.info("clients")
    return int(info["blocked_clients"])


async def test_many_followers_share_one_blocked_read(redis_url: str) -> None:
    """What the reader is for: 50 waiters, one blocked connection (each had its own)."""
    async with aioredis.Redis.from_url(redis_url) as client, reader_of(client) as reader, \
            AsyncExitStack() as stack:
        keys = [f"test:{{s{n}}}:in" for n in range(50)]
        subs = [await stack.enter_async_context(reader.subscribe(key, "0-0", same)) for key in keys]
        waits = [asyncio.create_task(sub.read(5_000)) for sub in subs]
        await asyncio.sleep(0.3)
        assert await blocked_clients(client) == 1
        reads_before = reader.reads
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.xadd(key, {"n": key})
        written = dict(zip(keys, await pipe.execute(), strict=True))
        got = await asyncio.gather(*waits)
        assert [ids(entries) for entries in got] == [[written[key].decode()] for key in keys]
        assert reader.reads - reads_before < 10  # entries of many streams come back in one read


async def test_a_join_does_not_wait_out_the_block_in_flight(redis_client: aioredis.Redis) -> None:
    async with reader_of(redis_client, block_ms=10_000) as reader, \
            reader.subscribe("test:{a}:in", "0-0", same):
        await asyncio.sleep(0.1)  # the read blocks on a only
        async with reader.subscribe("test:{b}:in", "0-0", same) as b:
            started = time.monotonic()
            written = await redis_client.xadd("test:{b}:in", {"x": "1"})
            assert ids(await b.read(10_000)) == [written.decode()]
            assert time.monotonic() - started < 2.0


async def test_followers_of_one_stream_read_from_their_own_positions(redis_client: aioredis.Redis) -> None:
    key = "test:{s}:out"
    first = (await redis_client.xadd(key, {"n": "1"})).decode()
    second = (await redis_client.xadd(key, {"n": "2"})).decode()
    async with reader_of(redis_client) as reader, reader.subscribe(key, "0-0", same) as whole, \
            reader.subscribe(key, first, same) as resumed:
        assert ids(await whole.read(2_000)) == [first, second]
        assert ids(await resumed.read(2_000)) == [second]
        third = (await redis_client.xadd(key, {"n": "3"})).decode()
        assert ids(await whole.read(2_000)) == [third]
        assert ids(await resumed.read(2_000)) == [third]
        assert await whole.read(50) == []  # nothing new: the wait times out


async def test_a_full_follower_is_read_again_once_it_catches_up(redis_client: aioredis.Redis,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_reader, "MAX_BUFFERED", 3)
    monkeypatch.setattr(stream_reader, "COUNT", 2)
    key = "test:{slow}:out"
    written = [(await redis_client.xadd(key, {"n": str(n)})).decode() for n in range(10)]
    async with reader_of(redis_client) as reader, reader.subscribe(key, "0-0", same) as slow:
        got: list[str] = []
        while len(got) < 10:
            batch = ids(await slow.read(2_000))
            assert batch, "the reader stopped reading a follower that caught up"
            assert len(batch) <= 4  # at most MAX_BUFFERED, plus what one read added on top
            got += batch
        assert got == written


async def test_the_reader_stops_with_its_last_follower(redis_client: aioredis.Redis) -> None:
    async with reader_of(redis_client) as reader:
        async with reader.subscribe("test:{a}:in", "0-0", same):
            await asyncio.sleep(0.05)
            assert reader.streams == 1
        assert reader.streams == 0
        assert reader._task is None
        # And starts again for the next one.
        async with reader.subscribe("test:{a}:in", "0-0", same) as again:
            written = (await redis_client.xadd("test:{a}:in", {"x": "1"})).decode()
            assert ids(await again.read(2_000)) == [written]


async def test_the_store_follows_input_and_frames_through_its_reader(store: SessionStore,
                                                                     redis_client: aioredis.Redis) -> None:
    keys = session_keys("s1é")  # the reader writes XREAD itself: a name with more bytes than characters
    async with store.input_stream("s1é", "0-0") as inputs, store.output_stream("s1é", "0-0") as frames:
        await redis_client.xadd(keys.input, {"s": "0"})
        await redis_client.xadd(keys.input, {"end": "123"})
        await redis_client.xadd(keys.output, {"e": "", "d": "héllo 🙂", "t": "0"})
        events = await inputs.read(2_000)
        while len(events) < 2:
            events += await inputs.read(2_000)
        assert [(e.kind, e.sequence_id, e.value) for e in events] == [("chunk", 0, ""), ("end", -1, "123")]
        assert [(f.data, f.last) for f in await frames.read(2_000)] == [("héllo 🙂", False)]


async def test_a_slow_follower_of_a_shared_stream_holds_at_most_its_cap_and_reads_the_rest_again(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SSE clients on one session, one of them not reading: the reads go on for the other,
    and the slow one's buffer stays capped (it kept the whole stream in memory); when it reads
    again it gets every entry, in order, from Redis."""
    monkeypatch.setattr(stream_reader, "MAX_BUFFERED", 16)
    async with aioredis.Redis.from_url(redis_url) as client, reader_of(client) as reader:
        key = session_keys("shared").output
        async with reader.subscribe(key, "0-0", same) as fast, reader.subscribe(key, "0-0", same) as slow:
            written = []
            for n in range(200):
                written.append((await client.xadd(key, {"n": str(n)})).decode())
                if n % 20 == 19:
                    got: list[Entry] = []
                    while len(got) < 20:
                        got += await fast.read(2_000)
                    assert ids(got) == written[-20:]
            assert len(slow._buffer) <= 16
            caught_up: list[Entry] = []
            while len(caught_up) < 200:
                caught_up += await slow.read(2_000)
            assert ids(caught_up) == written
