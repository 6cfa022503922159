"""Script calls made at the same moment, sent to Redis in one round trip.

An engine steps every running request at once (vLLM decodes a token for each
per step), so every runner of a replica publishes a frame at about the same
moment. One EVALSHA each is one round trip and about 70 µs of redis-py per
call here; in one pipeline a call costs about 12 µs (bench/README.md,
section 2). ``run`` queues the call; a flush task sends everything queued
when it runs (the calls made in this turn of the event loop), and calls made
while a pipeline is in flight go in the next one:

    publish ─► run() ─┐                      ┌─ queued meanwhile
    publish ─► run() ─┼──► one pipeline ──►──┴─► the next pipeline
    publish ─► run() ─┘    (one alone: a pipeline of one)

A call alone waits one turn of the event loop more than a direct call.
Calls in a pipeline are independent (no MULTI): each gets its own reply or
error, and one failing does not fail the others. A round trip that fails or
times out fails every call in it, as each would have failed on its own.
That timer is the calls' only one (the store sets none per call, which cost
a tenth of the engine process's CPU): a call queued behind a round trip in
flight fails after two timeouts at most.
The pipeline is written as RESP directly (raw_calls.py): redis-py's pipeline
object cost more than the calls in it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from gateway.store import raw_calls
from gateway.store.scripts import LuaScripts

#: A queued call: script name, keys, args, and where its reply goes.
_Call = tuple[str, Sequence[str], Sequence[Any], "asyncio.Future[Any]"]
_EVALSHA = raw_calls.arg("EVALSHA")


@functools.lru_cache(maxsize=4096)
def _evalsha_head(sha: str, keys: tuple[str, ...]) -> str:
    """``EVALSHA sha numkeys key...`` encoded: the same for every publish of a session (one per
    token), so encoded once per session streaming now, not per call (a twentieth of the relay's CPU)."""
    return "".join([_EVALSHA, raw_calls.arg(sha), raw_calls.arg(len(keys)), *map(raw_calls.arg, keys)])


class ScriptPipe:
    def __init__(self, client: aioredis.Redis, scripts: LuaScripts, timeout_sec: float) -> None:
        self._client = client
        self._scripts = scripts
        self._timeout_sec = timeout_sec
        self._queued: list[_Call] = []
        self._flush: asyncio.Task[None] | None = None
        #: Round trips made (the tests count them).
        self.round_trips = 0

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queued.append((name, keys, args, future))
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_queued(), name="script-pipe")
        return await future

    async def _flush_queued(self) -> None:
        batch: list[_Call] = []
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                batch = [call for call in batch if not call[3].done()]  # callers that gave up
                if not batch:
                    continue
                try:
                    async with asyncio.timeout(self._timeout_sec):
                        replies = await self._send(batch)
                except Exception as exc:  # the round trip failed: so did every call in it
                    replies = [exc] * len(batch)
                for (*_, future), reply in zip(batch, replies, strict=True):
                    if future.done():
                        continue
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
        finally:
            self._flush = None
            # Cancelled (the loop is closing): nobody is left waiting on nothing.
            for *_, future in batch + self._queued:
                future.cancel()
            self._queued = []

    async def _send(self, batch: list[_Call]) -> list[Any]:
        self.round_trips += 1
        packed: raw_calls.Packed = []
        for name, keys, args, _ in batch:
            packed += [f"*{3 + len(keys) + len(args)}\r\n", _evalsha_head(self._scripts.sha(name), tuple(keys)),
                       *map(raw_calls.arg, args)]
        replies = await raw_calls.call(self._client, packed, len(batch))
        for index, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):  # Redis lost its scripts: this call loads it again
                name, keys, args, _ = batch[index]
                replies[index] = await self._scripts.run(name, keys, args)
        return replies
