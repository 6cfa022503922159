"""``python -m tests.replicas.scripted_replica --port N``: a replica in the shape
``omni-gateway serve`` gives it (API workers beside the engine process), with
the scripted engine in the engine process instead of vLLM, so the process
tests need no model. Settings come from the environment, as for ``serve``.
"""

from __future__ import annotations

import argparse

from gateway.runtime.cli import configure_logging
from gateway.runtime.processes import serve
from gateway.settings import Settings
from omni_adapter.scripted import Script, ScriptedEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-port", type=int, default=None)
    parser.add_argument("--word-delay-sec", type=float, default=0.0, help="the scripted answer's pace")
    args = parser.parse_args()
    configure_logging("INFO")
    engine = ScriptedEngine(Script(word_delay_sec=args.word_delay_sec))
    serve(Settings(), args.host, args.port, "INFO", engine=engine, engine_port=args.engine_port)


if __name__ == "__main__":
    main()
