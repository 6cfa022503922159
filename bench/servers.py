"""The server processes the overhead benchmark measures, on loopback.

``stamp``: the real gateway (real Redis, real HTTP stack, real runner) on a
stamping engine (no inference, ``PacedStampEngine``): it answers each finished
input with tokens on a decode clock, each carrying the wall-clock time it was
due, so the client can time the relay (engine -> Redis -> SSE). Input it
merely accepts.

``bare``: the smallest ASGI app under the same uvicorn: the floor of an HTTP
round trip on this machine.

``bare-relay``: the relay's floor: the smallest ASGI app that streams the same
stamped tokens on the same decode clock as SSE frames of the same shape, to
the same client, with nothing between the clock and the socket (no Redis, no
runner, no framework). What the gateway adds to a token's lag is its relay
minus this.

``redis-relay``: the relay's floor with the gateway's contract, that a token
reaches a client only through Redis (so any replica can serve the stream and
none is lost): ``bare-relay`` plus, per token, an XADD (one pipelined round
trip for every session's token of a tick, whose reply the producer awaits,
as the gateway's relay does) and one XREAD for every stream, handing each
session its entries. No Lua, no lease, no frame beyond the text, no
framework: what the contract alone costs on this machine.

Run: ``python -m bench.servers stamp|bare|bare-relay|redis-relay --port N`` (the benchmark does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
import uvicorn

from omni_adapter.port import EngineRequest, Finished, OutputEvent, TextDelta, Usage
from omni_adapter.scripted import ScriptedEngine, ScriptedSession, text_capabilities

#: Time between stamped tokens: a fast GPU's decode pace.
TOKEN_INTERVAL_SEC = 0.01


@dataclass
class PacedStampSession(ScriptedSession):
    """An answer on a GPU's decode clock: token i is due i + 1 ticks of ``interval_sec`` after
    the input ended, whether or not the relay keeps up, and carries that due time (ns) as its
    text. The ticks are the same for every session, as an engine steps all its requests at once.

    Tokens that fell due while the relay was busy come as one delta, as vLLM's
    ``RequestOutputCollector`` merges the DELTA outputs its consumer has not
    taken yet. Each token keeps its own stamp, so the client times every
    token from when the engine made it, queueing included. (The scripted
    engine's own delay paces tokens by the consumer instead: a slow relay
    slowed the engine down, and its stamps left that wait out; the earlier
    relay results in bench/README.md were measured that way.)
    """

    interval_sec: float = TOKEN_INTERVAL_SEC

    async def events(self) -> AsyncIterator[OutputEvent]:
        await self._wake.wait()
        count = self.request.sampling.max_tokens or 16
        async for text in stamped_tokens(count, self.interval_sec, lambda: self.aborted):
            yield TextDelta(text)
        if not self.aborted:
            yield Finished("length", Usage(prompt_tokens=0, completion_tokens=count))


async def stamped_tokens(count: int, interval_sec: float, aborted: Callable[[], bool] = lambda: False,
                         ) -> AsyncIterator[str]:
    """``count`` stamps on a decode clock (see ``PacedStampSession``): each text holds the
    stamps (ns, space-separated) of the tokens that fell due since the last one was taken."""
    step_ns = int(interval_sec * 1e9)
    # One clock for every session, as an engine steps every running request at once:
    # each session's tokens fall due on the same ticks as everyone else's.
    start_ns = time.time_ns() // step_ns * step_ns
    sent = 0
    while sent < count and not aborted():
        wait_sec = (start_ns + (sent + 1) * step_ns - time.time_ns()) / 1e9
        # The relay waited for this token: it is made now. The event loop's
        # timers wake up to a millisecond late, and a real engine's output
        # wakes its consumer by I/O, so that slack is not the relay's.
        made_ns = 0
        if wait_sec > 0:
            await asyncio.sleep(wait_sec)
            made_ns = time.time_ns()
        due = min(count, (time.time_ns() - start_ns) // step_ns)
        yield "".join(f"{max(made_ns, start_ns + (i + 1) * step_ns)} " for i in range(sent, due))
        sent = due


@dataclass
class PacedStampEngine(ScriptedEngine):
    """Sessions answering on a decode clock (``PacedStampSession``); keeps nothing per
    session (the benchmark measures the gateway's memory per session)."""

    interval_sec: float = TOKEN_INTERVAL_SEC

    def open_session(self, request: EngineRequest) -> ScriptedSession:
        return PacedStampSession(request, accepts=self.capabilities.input_modalities, record=False,
                                 interval_sec=self.interval_sec)


def stamp_engine(token_interval_sec: float = TOKEN_INTERVAL_SEC) -> ScriptedEngine:
    return PacedStampEngine(capabilities=text_capabilities("stamp"), record=False, interval_sec=token_interval_sec)


async def bare_app(scope: dict, receive: object, send: object) -> None:
    """Read the body, answer with a small JSON body: what an append does minus the gateway."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()  # type: ignore[operator]
        more = message.get("more_body", False)
    body = json.dumps({"ok": True}).encode()
    await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})  # type: ignore[operator]


class BareRelay:
    """The relay's floor (``bare-relay``): answers the session calls the relay benchmark makes
    (create, the chunk that ends the input, the event stream) with nothing behind them; the
    stream sends each ``stamped_tokens`` text as one chat-completion chunk, then ``[DONE]``."""

    def __init__(self, interval_sec: float) -> None:
        self._interval_sec = interval_sec
        #: max_tokens and the input's end, per session id.
        self._sessions: dict[str, tuple[int, asyncio.Event]] = {}

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/")
        body = await _body(receive)
        if method == "POST" and path.endswith("/sessions"):
            session_id = uuid.uuid4().hex
            self._sessions[session_id] = (json.loads(body).get("max_tokens") or 16, asyncio.Event())
            await _json(send, 201, {"session_id": session_id})
        elif method == "POST" and path.endswith("/chunks"):
            self._sessions[path.split("/")[-2]][1].set()
            await _json(send, 202, {})
        elif method == "GET" and path.endswith("/events"):
            await self._stream(path.split("/")[-2], send)  # type: ignore[arg-type]
        else:
            await _json(send, 200, {})  # /readyz

    async def _stream(self, session_id: str, send: Callable) -> None:
        count, input_ended = self._sessions[session_id]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        await input_ended.wait()
        del self._sessions[session_id]  # the input has ended: no more calls for this session
        async for text in stamped_tokens(count, self._interval_sec):
            await send(_chunk(text))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


#: The last entry of a ``redis-relay`` stream (a stamped text holds digits and spaces, perhaps none).
END = "[DONE]"


class RedisRelay(BareRelay):
    """``redis-relay``: ``BareRelay`` with every token written to Redis and read back from it."""

    #: How long the one read blocks; a session joining meanwhile waits at most this (at its start).
    BLOCK_MS = 100

    def __init__(self, interval_sec: float, redis_url: str) -> None:
        super().__init__(interval_sec)
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url)
        #: XADDs made in this turn of the event loop, and where each one's reply goes.
        self._writes: list[tuple[str, str, asyncio.Future[None]]] = []
        self._flush: asyncio.Task[None] | None = None
        #: Each followed stream: its reader's position and its session's queue.
        self._followers: dict[str, tuple[list[str], asyncio.Queue[list[str]]]] = {}
        self._joined = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def _stream(self, session_id: str, send: Callable) -> None:
        count, input_ended = self._sessions[session_id]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        await input_ended.wait()
        del self._sessions[session_id]
        key = f"floor:{session_id}"
        queue: asyncio.Queue[list[str]] = asyncio.Queue()
        self._followers[key] = (["0-0"], queue)
        self._joined.set()
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        producer = asyncio.create_task(self._produce(key, count))
        try:
            ended = False
            while not ended:
                for text in await queue.get():
                    if text == END:
                        ended = True
                        break
                    await send(_chunk(text))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            del self._followers[key]
            producer.cancel()

    async def _produce(self, key: str, count: int) -> None:
        async for text in stamped_tokens(count, self._interval_sec):
            await self._write(key, text)
        await self._write(key, END)

    async def _write(self, key: str, text: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writes.append((key, text, future))
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_writes())
        await future

    async def _flush_writes(self) -> None:
        from gateway.store import raw_calls

        try:
            while self._writes:
                batch, self._writes = self._writes, []
                packed: list[str] = []
                for key, text, _ in batch:
                    packed += raw_calls.command(map(raw_calls.arg, ("XADD", key, "*", "d", text)))
                await raw_calls.call(self._redis, packed, len(batch))
                for *_, future in batch:
                    future.set_result(None)
        finally:
            self._flush = None

    async def _read(self) -> None:
        from gateway.store import raw_calls

        while True:
            if not self._followers:
                self._joined.clear()
                await self._joined.wait()
                continue
            keys = list(self._followers)
            positions = [self._followers[key][0][0] for key in keys]
            command = raw_calls.command(map(raw_calls.arg, ("XREAD", "BLOCK", str(self.BLOCK_MS), "STREAMS",
                                                            *keys, *positions)))
            (reply,) = await raw_calls.call(self._redis, command, 1)
            for raw_key, entries in (reply or {}).items():
                follower = self._followers.get(raw_key.decode())
                if follower is None or not entries:
                    continue
                follower[0][0] = entries[-1][0].decode()
                follower[1].put_nowait([fields[1].decode() for _, fields in entries])


def _chunk(text: str) -> dict:
    """``text`` as the ASGI message of one chat-completion chunk's SSE event."""
    frame = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"type": "http.response.body", "body": b"data: " + orjson.dumps(frame) + b"\n\n", "more_body": True}


