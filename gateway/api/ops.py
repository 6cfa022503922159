"""Operations routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import errors
from gateway.web.resources import Resources, get_resources

logger = logging.getLogger(__name__)
router = APIRouter(tags=["operations"])
Res = Annotated[Resources, Depends(get_resources)]


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses=errors.error_responses(errors.ServiceUnavailable, errors.StoreUnavailable,
                                                      errors.EngineUnavailable))
async def readyz(resources: Res) -> dict[str, str]:
    """Ready for traffic: not shutting down, the tender runs, Redis answers and the engine is healthy."""
    try:
        if resources.draining.active:
            raise errors.EngineUnavailable("this replica is shutting down")
        if resources.tender.done():
            # Without its tender a replica neither expires sessions nor takes over work
            # (an API worker: without its watch it cannot tell whether the engine lives).
            raise errors.ServiceUnavailable("this replica's tender is not running")
        await resources.store.ping()
        try:
            await resources.engine.check_health()
        except Exception as exc:
            raise errors.EngineUnavailable(f"the engine is not healthy: {exc}") from exc
    except errors.GatewayError as exc:
        # Probes poll this every few seconds: say why, so "never became ready" can be read from the log.
        logger.warning("not ready: %s", exc.message)
        raise
    return {"status": "ready"}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(resources: Res) -> Response:
    return Response(resources.metrics.render(), media_type=CONTENT_TYPE_LATEST)
