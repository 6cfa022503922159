"""The application factory and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from gateway.api.chat.completions import router as completions_router
from gateway.api.chat.responses import router as responses_router
from gateway.api.chat.responses_socket import router as responses_socket_router
from gateway.api.chat.router import router as chat_router
from gateway.api.chat.speech import router as speech_router
from gateway.api.chat.transcriptions import router as transcriptions_router
from gateway.api.demo.router import router as demo_router
from gateway.api.ops import VERSION
from gateway.api.ops import router as ops_router
from gateway.api.realtime.calls import router as calls_router
from gateway.api.realtime.client_secrets import router as client_secrets_router
from gateway.api.realtime.router import router as realtime_router
from gateway.api.realtime.sideband import serve_attaches
from gateway.api.realtime.webrtc import CALLS, Calls
from gateway.api.sessions import hot_routes
from gateway.api.sessions.router import router as sessions_router
from gateway.api.upload.router import UPLOAD_PATH
from gateway.api.upload.router import router as upload_router
from gateway.metrics import Metrics
from gateway.runtime.engine_card import FrontEngine, publish_card
from gateway.service.sessions import SessionService
from gateway.settings import Settings
from gateway.store.connection import open_redis
from gateway.store.redis_store import SessionStore
from gateway.web.error_handlers import SESSIONS_API, install_error_handlers
from gateway.web.identity import IdentityResolver
from gateway.web.middleware.admission import Admission, AdmissionMiddleware
from gateway.web.middleware.authentication import AuthenticationMiddleware
from gateway.web.middleware.bounded_body import BoundedBodyMiddleware
from gateway.web.middleware.request_id import RequestIdMiddleware
from gateway.web.resources import Resources
from gateway.work.draining import Draining
from gateway.work.engine_death import watch_engine
from gateway.work.pool import RunnerPool
from gateway.work.runner import SessionRunner
from gateway.work.tender import Tender
from omni_adapter.factory import (
    EngineChoice,
    open_engine,
    open_prompt_counter,
    open_request_checks,
    preload_tokenizer,
)
from omni_adapter.port import Engine, RequestChecks, SamplingOptions

#: The answer headers a browser page on an allowed origin may read (beside CORS's safelisted
#: ones): a stream's session, to resume it; a WebRTC call's place; when to come back.
EXPOSED_HEADERS = ["X-Session-Id", "X-Request-Id", "Location", "Retry-After"]

logger = logging.getLogger(__name__)


#: ``all``: one process does everything (the embedded default, tests);
#: ``engine``: the engine process of a replica with API workers (it runs the
#: engine, runners and tender, and publishes its engine card);
#: ``api``: an API worker (HTTP only; the engine card says what to accept).
Role = Literal["all", "engine", "api"]


def create_app(settings: Settings | None = None, *, engine: Engine | None = None,
               draining: Draining | None = None, role: Role = "all", preload: bool = True) -> FastAPI:
    """Build the app.

    Pass ``engine`` to share one already open (tests); it is then not closed
    here. ``draining`` is flipped by whoever handles SIGTERM (the CLI).
    ``preload``: an API worker loads the configured model's tokenizer
    while it waits for its engine process; false when that process runs an
    engine given in code (tests, benchmarks), whose card alone says what it checks.
    """
    settings = settings or Settings()
    draining = draining or Draining(settings.shutdown_grace_sec)
    admission = Admission(settings.max_in_flight_requests, settings.max_loop_lag_sec)

    choice = EngineChoice(
        kind=settings.engine, model=settings.model, served_model_name=settings.served_model_name,
        dtype=settings.dtype, max_model_len=settings.max_model_len,
        kv_cache_space_gib=settings.kv_cache_space_gib, max_num_seqs=settings.engine_max_num_seqs,
        compile=settings.engine_compile,
        engine_url=settings.engine_url,
        engine_timeout_sec=settings.engine_timeout_sec,
        engine_start_timeout_sec=settings.engine_start_timeout_sec,
        engine_audio=settings.engine_audio, recognizer=settings.recognizer,
        sampling_defaults=SamplingOptions(temperature=settings.default_temperature,
                                          top_p=settings.default_top_p),
        tool_call_parser=settings.tool_call_parser)

    async def open_active(store: SessionStore) -> Engine:
        if role == "api":
            return await FrontEngine.wait_for(store, settings.replica_id, settings.engine_start_timeout_sec)
        return engine or await open_engine(choice)

    async def open_checks(active: Engine, preloading: asyncio.Task[Any] | None) -> RequestChecks | None:
        if isinstance(active, RequestChecks):
            return active
        if not isinstance(active, FrontEngine) or not active.checks_requests:  # not an API worker, or
            if preloading is not None:  # its engine checks nothing ahead: no tokenizer needed after all
                preloading.cancel()
            return None
        # An API worker checks what the engine process would, from the same tokenizer.
        try:
            return await open_request_checks(choice, active.capabilities,
                                             None if preloading is None else await preloading)
        except Exception as exc:
            logger.warning("API worker: no tokenizer (%s); requests are checked when the engine runs them", exc)
            return None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Resources | Calls]]:
        async with open_redis(settings.redis_url, settings.redis_timeout_sec, cluster=settings.redis_cluster,
                              sentinels=settings.redis_sentinels,
                              sentinel_master=settings.redis_sentinel_master) as client:
            store = SessionStore(client, timeout_sec=settings.redis_timeout_sec,
                                 durability=settings.redis_durability, replica_wait_ms=settings.redis_replica_wait_ms)
            if settings.redis_url is not None:
                await store.check_durability(settings.redis_durability)
            own_engine = engine is None and role != "api"
            # An API worker loads its tokenizer while it waits for its engine process. Not when
            # that process runs an engine given in code: cancelling cannot stop the load's thread,
            # which imported torch into the worker after its heap was frozen, and every full
            # collection then walked those 430,000 objects (210 ms: bench/README.md, issue 31).
            preloading = asyncio.create_task(preload_tokenizer(choice), name="tokenizer") \
                if role == "api" and preload else None
            try:
                active = await open_active(store)
            except BaseException:
                if preloading is not None:
                    preloading.cancel()
                raise
            metrics = Metrics()
            metrics.watch_admission(admission)
            background = [asyncio.create_task(admission.watch(), name="loop-lag")]
            runners = RunnerPool(
                lambda sid, lease: SessionRunner(sid, lease, store, active, metrics, settings.lease_ttl_sec,
                                                 settings.engine_progress_timeout_sec, settings.idle_park_sec,
                                                 settings.output_coalesce_ms / 1000, on_engine_dead=draining.fail),
                # An API worker takes no engine work: what its calls start waits for the engine process.
                capacity=0 if role == "api" else settings.max_engine_sessions, listening_cap=settings.listening_cap)
            checks = await open_checks(active, preloading)
            # Prompts counted as the engine counts them: by its checks, else a sidecar's /tokenize.
            counter = await open_prompt_counter(choice, checks)
            service = SessionService(settings, store, active.capabilities, runners, metrics, draining,
                                     checks, admission.sheds_new_work, counter)
            if isinstance(active, FrontEngine):
                tender = asyncio.create_task(active.watch(), name="engine-watch")
            else:
                background.append(asyncio.create_task(watch_engine(active, draining), name="engine-death"))
                tender = asyncio.create_task(
                    Tender(store, runners, metrics, draining, settings.replica_id,
                           settings.schedule_policy, admission.sheds_new_work).run(settings.tend_interval_sec),
                    name="tender")
            if role == "engine":
                background.append(asyncio.create_task(
                    publish_card(store, settings.replica_id, active.capabilities,
                                 checks_requests=isinstance(active, RequestChecks)), name="engine-card"))
            calls = Calls(settings.webrtc_ice_servers)
            background.append(asyncio.create_task(calls.serve_hang_ups(store), name="call-hang-ups"))
            background.append(asyncio.create_task(serve_attaches(calls, store), name="call-control-sockets"))
            identity = IdentityResolver(settings.api_keys, settings.identity_header, settings.trusted_proxies)
            log_identity = logger.warning if identity.mode == "open" else logger.info
            log_identity("identity: %s", identity.describe())
            logger.info("omni-gateway ready: replica %s (%s), models %s", settings.replica_id, role,
                        ", ".join(active.capabilities.model_names))
            try:
                yield {"resources": Resources(settings, store, active, service, metrics, identity, draining,
                                              tender), CALLS: calls}
            finally:
                draining.begin()
                await calls.aclose()  # media cannot be handed over: the calls end, their sessions stay
                tender.cancel()
                for task in background:
                    task.cancel()
                await asyncio.gather(tender, *background, return_exceptions=True)
                # What is left of the grace period that began when the server stopped (streams
                # had it too); a dead engine finishes nothing: its sessions go to other replicas at once.
                await runners.aclose(0.0 if draining.failure else draining.grace_left())
                await store.aclose()
                if counter is not None:
                    await counter.aclose()
                if own_engine:
                    await active.aclose()

    app = FastAPI(title="omni-gateway", version=VERSION, lifespan=lifespan,
                  description="Streaming-input sessions in front of vLLM / vLLM-Omni. Besides these routes, "
                              "`GET /v1/realtime` upgrades to a WebSocket that speaks the OpenAI Realtime "
                              "protocol (GA event names; `?session_id=&last_event_id=` resumes a broken "
                              "connection); WebSockets are outside what OpenAPI describes.")
    # Last added runs first: request ids wrap everything, then CORS (a browser's
    # preflight carries no credentials, and every answer, errors too, needs its
    # headers), then load shedding (before any other work), then the caller's
    # identity (before any body is read), then bounded bodies.
    app.add_middleware(BoundedBodyMiddleware, max_bytes=settings.max_request_bytes,
                       idle_timeout_sec=settings.body_idle_timeout_sec,
                       max_header_bytes=settings.max_header_bytes,
                       streamed_paths=frozenset({UPLOAD_PATH}), streamed_idle_sec=settings.session_timeout_sec,
                       body_timeout_sec=settings.body_timeout_sec,
                       min_bytes_per_sec=settings.body_min_bytes_per_sec)
    app.add_middleware(AuthenticationMiddleware)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=EXPOSED_HEADERS)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(sessions_router)
    app.include_router(upload_router)
    app.include_router(chat_router)
    app.include_router(responses_router)
    app.include_router(responses_socket_router)
    app.include_router(completions_router)
    app.include_router(transcriptions_router)
    app.include_router(speech_router)
    app.include_router(realtime_router)
    app.include_router(client_secrets_router)
    app.include_router(calls_router)
    app.include_router(ops_router)
    if settings.demo:
        app.include_router(demo_router)
    hot_routes.install(app)
    install_error_handlers(app)
    # FastAPI's documented way to customise the schema is to replace this method.
    app.openapi = lambda: _openapi_with_envelope(app)  # type: ignore[method-assign]
    return app


def _openapi_with_envelope(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents its own 422 body; ours is the error envelope, so say so."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, description=app.description,
                           routes=app.routes)
        envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
        for path, operations in spec["paths"].items():
            for operation in operations.values():
                responses = operation["responses"]
                invalid = responses.get("422")
                if invalid is None:
                    continue
                invalid["content"] = {"application/json": {"schema": envelope}}
                if not path.startswith(SESSIONS_API):  # OpenAI's doors say 400 for it (error_handlers.py)
                    del responses["422"]
                    bad = responses.setdefault("400", {**invalid, "description": ""})
                    bad["description"] = ", ".join(d for d in (bad["description"], invalid["description"]) if d)
        for name in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema
