"""What a replica's engine process tells its API workers, through Redis.

A replica may run its HTTP API in several worker processes (one per core)
beside one engine process, which opened the engine and runs the runners and
the tender (``gateway/runtime/processes.py``). The API workers are stateless and
open no engine, but they check every call against what the engine takes
and produces. So the engine process publishes an *engine card* (its
capabilities) under the replica's id, renewed while it lives; an API worker
reads it at start (waiting for the engine to be up) and is healthy only
while it stays fresh.

Work an API worker's call starts it cannot take (it has no room): it waits
in Redis and is announced (``SessionStore.work_waiting``), so the engine
process's tender claims it at once rather than at its next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from gateway import errors
from gateway.store.redis_store import SessionStore
from omni_adapter.port import Capabilities, EngineRequest, EngineSession, EngineUnavailableError

logger = logging.getLogger(__name__)

#: The card lapses this long after the engine process last renewed it.
CARD_TTL_SEC = 10.0
#: How often the engine process renews it, and an API worker reads it.
CARD_RENEW_SEC = 2.0


def card_json(capabilities: Capabilities, checks_requests: bool) -> str:
    """``checks_requests``: the engine checks requests before running them (token counts), so the
    API workers must too; an engine that checks nothing (a sidecar, a scripted engine) must not be
    fronted by workers that refuse what it would take."""
    # Every field of the capabilities, by name: a field left off (``tools`` was) makes the
    # API workers refuse what the engine serves.
    fields = {f.name: getattr(capabilities, f.name) for f in dataclasses.fields(Capabilities)}
    return json.dumps({**fields, "input_modalities": sorted(capabilities.input_modalities),
                       "output_modalities": sorted(capabilities.output_modalities),
                       "checks_requests": checks_requests})


def read_card(card: str) -> tuple[Capabilities, bool]:
    """The engine's capabilities and whether it checks requests."""
    fields = json.loads(card)
    checks_requests = bool(fields.pop("checks_requests", True))
    return (Capabilities(**{**fields, "input_modalities": frozenset(fields["input_modalities"]),
                            "output_modalities": frozenset(fields["output_modalities"]),
                            "model_names": tuple(fields["model_names"])}),
            checks_requests)


async def publish_card(store: SessionStore, replica: str, capabilities: Capabilities, checks_requests: bool) -> None:
    """Background task of the engine process: keep the card fresh while it lives.

    Supervised: a failed renewal is logged and tried again; a card that
    lapses meanwhile only makes the API workers report not ready.
    """
    card = card_json(capabilities, checks_requests)
    while True:
        try:
            await store.publish_engine_card(replica, card, CARD_TTL_SEC)
        except Exception as exc:
            logger.warning("engine card: could not renew it (%s)", getattr(exc, "message", exc))
        await asyncio.sleep(CARD_RENEW_SEC)


class FrontEngine:
    """An API worker's view of its replica's engine: capabilities, health, no sessions."""

    def __init__(self, store: SessionStore, replica: str, capabilities: Capabilities,
                 checks_requests: bool) -> None:
        self._store = store
        self._replica = replica
        self.capabilities = capabilities
        #: The engine checks requests itself: this worker checks them the same way.
        self.checks_requests = checks_requests
        self._fresh = True

    @classmethod
    async def wait_for(cls, store: SessionStore, replica: str, timeout_sec: float) -> FrontEngine:
        """The replica's engine as soon as its card is there (the engine may take a minute to start)."""
        deadline = time.monotonic() + timeout_sec
        logged = False
        while True:
            try:
                card = await store.engine_card(replica)
            except errors.StoreUnavailable as exc:
                card, reason = None, exc.message
            else:
                reason = "not published yet"
            if card is not None:
                return cls(store, replica, *read_card(card))
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"replica {replica}: no engine process after {timeout_sec:g} s")
            if not logged:
                logger.info("API worker: waiting for the engine process of replica %s (%s)", replica, reason)
                logged = True
            await asyncio.sleep(0.5)

    async def watch(self) -> None:
        """Background task: follow the card, so health is known without a Redis call per probe."""
        while True:
            await asyncio.sleep(CARD_RENEW_SEC)
            try:
                self._fresh = await self._store.engine_card(self._replica) is not None
            except errors.StoreUnavailable:
                self._fresh = False  # /readyz says so too, from its own ping

    def open_session(self, request: EngineRequest) -> EngineSession:
        raise EngineUnavailableError("an API worker runs no engine sessions; its engine process does")

    async def check_health(self) -> None:
        if not self._fresh:
            raise EngineUnavailableError(f"the engine process of replica {self._replica} stopped renewing "
                                         "its card")

    async def aclose(self) -> None:
        return None
