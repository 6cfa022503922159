"""Run the real ``omni-gateway`` command line up to the point where uvicorn would serve."""

from __future__ import annotations

from typing import Any

import pytest


def captured_cli_call(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, Any]:
    """The keyword arguments ``omni-gateway <args>`` passes to ``uvicorn.run``.

    Deployment files hard-code the command line and depend on the drain time
    the CLI gives uvicorn; this checks both against the code, not a copy.
    """
    import uvicorn

    import gateway.app
    import gateway.cli

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(gateway.app, "create_app", lambda *args, **kwargs: object())
    monkeypatch.setattr(gateway.cli, "configure_logging", lambda level="INFO": None)
    gateway.cli.main(args)
    (call,) = calls
    return call