async def _body(receive: object) -> bytes:
    parts, more = [], True
    while more:
        message = await receive()  # type: ignore[operator]
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


async def _json(send: object, status: int, payload: dict) -> None:
    await send({"type": "http.response.start", "status": status,  # type: ignore[operator]
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})  # type: ignore[operator]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["stamp", "bare", "bare-relay", "redis-relay"])
    parser.add_argument("--redis-url", default=None, help="redis-relay: the Redis its tokens go through")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0,
                        help="stamp: API worker processes beside the engine process (0: one process)")
    parser.add_argument("--engine-port", type=int, default=None, help="stamp with workers: the engine process's port")
    parser.add_argument("--token-interval", type=float, default=TOKEN_INTERVAL_SEC,
                        help="stamp, bare-relay: seconds between a session's tokens")
    args = parser.parse_args(argv)
    if args.kind in ("bare", "bare-relay", "redis-relay"):
        app = bare_app if args.kind == "bare" else BareRelay(args.token_interval) if args.kind == "bare-relay" \
            else RedisRelay(args.token_interval, args.redis_url)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")  # type: ignore[arg-type]
        return
    from gateway.runtime.processes import serve
    from gateway.settings import Settings

    # The same process model as ``omni-gateway serve``, the stamping engine in the engine process.
    serve(Settings(api_workers=args.workers), "127.0.0.1", args.port, "WARNING", engine=stamp_engine(args.token_interval),
          engine_port=args.engine_port)


if __name__ == "__main__":
    main()
