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

Run: ``python -m bench.servers stamp|bare|bare-relay --port N`` (the benchmark does).
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
            frame = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(frame) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


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
    parser.add_argument("kind", choices=["stamp", "bare", "bare-relay"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0,
                        help="stamp: API worker processes beside the engine process (0: one process)")
    parser.add_argument("--engine-port", type=int, default=None, help="stamp with workers: the engine process's port")
    parser.add_argument("--token-interval", type=float, default=TOKEN_INTERVAL_SEC,
                        help="stamp, bare-relay: seconds between a session's tokens")
    args = parser.parse_args(argv)
    if args.kind in ("bare", "bare-relay"):
        app = bare_app if args.kind == "bare" else BareRelay(args.token_interval)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")  # type: ignore[arg-type]
        return
    from gateway.runtime.processes import serve
    from gateway.settings import Settings

    # The same process model as ``omni-gateway serve``, the stamping engine in the engine process.
    serve(Settings(api_workers=args.workers), "127.0.0.1", args.port, "WARNING", engine=stamp_engine(args.token_interval),
          engine_port=args.engine_port)


if __name__ == "__main__":
    main()
