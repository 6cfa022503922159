"""The stall watch (tests/stall_watch.py) names what holds the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests import stall_watch
from tests.stall_watch import StallWatch


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what the report must point at


async def test_a_held_loop_is_reported_with_the_call_that_holds_it(
        redis_server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stall_watch, "CHECK_SEC", 0.05)
    monkeypatch.setattr(stall_watch, "STALL_SEC", 0.3)
    watch = StallWatch(asyncio.get_running_loop(), redis_server_url)
    watch.start()
    try:
        await asyncio.sleep(0.2)
        assert watch.reports == []
        hold_the_loop(0.8)
        await asyncio.sleep(0.1)
    finally:
        watch.stop()
    (report,) = watch.reports
    assert "(the event loop's)" in report and "hold_the_loop" in report
    assert "Redis PING from a thread:" in report and " ms" in report.split("PING from a thread:")[1][:20]
