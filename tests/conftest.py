"""Shared fixtures: the real engines (in-process and sidecar), each started once per test session."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from omni_adapter.http_engine import HttpEngine, HttpEngineConfig, open_http_engine
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.port import Engine
from omni_adapter.vllm_engine import VllmEngine, VllmEngineConfig, open_vllm_engine
from tests.deploy.local_cluster import LocalCluster
from tests.loop_lag import LoopLagMonitor
from tests.omni_adapter.sessions import ALIAS, MODEL
from tests.stall_watch import StallWatch
from tests.vllm_sidecar import VllmSidecar

#: Fixtures that use the session's ``vllm serve`` (and ``real_engine``'s ``openai-http`` half).
SIDECAR_USERS = {"vllm_sidecar", "_http_engine", "http_engine"}
#: The session's ``vllm serve`` once a test needs it or it was launched ahead.
_sidecar: VllmSidecar | None = None
_sidecar_wanted = False
#: deploy/local/cluster.sh's run, launched ahead when a collected test uses it.
_cluster: LocalCluster | None = None
_cluster_wanted = False
#: The cluster launched ahead takes about a tenth of a core's time beside a busy test (CFS weights).
CLUSTER_AHEAD_NICENESS = 10


def _session_sidecar() -> VllmSidecar:
    global _sidecar
    if _sidecar is None:
        _sidecar = VllmSidecar()
    return _sidecar


def _uses_sidecar(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    return bool(SIDECAR_USERS & names) or (
        "real_engine" in names and callspec is not None and callspec.params.get("real_engine") == "openai-http")


def _rank(item: pytest.Item) -> int:
    if "replicas" in item.path.parts:
        return 0
    if "local_cluster" in getattr(item, "fixturenames", ()):
        return 2
    return 3 if item.path.name == "test_sidecar_failure.py" else 1


def pytest_configure() -> None:
    """The suite's engines run eager, in process and in every gateway a test starts (they inherit
    the environment): the CPU default, auto, would start a background torch.compile after each
    engine start, two minutes of CPU and a second engine's memory on a 2-core CI machine, for a
    cache the suite never uses. ``OMNI_GATEWAY_ENGINE_COMPILE=true`` still runs it compiled."""
    os.environ.setdefault("OMNI_GATEWAY_ENGINE_COMPILE", "false")


@pytest.hookimpl(trylast=True)  # after Hypothesis's own: its set-up is over then
def pytest_sessionstart() -> None:
    """Hypothesis imports parts of itself at a test's first example (its optimiser, its regex
    strategy), and pytest rewrites their asserts, compiling them from source. CPython 3.11.7
    keeps the AST's recursion depth per interpreter, not per thread (gh-106905): a compile in a
    worker thread at that moment (the suite's engines and tokenizers run many) failed a CI run
    with "AST constructor recursion depth mismatch". Imported here, once, while no other
    thread runs."""
    # The ones a first example imports (found by diffing sys.modules around one).
    import hypothesis.internal.conjecture.optimiser
    import hypothesis.strategies._internal.regex  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start engine processes of their own (tests/replicas: three gateways,
    each with its engine) run first, before the session's shared engines exist:
    beside those, three more engines ran a 24 GiB machine out of memory. The test
    that kills the shared sidecar runs last: before, the next test to need it
    waited ~45 s for a restart. The local cluster's test runs just before it, so
    the cluster launched ahead has had the other tests' time to start."""
    global _sidecar_wanted, _cluster_wanted
    items.sort(key=_rank)  # stable: order kept within
    _sidecar_wanted = any(_uses_sidecar(item) for item in items)
    _cluster_wanted = any(_rank(item) == 2 for item in items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The sidecar is launched with the first test after the replicas' (their engines are
    gone by then), so its ~50 s start (three processes importing torch and vLLM in turn)
    runs beside the tests before the first that needs it, not in front of that one. The
    local cluster (a sidecar of its own, two gateways, Redis, the edge: about a minute)
    is launched once the shared sidecar is up, so the two starts do not fight for the cores,
    and niced: it has minutes to get ready, and at full weight its start slowed the tests
    beside it enough to fail a timing test (the CLI's paced chunks were fed all at once)."""
    global _cluster
    if _rank(item) == 0:
        return
    if _sidecar_wanted and _sidecar is None:
        _session_sidecar().launch()
    if _cluster_wanted and _cluster is None and (_sidecar is None or _sidecar.has_been_ready or _sidecar.healthy()):
        _cluster = LocalCluster()
        _cluster.launch(niceness=CLUSTER_AHEAD_NICENESS)


def pytest_sessionfinish() -> None:
    if _sidecar is not None:
        _sidecar.stop()  # launched ahead but never used (its tests failed or were skipped)
    if _cluster is not None:
        _cluster.kill_everything()


@pytest.fixture(scope="session", autouse=True)
async def stall_watch() -> AsyncIterator[StallWatch]:
    """A thread that says why, should the session's event loop stop turning (tests/stall_watch.py)."""
    watch = StallWatch(asyncio.get_running_loop(), os.environ.get("OMNI_GATEWAY_TEST_REDIS_URL"))
    watch.start()
    yield watch
    watch.stop()


@dataclass(frozen=True)
class StartedEngine:
    engine: VllmEngine
    #: The event loop's worst lateness while the engine started (tests/omni_adapter/test_vllm_engine.py).
    start_loop_lag_sec: float


@pytest.fixture(scope="session")
async def started_vllm_engine() -> AsyncIterator[StartedEngine]:
    config = VllmEngineConfig(
        # 1 GiB of KV cache holds ~20K tokens of this model: the tests' prompts are short.
        model=str(ensure_default_model()), served_model_name=MODEL, kv_cache_space_gib=1,
        aliases=(ALIAS,),  # served under a second name too, as a deployment may (OMNI_GATEWAY_SERVED_MODEL_NAME)
        compile=False,  # no background compile in the suite (pytest_configure)
    )
    async with LoopLagMonitor(interval=0.05) as lag:
        engine = await open_vllm_engine(config)
    try:
        yield StartedEngine(engine, lag.max_sec)
    finally:
        await engine.aclose()


@pytest.fixture(scope="session")
def vllm_engine(started_vllm_engine: StartedEngine) -> VllmEngine:
    """The embedded default engine (SmolLM2-135M-Instruct on the CPU)."""
    return started_vllm_engine.engine


@pytest.fixture(scope="session")
def vllm_sidecar() -> Iterator[VllmSidecar]:
    """A real ``vllm serve`` (SmolLM2, prefix caching), one per test session, launched
    ahead (``pytest_runtest_setup``): this waits for it to be ready."""
    with _session_sidecar() as sidecar:
        yield sidecar


@pytest.fixture
def local_cluster() -> Iterator[LocalCluster]:
    """deploy/local/cluster.sh, launched ahead (``pytest_runtest_setup``) or now; killed after."""
    global _cluster
    if _cluster is None:
        _cluster = LocalCluster()
    if not _cluster.launched:
        _cluster.launch()
    try:
        yield _cluster
    finally:
        _cluster.kill_everything()


@pytest.fixture(scope="session")
async def _http_engine(vllm_sidecar: VllmSidecar) -> AsyncIterator[HttpEngine]:
    engine = await open_http_engine(HttpEngineConfig(base_url=vllm_sidecar.url, start_timeout_sec=0))
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest.fixture
def http_engine(_http_engine: HttpEngine, vllm_sidecar: VllmSidecar) -> HttpEngine:
    """The ``openai-http`` adapter over the sidecar, restarted first if a test killed it."""
    vllm_sidecar.ensure_running()
    return _http_engine


@pytest.fixture(params=["vllm", "openai-http"])
def real_engine(request: pytest.FixtureRequest) -> Engine:
    """Each real adapter in turn: the session tests must pass on all of them."""
    return request.getfixturevalue("vllm_engine" if request.param == "vllm" else "http_engine")
