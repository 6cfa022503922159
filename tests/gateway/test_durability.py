"""What an acknowledged chunk survives, at each ``redis_durability`` (issue 29, item 10).

Sessions append as fast as they can; Redis (the primary) is killed with
SIGKILL mid-stream; then the chunks whose append got a 2xx are looked for
in the Redis that serves afterwards: the same server started again from its
AOF (``everysec``, ``always``), or the replica Sentinel promoted
(``replica``; it lagged half a second behind when the primary died).
``always`` and ``replica`` lose none. ``everysec`` loses
those Redis had not yet written when it died: none here as a rule (a killed
process leaves what it wrote in the page cache), the last second or two on
a machine crash or when a slow fsync made Redis hold back its writes; the
count is printed, not asserted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis

from gateway.settings import Settings
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings
from tests.redis_server import RedisProcess, redis_process, sentinel_group

SESSIONS = 4
#: Appending goes on this long before Redis is killed.
APPEND_SEC = 1.5
#: How far the replica falls behind before the primary dies.
LAG_SEC = 0.5


@contextmanager
def aof_redis(fsync: str) -> Iterator[tuple[Settings, Callable[[], str]]]:
    """Redis with its AOF fsynced ``fsync``; after the kill, the same server from its files."""
    with redis_process(extra=("--appendonly", "yes", "--appendfsync", fsync)) as server:
        def killed_and_back() -> str:
            server.kill()
            server.start()
            return server.url
        yield make_settings(redis_url=server.url, redis_timeout_sec=2, redis_durability=fsync), killed_and_back


@contextmanager
def replicated_redis() -> Iterator[tuple[Settings, Callable[[], str]]]:
    """A primary, its replica and Sentinel; after the kill, the promoted replica.

    The replica falls behind first, for ``LAG_SEC``, as a broken link would
    leave it: stopped, its connection to the primary cut (the primary then
    sends it nothing more). Asynchronous replication acknowledges the writes
    of that time, which only the primary has, and its death takes them.
    """
    with sentinel_group() as group:
        def killed_and_promoted() -> str:
            group.replica.freeze()
            with redis.Redis(port=group.primary.port) as primary:
                primary.client_kill_filter(_type="replica")
            time.sleep(LAG_SEC)
            group.primary.kill()
            group.replica.thaw()
            deadline = time.monotonic() + 30
            while group.primary_port() == group.primary.port:
                assert time.monotonic() < deadline, "Sentinel promoted no replica"
                time.sleep(0.05)
            return RedisProcess(group.replica.workdir, port=group.primary_port()).url
        settings = make_settings(redis_url=group.primary.url, redis_timeout_sec=2, redis_durability="replica",
                                 redis_sentinels=group.sentinels, redis_sentinel_master=group.MASTER)
        yield settings, killed_and_promoted


async def acknowledged_then_lost(settings: Settings, kill: Callable[[], str]) -> tuple[int, int]:
    """Chunks acknowledged before Redis was killed, and how many of them it no longer has."""
    acked: dict[str, list[int]] = {}
    async with app_client(settings, ScriptedEngine()) as client:
        sids = [(await client.post(BASE, json={"start_policy": "on_end_only"})).json()["session_id"]
                for _ in range(SESSIONS)]
        stop = asyncio.Event()

        async def append(sid: str) -> None:
            acked[sid] = []
            while not stop.is_set():
                seq = len(acked[sid])
                try:
                    response = await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": f"{seq} "})
                except httpx.HTTPError:
                    return
                if response.status_code not in (200, 202):
                    return  # refused (Redis is gone): not acknowledged, and the end of this run
                acked[sid].append(seq)

        appenders = [asyncio.ensure_future(append(sid)) for sid in sids]
        await asyncio.sleep(APPEND_SEC)
        url = await asyncio.to_thread(kill)
        stop.set()
        await asyncio.gather(*appenders)
    with redis.Redis.from_url(url) as after:
        stored = {sid: {int(seq) for seq in after.hkeys(f"sis:{{{sid}}}:digests")} for sid in sids}
    lost = sum(len(set(acked[sid]) - stored[sid]) for sid in sids)
    return sum(len(seqs) for seqs in acked.values()), lost


@pytest.mark.parametrize("level", ["everysec", "always", "replica"])
async def test_acknowledged_chunks_lost_when_redis_is_killed(level: str) -> None:
    setup = replicated_redis() if level == "replica" else aof_redis(level)
    with setup as (settings, kill):
        acked, lost = await acknowledged_then_lost(settings, kill)
    print(f"\nredis_durability={level}: {acked} chunks acknowledged, {lost} lost with a kill -9 of Redis")
    assert acked >= 10 * SESSIONS  # appending was under way (a busy machine appends slowly)
    if level != "everysec":
        assert lost == 0
