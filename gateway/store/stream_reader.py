"""One blocking XREAD for many streams: the replica's reader, fanning entries out.

A runner waits for its session's input (``:in``), an SSE subscriber for its
session's frames (``:out``). Each waiting in a blocking XREAD of its own held
one Redis connection per waiter: about 34 KB per started session in the
gateway, plus Redis's buffers for the client. Here one task per replica reads
every stream that somebody follows in one ``XREAD BLOCK``, each stream from
the lowest position among its followers, and hands every subscription the
entries after its own position::

    subscribe(key, after) ─┐                 ┌─► Subscription.read() (input: runner)
    subscribe(key, after) ─┼─► StreamReader ─┼─► Subscription.read() (frames: SSE)
    wake-up stream ────────┘   XREAD BLOCK   └─► ...
                               k1 id1 k2 id2 ... wake id

Joining must not wait out a block the read in flight is already in: the
reader also reads a wake-up stream of its own, and a subscription the read
in flight does not cover appends to it, which ends the block at once (one
round trip per join, none per entry). Leaving needs nothing: entries of a
stream nobody follows any more are dropped, and the next read leaves it out.
With nobody left, the reader stops (its connection goes back to the pool).

A subscription buffers what it has not read yet, up to ``MAX_BUFFERED``
entries; a full one is left out of the reads until its reader catches up,
and entries read for the other followers of its stream meanwhile are not
kept for it (it reads them again), so a slow consumer costs memory in
Redis, not here.

Redis Cluster: one XREAD cannot span slots, and every session has a slot of
its own (its keys share the hash tag ``{<id>}``), so grouping by slot would
leave one stream per read. There each subscription reads its own stream, as
before (:class:`SoloSubscription`: one blocked connection per waiter).

Redis outages: the reader logs, backs off and reads again; subscriptions
simply wait (their callers already look again after their own timeouts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis

from gateway.store import raw_calls
from gateway.store.connection import retry_delay
from gateway.store.records import event_id_key
from gateway.store.replies import decoded

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: A stream entry as read: (id, {field: value}), decoded.
Entry = tuple[str, dict[str, str]]
#: Every Redis call the reader makes: bounded in time (plus ``extra`` seconds), errors translated.
CallGuard = Callable[[float], AbstractAsyncContextManager[None]]

#: How long one read blocks when no stream has entries; joins cut it short.
BLOCK_MS = 5_000
#: Entries per stream per read; a stream with more is read again at once.
COUNT = 256
#: Entries a subscription holds unread before the reader stops reading its stream for it.
MAX_BUFFERED = 1_024
#: A wake-up stream outlives its reader (a replica that died) by at most this.
WAKE_TTL_MS = 3_600_000


def entries_of(raw: Any) -> list[Entry]:
    """Stream entries as redis-py returns them, decoded."""
    return [(decoded(entry_id), {decoded(k): decoded(v) for k, v in fields.items()}) for entry_id, fields in raw]


def raw_entries(raw: Any) -> list[Entry]:
    """Stream entries as the parser gives them ([id, [field, value, ...]], bytes), decoded."""
    entries: list[Entry] = []
    for entry_id, fields in raw:
        pairs = zip(fields[::2], fields[1::2], strict=True)
        entries.append((entry_id.decode(), {k.decode(): v.decode() for k, v in pairs}))
    return entries


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Subscription(Generic[T]):
    """One follower of one stream: the entries after its position, parsed by ``parse``."""

    def __init__(self, key: str, after: str, parse: Callable[[list[Entry]], list[T]],
                 reader: StreamReader | None) -> None:
        self.key = key
        #: The id of the last entry handed to this subscription (read or buffered).
        self.position = after
        self._parse = parse
        self._reader = reader
        self._buffer: list[Entry] = []
        #: The read waiting for entries, if one is: a bare future, made only while
        #: waiting (an idle follower holds no Event, no task, no timer).
        self._waiter: asyncio.Future[None] | None = None

    @property
    def full(self) -> bool:
        return len(self._buffer) >= MAX_BUFFERED

    def deliver(self, entries: list[Entry]) -> None:
        """Entries the reader read from this stream; those up to ``position`` are old news here.

        Kept up to ``MAX_BUFFERED``; the rest is dropped, and ``position`` stays
        at the last one kept: a slow follower of a stream others read fast reads
        the rest from Redis again once it catches up (``read`` rejoins), instead
        of holding the whole stream here.
        """
        room = MAX_BUFFERED - len(self._buffer)
        if room <= 0:
            return
        mine = event_id_key(self.position)
        new = [entry for entry in entries if event_id_key(entry[0]) > mine][:room]
        if new:
            self._buffer += new
            self.position = new[-1][0]
            self.interrupt()

    def interrupt(self) -> None:
        """End the read in progress now (with what is buffered, perhaps nothing)."""
        if self._waiter is not None:
            _wake(self._waiter)

    async def read(self, block_ms: int | None) -> list[T]:
        """What arrived since the last read, waiting up to ``block_ms`` for the first (``None``: no wait)."""
        if not self._buffer and block_ms:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            # A bare timer rather than asyncio.timeout: a read per frame per subscriber,
            # and the timeout context costs four times as much (3.4 µs more per read).
            timer = loop.call_later(block_ms / 1000, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        was_full = self.full
        entries, self._buffer = self._buffer, []
        if was_full and self._reader is not None:
            try:
                await self._reader.rejoin(self)  # the reader left this stream out for us: read it again
            except asyncio.CancelledError:
                self._buffer = entries + self._buffer  # not read after all: keep them for the next read
                raise
        return self._parse(entries)


class SoloSubscription(Subscription[T]):
    """Redis Cluster: the subscription reads its own stream, one blocking XREAD each time."""

    def __init__(self, key: str, after: str, parse: Callable[[list[Entry]], list[T]],
                 client: aioredis.Redis, guard: CallGuard) -> None:
        super().__init__(key, after, parse, None)
        self._client = client
        self._guard = guard

    async def read(self, block_ms: int | None) -> list[T]:
        xread = asyncio.ensure_future(self._xread(block_ms))
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([xread, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiter = None
            if not xread.done():
                xread.cancel()  # interrupted: nothing is lost, the next read starts from ``position``
                await asyncio.gather(xread, return_exceptions=True)
        if xread.cancelled():
            return []
        entries = xread.result()
        if entries:
            self.position = entries[-1][0]
        return self._parse(entries)

    async def _xread(self, block_ms: int | None) -> list[Entry]:
        async with self._guard((block_ms or 0) / 1000):
            reply: Any = await self._client.xread({self.key: self.position}, block=block_ms, count=COUNT)
        return [entry for _, raw in reply or () for entry in entries_of(raw)]


class StreamReader:
    """This replica's reader of every stream its runners and subscribers follow.

    ``wake_key`` names a stream only this reader reads (see keys.py); ``guard``
    bounds and translates each call, like every other store call.
    """

    def __init__(self, client: aioredis.Redis, wake_key: str, guard: CallGuard, *,
                 multiplex: bool = True, block_ms: int = BLOCK_MS) -> None:
        self._client = client
        self._wake_key = wake_key
        self._guard = guard
        self._multiplex = multiplex
        self._block_ms = block_ms
        self._subscriptions: dict[str, set[Subscription[Any]]] = {}
        #: Each followed stream's name as an XREAD argument, encoded once (raw_calls.py says why).
        self._packed_keys: dict[str, str] = {wake_key: raw_calls.arg(wake_key)}
        self._xread_head = [raw_calls.arg(word) for word in ("XREAD", "COUNT", str(COUNT), "BLOCK", str(block_ms),
                                                             "STREAMS")]
        self._task: asyncio.Task[None] | None = None
        #: Set when somebody joins while no read is in flight.
        self._joined = asyncio.Event()
        #: The streams and positions of the read in flight (None: between reads).
        self._in_flight: dict[str, str] | None = None
        #: The last wake-up entry seen; "0-0" at first (an old entry only costs one extra read).
        self._wake_position = "0-0"
        #: A wake-up was sent for the read in flight: one is enough.
        self._woken = False
        #: Reads so far (a test and the benchmark look at it).
        self.reads = 0

    @property
    def streams(self) -> int:
        """How many streams somebody follows now."""
        return len(self._subscriptions)

    @asynccontextmanager
    async def subscribe(self, key: str, after: str,
                        parse: Callable[[list[Entry]], list[T]]) -> AsyncIterator[Subscription[T]]:
        """Follow ``key`` from after ``after`` until the block ends."""
        if not self._multiplex:
            yield SoloSubscription(key, after, parse, self._client, self._guard)
            return
        subscription = Subscription(key, after, parse, self)
        self._subscriptions.setdefault(key, set()).add(subscription)
        if key not in self._packed_keys:
            self._packed_keys[key] = raw_calls.arg(key)
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._run(), name="stream-reader")
            await self.rejoin(subscription)
            yield subscription
        finally:
            followers = self._subscriptions.get(key)
            if followers is not None:
                followers.discard(subscription)
                if not followers:
                    del self._subscriptions[key]
                    self._packed_keys.pop(key, None)
            if not self._subscriptions and self._task is not None:
                # Nobody follows anything: free the connection the blocked read holds.
                self._task.cancel()
                self._task = None

    async def rejoin(self, subscription: Subscription[Any]) -> None:
        """Make sure the reads cover ``subscription`` from its position, now."""
        flight = self._in_flight
        if flight is None:
            self._joined.set()  # between reads: the next one includes it
            return
        covered = subscription.key in flight and \
            event_id_key(flight[subscription.key]) <= event_id_key(subscription.position)
        if covered or self._woken:
            return
        self._woken = True
        try:
            async with self._guard(0):
                pipe = self._client.pipeline(transaction=False)
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self._wake_key, WAKE_TTL_MS)
                await pipe.execute()
        except Exception:
            # The read in flight ends within its block anyway; the join is late, not lost.
            logger.warning("stream reader: could not wake the read in flight", exc_info=True)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _positions(self) -> dict[str, str]:
        """Each followed stream from the lowest position among the followers with room."""
        positions: dict[str, str] = {}
        for key, followers in self._subscriptions.items():
            if len(followers) == 1:  # the usual case: one runner or one SSE client per stream
                (only,) = followers
                if not only.full:
                    positions[key] = only.position
                continue
            open_ = [s.position for s in followers if not s.full]
            if open_:
                positions[key] = min(open_, key=event_id_key)
        return positions

    def _xread(self, positions: dict[str, str]) -> raw_calls.Packed:
        keys = [self._packed_keys[key] for key in positions]
        return raw_calls.command([*self._xread_head, *keys, *map(raw_calls.arg, positions.values())])

    async def _run(self) -> None:
        failures = 0
        while True:
            positions = self._positions()
            if not positions:
                self._joined.clear()
                await self._joined.wait()
                continue
            positions[self._wake_key] = self._wake_position
            self._in_flight, self._woken = positions, False
            try:
                async with self._guard(self._block_ms / 1000):
                    (reply,) = await raw_calls.call(self._client, self._xread(positions), 1)
                if isinstance(reply, Exception):
                    raise reply
            except asyncio.CancelledError:
                raise
            except Exception:
                # Supervised: a Redis outage or a bug must not leave every runner without input.
                delay = retry_delay(failures)
                if failures == 0:
                    logger.warning("stream reader: read failed; retrying", exc_info=True)
                failures += 1
                await asyncio.sleep(delay)
                continue
            finally:
                self._in_flight = None
            failures = 0
            self.reads += 1
            # RESP3, redis-py's default protocol (connection.store_url keeps it): {key: entries}.
            for raw_key, raw in (reply or {}).items():
                key, entries = decoded(raw_key), raw_entries(raw)
                if key == self._wake_key:
                    self._wake_position = entries[-1][0] if entries else self._wake_position
                    continue
                for subscription in list(self._subscriptions.get(key, ())):
                    subscription.deliver(entries)
