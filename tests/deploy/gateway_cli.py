"""Run the real ``omni-gateway`` command line up to the point where uvicorn would serve."""

from __future__ import annotations

from typing import Any

import pytest


def captured_cli_call(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, Any]:
    """The uvicorn settings ``omni-gateway <args>`` would serve with.

    Deployment files hard-code the command line and depend on the drain time
    the CLI gives uvicorn; this checks both against the code, not a copy.
    """
    import gateway.runtime.app
    import gateway.runtime.cli

    calls: list[dict[str, Any]] = []

    def capture(server: gateway.runtime.cli.DrainingServer, *_: Any, **__: Any) -> None:
        config = server.config
        calls.append({"host": config.host, "port": config.port,
                      "timeout_graceful_shutdown": config.timeout_graceful_shutdown})

    monkeypatch.setattr(gateway.runtime.cli.DrainingServer, "run", capture)
    monkeypatch.setattr(gateway.runtime.app, "create_app", lambda *args, **kwargs: object())
    monkeypatch.setattr(gateway.runtime.cli, "configure_logging", lambda level="INFO": None)
    gateway.runtime.cli.main(args)
    (call,) = calls
    return call
