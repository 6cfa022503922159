"""The server processes the overhead benchmark measures, on loopback.

``stamp``: the real gateway (real Redis, real HTTP stack, real runner) on the
scripted engine (:mod:`omni_adapter.scripted`, no inference): it answers each
finished input with tokens that carry the wall-clock time they were emitted,
so the client can time the relay (engine -> Redis -> SSE). Input it merely
accepts.

``bare``: the smallest ASGI app under the same uvicorn: the floor of an HTTP
round trip on this machine.

Run: ``python -m bench.servers stamp|bare --port N`` (the benchmark does).
"""

from __future__ import annotations

import argparse
import json
import time

import uvicorn

from omni_adapter.port import EngineRequest
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities

#: Time between stamped tokens: a fast GPU's decode pace.
TOKEN_INTERVAL_SEC = 0.01


class Stamps:
    """``count`` deltas, each the wall-clock time (ns) at which it is read: when it is emitted."""

    def __init__(self, count: int) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> str:
        return f"{time.time_ns()} "


def stamps(request: EngineRequest, _input: str) -> Stamps:
    return Stamps(request.sampling.max_tokens or 16)


def stamp_engine(token_interval_sec: float = TOKEN_INTERVAL_SEC) -> ScriptedEngine:
    """Stamped tokens at a decode pace, up to ``max_tokens``; keeps nothing per session
    (the benchmark measures the gateway's memory per session)."""
    script = Script(answer=stamps, word_delay_sec=token_interval_sec, end="length")
    return ScriptedEngine(script, capabilities=text_capabilities("stamp"), record=False)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["stamp", "bare"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0,
                        help="stamp: API worker processes beside the engine process (0: one process)")
    parser.add_argument("--engine-port", type=int, default=None, help="stamp with workers: the engine process's port")
    parser.add_argument("--token-interval", type=float, default=TOKEN_INTERVAL_SEC,
                        help="stamp: seconds between a session's tokens")
    args = parser.parse_args(argv)
    if args.kind == "bare":
        uvicorn.run(bare_app, host="127.0.0.1", port=args.port, log_level="warning")  # type: ignore[arg-type]
        return
    from gateway.processes import serve
    from gateway.settings import Settings

    # The same process model as ``omni-gateway serve``, the stamping engine in the engine process.
    serve(Settings(api_workers=args.workers), "127.0.0.1", args.port, "WARNING", engine=stamp_engine(args.token_interval),
          engine_port=args.engine_port)


if __name__ == "__main__":
    main()
