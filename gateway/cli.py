"""``omni-gateway serve``: run the service with uvicorn; the client's commands (``stream``) live in
:mod:`omni_client.cli`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from types import FrameType

import uvicorn

from gateway.draining import Draining
from gateway.middleware import RequestIdLogFilter

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s req=%(request_id)s %(message)s"
#: How long uvicorn waits for open connections once the listener is closed.
CONNECTION_DRAIN_SEC = 30


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain period between SIGTERM and closing the listener.

    SIGTERM flips ``draining`` at once (``/readyz`` 503, no new engine work);
    the listener closes ``drain_sec`` later, then uvicorn waits for open
    connections and the lifespan gives owned sessions their grace period and
    releases the rest to other replicas. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, draining: Draining, drain_sec: float) -> None:
        super().__init__(config)
        self._draining = draining
        self._drain_sec = drain_sec

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining.active or self._drain_sec <= 0:
            self._draining.begin()
            super().handle_exit(sig, frame)
            return
        self._draining.begin()
        # A signal handler may interrupt the loop anywhere: schedule thread-safely.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, self._drain_sec, super().handle_exit, sig, frame)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--log-level", default="INFO")
    from omni_client.cli import add_commands

    add_commands(commands)
    args = parser.parse_args(argv)
    if args.command != "serve":
        sys.exit(args.run(args))

    from gateway.app import create_app
    from gateway.settings import Settings

    configure_logging(args.log_level)
    settings = Settings()
    draining = Draining()
    config = uvicorn.Config(create_app(settings, draining=draining), host=args.host, port=args.port,
                            log_config=None, timeout_graceful_shutdown=CONNECTION_DRAIN_SEC,
                            # The Realtime WebSocket: websockets' sans-I/O core (the
                            # "websockets" choice is its deprecated legacy API).
                            ws="websockets-sansio")
    DrainingServer(config, draining, settings.drain_sec).run()


if __name__ == "__main__":
    main()
