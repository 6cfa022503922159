"""An engine dead for good stops its replica (gateway/work/engine_death.py); one only unhealthy does not."""

from __future__ import annotations

import asyncio

from gateway.work.draining import Draining
from gateway.work.engine_death import watch_engine
from omni_adapter.scripted import ScriptedEngine


async def test_the_watch_stops_an_idle_replica_whose_engine_died() -> None:
    draining, stops = Draining(), []
    draining.stop_server = lambda: stops.append("stop")
    await asyncio.wait_for(watch_engine(ScriptedEngine(dead=True), draining, interval_sec=0.01), timeout=2)
    assert draining.active and stops == ["stop"]
    assert draining.failure is not None and "scripted engine marked dead" in draining.failure


async def test_an_engine_only_unhealthy_for_now_does_not_stop_the_replica() -> None:
    """Unreachable or starting (a sidecar restarting) is /readyz's business, not a reason to exit."""
    draining = Draining()
    watch = asyncio.create_task(watch_engine(ScriptedEngine(healthy=False), draining, interval_sec=0.01))
    await asyncio.sleep(0.2)
    assert not watch.done() and not draining.active and draining.failure is None
    watch.cancel()
