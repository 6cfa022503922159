"""Operations routes: liveness, readiness and Prometheus metrics, and vLLM's own probes."""

from __future__ import annotations

import importlib.metadata
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


@router.get("/health", response_class=Response, responses=errors.error_responses(errors.EngineUnavailable))
@router.get("/ping", response_class=Response, responses=errors.error_responses(errors.EngineUnavailable))
@router.post("/ping", response_class=Response, responses=errors.error_responses(errors.EngineUnavailable))
async def health(resources: Res) -> Response:
    """vLLM's health check (and SageMaker's ``/ping``): 200 with no body while the engine is
    healthy, else 503; probes written for ``vllm serve`` run unchanged. ``/readyz`` says more."""
    try:
        await resources.engine.check_health()
    except Exception as exc:
        raise errors.EngineUnavailable(f"the engine is not healthy: {exc}") from exc
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    """This gateway's version, as vLLM's ``/version`` tells its own."""
    return {"version": VERSION}


#: The installed package's version (pyproject.toml's).
VERSION = importlib.metadata.version("omni-gateway")


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
async def metrics(resources: Res) -> Response:
    return Response(resources.metrics.render(), media_type=CONTENT_TYPE_LATEST)
