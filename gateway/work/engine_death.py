"""A replica whose engine died stops, so its supervisor starts it again.

vLLM does not restart a dead engine core, and a replica that lived on
without one would be worse than none: its tender would claim other
replicas' failed-over work and fail every session it took. So once the
engine says it is dead (``EngineDeadError``; an engine that is only
unreachable or starting is ``/readyz``'s business):

- the replica drains at once: ``/readyz`` answers 503 and it claims nothing;
- its runners hand their sessions back (``release``) instead of failing
  them: input and published frames are in Redis, so another replica goes
  on from there, as after a kill;
- the server stops and the process exits non-zero (``gateway/runtime/processes.py``),
  as ``vllm serve`` does when its engine dies.

Two ways notice it: a runner whose engine call failed, and ``watch_engine``
for a replica with no session running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.work.draining import Draining
from omni_adapter.port import Engine, EngineDeadError

#: How often an idle replica asks its engine whether it still lives.
WATCH_INTERVAL_SEC = 1.0


async def stop_if_dead(engine: Engine, stop: Callable[[str], None]) -> bool:
    """Whether the engine is dead for good; if it is, ``stop`` (``Draining.fail``) is told why.

    An engine only unhealthy for now (unreachable, starting) is not dead.
    """
    try:
        await engine.check_health()
    except EngineDeadError as exc:
        stop(f"{exc}; exiting so that this replica is started again")
        return True
    except Exception:
        return False
    return False


async def watch_engine(engine: Engine, draining: Draining, interval_sec: float = WATCH_INTERVAL_SEC) -> None:
    """Background task: stop the replica once its engine is dead (polled: the engines
    offer nothing to wait on; vLLM's check is a flag)."""
    while True:
        await asyncio.sleep(interval_sec)
        if await stop_if_dead(engine, draining.fail):
            return
