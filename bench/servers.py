"""The server processes the overhead benchmark measures, on loopback.

``stamp``: the real gateway (real Redis, real HTTP stack, real runner) on an
engine that does no inference: it answers each finished input with tokens
that carry the wall-clock time they were emitted, so the client can time the
relay (engine -> Redis -> SSE). Input it merely accepts.

``bare``: the smallest ASGI app under the same uvicorn: the floor of an HTTP
round trip on this machine.

Run: ``python -m bench.servers stamp|bare --port N`` (the benchmark does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import uvicorn

from omni_adapter.port import (
    Capabilities,
    EngineRequest,
    Finished,
    InputChunk,
    OutputEvent,
    TextDelta,
    Usage,
)

#: Time between stamped tokens: a fast GPU's decode pace.
TOKEN_INTERVAL_SEC = 0.01


@dataclass
class StampSession:
    request: EngineRequest
    _input_done: asyncio.Event = field(default_factory=asyncio.Event)
    _aborted: bool = False

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        return None

    async def end_input(self) -> None:
        self._input_done.set()

    async def events(self) -> AsyncIterator[OutputEvent]:
        await self._input_done.wait()
        tokens = self.request.sampling.max_tokens or 16
        for _ in range(tokens):
            if self._aborted:
                return
            yield TextDelta(f"{time.time_ns()} ")
            await asyncio.sleep(TOKEN_INTERVAL_SEC)
        yield Finished("length", Usage(prompt_tokens=1, completion_tokens=tokens))

    async def abort(self) -> None:
        self._aborted = True
        self._input_done.set()


@dataclass
class StampEngine:
    capabilities: Capabilities = field(default_factory=lambda: Capabilities(
        input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}),
        incremental=True, model_names=("stamp",)))

    def open_session(self, request: EngineRequest) -> StampSession:
        return StampSession(request)

    async def check_health(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


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
    args = parser.parse_args(argv)
    if args.kind == "bare":
        app: object = bare_app
    else:
        from gateway.app import create_app
        from gateway.settings import Settings

        app = create_app(Settings(), engine=StampEngine())
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
