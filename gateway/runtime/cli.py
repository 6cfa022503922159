"""``omni-gateway serve``: run the service with uvicorn (one process, or API workers beside the engine's);
the client's commands (``stream``) live in :mod:`omni_client.cli`."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.runtime.processes import DrainingServer, serve_api_worker
from gateway.runtime.processes import serve as serve_replica
from gateway.web.middleware.request_id import RequestIdLogFilter

__all__ = ["DrainingServer", "configure_logging", "main"]

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
    serve.add_argument("--workers", type=int, default=None,
                       help="API worker processes beside the engine process (default: "
                            "OMNI_GATEWAY_API_WORKERS, else one per core but one; 0: one process). "
                            "Needs OMNI_GATEWAY_REDIS_URL: the in-process store is one process")
    serve.add_argument("--engine-port", type=int, default=None,
                       help="with API workers: serve the engine process's probes on this loopback port "
                            "(default: a Unix socket in the replica's runtime folder, so the replica "
                            "takes one TCP port, --port)")
    serve.add_argument("--log-level", default="INFO")
    worker = commands.add_parser("api-worker", help="one API worker (started by serve, not by hand)")
    worker.add_argument("--fd", type=int, required=True, help="the listening socket serve bound")
    worker.add_argument("--log-level", default="INFO")
    worker.add_argument("--no-tokenizer-preload", action="store_true",
                        help="do not load the configured model's tokenizer while waiting for the engine "
                             "process (serve passes it when that process runs an engine given in code)")
    from omni_client.cli import add_commands

    add_commands(commands)
    args = parser.parse_args(argv)
    if args.command not in ("serve", "api-worker"):
        sys.exit(args.run(args))

    from gateway.settings import Settings

    configure_logging(args.log_level)
    settings = Settings()
    if args.command == "api-worker":
        serve_api_worker(settings, args.fd, preload_tokenizer=not args.no_tokenizer_preload)
        return
    if args.workers is not None:
        settings = settings.model_copy(update={"api_workers": args.workers})
    serve_replica(settings, args.host, args.port, args.log_level, engine_port=args.engine_port)


if __name__ == "__main__":
    main()
