"""Background work of a connection or a call, supervised: a failure is logged and answered, never lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import WebSocketDisconnect

logger = logging.getLogger(__name__)


def spawn(tasks: set[asyncio.Task[None]], work: Awaitable[None], name: str,
          on_failure: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run ``work`` as a task held in ``tasks`` (until it ends); if it fails, log it, then ``on_failure``."""

    async def supervised() -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except WebSocketDisconnect:  # the client left while told something: its socket's loop ends the rest
            logger.info("%s: the client left", name)
        except Exception:
            logger.exception("%s failed", name)
            if on_failure is not None:
                await on_failure()

    task = asyncio.create_task(supervised(), name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
