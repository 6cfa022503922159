"""``omni-gateway serve``: run the service with uvicorn."""

from __future__ import annotations

import argparse
import logging

from gateway.middleware import RequestIdLogFilter

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s req=%(request_id)s %(message)s"


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="omni-gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)

    import uvicorn

    from gateway.app import create_app

    configure_logging(args.log_level)
    # Graceful shutdown: uvicorn stops accepting, then the lifespan closes
    # runners and the engine.
    uvicorn.run(create_app(), host=args.host, port=args.port, log_config=None,
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
