"""A replica on every core: N API worker processes beside one engine process.

One Python process tops out near one core, and a replica's HTTP work (parse,
check, one Redis call, answer) is stateless: Redis holds every session. So
``omni-gateway serve`` with a real Redis runs:

- N **API workers** (``api-worker``), sharing the one listening socket this
  process bound: the kernel spreads connections over them. Each serves the
  whole API but opens no engine and runs no session work (``role="api"``);
- this process as the **engine process** (``role="engine"``): the engine,
  the runners and the tender, serving the same app for its own probes on a
  Unix socket in the replica's runtime folder (``--engine-port``: a loopback
  port instead), so the replica takes one TCP port, the public one.

Work an API worker's call starts is left in Redis and announced; the engine
process's tender claims it at once (``gateway/runtime/engine_card.py``). SIGTERM
reaches every process (forwarded here), and each drains as a replica does.
Workers start through ``omni-gateway-child``, so they die with this process
even on SIGKILL; one that dies alone is started again.

The embedded default (no ``OMNI_GATEWAY_REDIS_URL``: fakeredis in process)
cannot be shared, so it stays one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn.server import HANDLED_SIGNALS

from gateway.metrics import SHARED_DIR_ENV
from gateway.runtime.listeners import (
    ListenError,
    ReplicaDir,
    bind_tcp,
    bind_unix,
    is_listening,
    listen_failed,
)
from gateway.settings import Settings
from gateway.work.draining import Draining
from omni_adapter.port import Engine
from omni_adapter.process_lifetime import CHILD_LAUNCHER

logger = logging.getLogger(__name__)

#: How long uvicorn waits for open connections once the listener is closed.
CONNECTION_DRAIN_SEC = 30
#: The collector's thresholds once a server runs: Python's (700, 10, 10), but a full
#: collection 10x less often. With the start-up heap frozen, a full collection
#: walks the live sessions' objects: 15-25 ms with 200 streaming sessions, every
#: 1.6 s at 20,000 tokens/s, and every stream waited through it (the relay's
#: P99 at 200 sessions x 10 tokens/s went from 85 to 42 ms; bench/README.md,
#: section 2). What it would find is rare: those collections found nothing, as
#: short-lived cycles die in the young generations, still collected as often.
GC_THRESHOLDS = (700, 10, 100)


def api_workers(settings: Settings) -> int:
    """The setting, else one worker per core but one (the engine process's), at least one.

    0 means one process doing everything, as the embedded store must.
    """
    if settings.redis_url is None:
        return 0
    if settings.api_workers is not None:
        return settings.api_workers
    # The cores this process may run on (a cpuset), not the machine's; a
    # container's CPU quota is not visible here, so charts set the number.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


class RefusedHandshakeIsNotAnError(logging.Filter):
    """uvicorn 0.54's sans-I/O WebSocket logs ERROR "ASGI callable returned without completing
    handshake." after a refusal sent as an HTTP answer (a Realtime connection's 401, 404, 429:
    the error envelope, as OpenAI answers them), though that answer went out whole: it never
    marks such a handshake complete (upstream: Kludex/uvicorn#3138). A bad key is not a server
    error for alerting to wake someone for; that one line is dropped."""

    MESSAGE = "ASGI callable returned without completing handshake."

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.MESSAGE


def uvicorn_config(app: object, settings: Settings, **kwargs: object) -> uvicorn.Config:
    if not any(isinstance(f, RefusedHandshakeIsNotAnError) for f in logging.getLogger("uvicorn.error").filters):
        logging.getLogger("uvicorn.error").addFilter(RefusedHandshakeIsNotAnError())
    return uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=CONNECTION_DRAIN_SEC,  # type: ignore[arg-type]
                          # The Realtime WebSocket: websockets' sans-I/O core (the
                          # "websockets" choice is its deprecated legacy API). A message
                          # over the cap closes the socket (1009) before it is assembled.
                          ws="websockets-sansio", ws_max_size=settings.ws_max_size,
                          **kwargs)  # type: ignore[arg-type]


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain period between SIGTERM and closing the listener.

    SIGTERM flips ``draining`` at once (``/readyz`` 503, no new engine work);
    the listener closes ``drain_sec`` later, then uvicorn waits for open
    connections and the lifespan gives owned sessions their grace period and
    releases the rest to other replicas. A second signal exits at once.
    ``on_signal``: told of every signal this one gets (the API workers get it too).

    Once started, what the start made (modules, the app, the engine) is put
    out of the garbage collector's reach (``gc.freeze``): it lives as long as
    the process, and a full collection walked all of it while every stream
    waited (measured: a 29 ms stall of 20 streams half a second after they
    started, on the stamping engine; more with vLLM's heap in the process).
    Full collections then come less often (``GC_THRESHOLDS``).
    """

    def __init__(self, config: uvicorn.Config, draining: Draining, drain_sec: float,
                 on_signal: Callable[[int], None] | None = None) -> None:
        super().__init__(config)
        self._draining = draining
        self._drain_sec = drain_sec
        self._on_signal = on_signal
        draining.stop_server = self._stop_now

    def _stop_now(self) -> None:
        """Stop without a drain period (``Draining.fail``): the lifespan still hands the
        sessions over, and API workers are stopped with the engine process."""
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        addresses = [sock.getsockname() for sock in sockets or ()]
        try:
            await super().startup(sockets=sockets)  # listens on the bound sockets (listeners.py)
            if not all(map(is_listening, sockets or ())):  # uvloop drops a failed listen silently
                raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        except OSError as error:
            message = listen_failed(error, addresses[0]) if addresses else str(error)
            logger.error("%s", message)
            await self.lifespan.shutdown()
            raise ListenError(message) from error
        gc.collect()  # the start's own garbage, before the rest is frozen for good
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # However the server was told to stop: open SSE streams end first, or
        # uvicorn would wait out its graceful timeout for their connections.
        self._draining.close()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less raising the signals again once the server is done: that killed the
        process there (SIGTERM's default action), before ``serve`` could wait for its API workers'
        grace period (they died with it, their streams cut with no ``replica_stopping``) or
        remove its runtime folder, and it exited 143, not 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_signal is not None:
            self._on_signal(sig)
        if self._draining.active or self._drain_sec <= 0:
            self._draining.begin()
            super().handle_exit(sig, frame)
            return
        self._draining.begin()
        # A signal handler may interrupt the loop anywhere: schedule thread-safely.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, self._drain_sec, super().handle_exit, sig, frame)


def serve(settings: Settings, host: str, port: int, log_level: str, *, engine_port: int | None = None,
          engine: Engine | None = None) -> None:
    """Run a replica: one process, or API workers beside an engine process (see the module doc).

    Every socket is bound before the app (and so the model) loads: a port in
    use ends the replica in its first second (``gateway/runtime/listeners.py``).
    """
    from gateway.runtime.app import create_app

    draining = Draining(settings.shutdown_grace_sec)
    workers = api_workers(settings)
    listener = bind_tcp(host, port, "--port")
    if workers == 0:
        try:
            app = create_app(settings, engine=engine, draining=draining)
            config = uvicorn_config(app, settings, host=host, port=port)  # where it listens, for its log
            DrainingServer(config, draining, settings.drain_sec).run(sockets=[listener])
        finally:
            listener.close()
        exit_if_failed(draining)
        return
    folder = ReplicaDir(settings.replica_id)
    folder.create()
    try:
        if engine_port is None:
            engine_listener = bind_unix(folder.engine_socket)
            engine_address: dict[str, object] = {"uds": str(folder.engine_socket)}
        else:
            engine_listener = bind_tcp("127.0.0.1", engine_port, "--engine-port")
            engine_address = {"host": "127.0.0.1", "port": engine_port}
    except ListenError:
        listener.close()
        folder.remove()
        raise
    share_metrics(folder.metrics)
    # An engine given here is not the configured one: the workers learn what it checks from its card.
    pool = WorkerPool(listener, workers, settings.replica_id, log_level, str(folder.metrics),
                      preload_tokenizer=engine is None)
    pool.start()
    logger.info("replica %s: %d API workers on %s:%d, the engine process on %s", settings.replica_id,
                workers, host, port, engine_listener.getsockname())
    try:
        app = create_app(settings, engine=engine, draining=draining, role="engine")
        DrainingServer(uvicorn_config(app, settings, **engine_address), draining, settings.drain_sec,
                       on_signal=pool.signal).run(sockets=[engine_listener])
    finally:
        pool.stop()
        listener.close()
        engine_listener.close()
        folder.remove()
    exit_if_failed(draining)


def exit_if_failed(draining: Draining) -> None:
    """Exit non-zero when the replica stopped because it could not go on (``Draining.fail``
    logged why), so its supervisor starts it again."""
    if draining.failure is not None:
        raise SystemExit(1)


def share_metrics(folder: Path) -> None:
    """Keep this process's and its workers' metrics in ``folder``, so a scrape of the
    public port, answered by any worker, gives the replica's (``gateway/metrics.py``).

    Set before any metric exists: the workers inherit it, and this process's
    metrics are made after this, by ``create_app``'s lifespan.
    """
    os.environ[SHARED_DIR_ENV] = str(folder)
    # prometheus_client picks how values are kept when it is first imported.
    values = sys.modules.get("prometheus_client.values")
    if values is not None:
        values.ValueClass = values.get_value_class()  # type: ignore[attr-defined]


def serve_api_worker(settings: Settings, fd: int, *, preload_tokenizer: bool = True) -> None:
    """``omni-gateway api-worker --fd N``: serve the socket the engine process bound."""
    from gateway.runtime.app import create_app

    draining = Draining(settings.shutdown_grace_sec)
    app = create_app(settings, draining=draining, role="api", preload=preload_tokenizer)
    DrainingServer(uvicorn_config(app, settings), draining, settings.drain_sec).run(sockets=[socket.socket(fileno=fd)])


class WorkerPool:
    """The API workers: started, restarted when one dies alone, stopped with the replica."""

    def __init__(self, listener: socket.socket, count: int, replica_id: str, log_level: str,
                 shared_metrics: str, *, preload_tokenizer: bool = True) -> None:
        self._listener = listener
        self._options = [] if preload_tokenizer else ["--no-tokenizer-preload"]
        self._shared_metrics = shared_metrics
        self._count = count
        self._replica_id = replica_id
        self._log_level = log_level
        self.processes: list[subprocess.Popen[bytes]] = []
        self._stopping = threading.Event()
        #: Signals already passed on: a second SIGTERM would make a worker exit at once.
        self._signalled = False
        self._watcher = threading.Thread(target=self._watch, name="api-workers", daemon=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        launcher = Path(sys.executable).with_name(CHILD_LAUNCHER)
        # Through the launcher the worker dies with this process, even on SIGKILL.
        program = [str(launcher)] if launcher.exists() else [sys.executable]
        fd = self._listener.fileno()
        return subprocess.Popen(
            [*program, "-m", "gateway.runtime.cli", "api-worker", "--fd", str(fd), "--log-level", self._log_level,
             *self._options],
            pass_fds=(fd,), stdin=subprocess.DEVNULL,
            # The workers are this replica: the engine card they read is under its id.
            env=os.environ | {"OMNI_GATEWAY_REPLICA_ID": self._replica_id})

    def start(self) -> None:
        self.processes.extend(self._spawn() for _ in range(self._count))
        self._watcher.start()

    def _watch(self) -> None:
        # Never returns: PR_SET_PDEATHSIG fires when the *thread* that started
        # a worker ends, so the thread that starts replacements lives as long
        # as the process (a daemon thread), and only stops replacing.
        while True:
            time.sleep(1.0)
            if self._stopping.is_set():
                continue
            for index, process in enumerate(self.processes):
                if process.poll() is not None and not self._stopping.is_set():
                    logger.warning("API worker %d exited with %s; starting another", process.pid, process.returncode)
                    # Its counters still count; what it had live (connections) no longer does.
                    mark_process_dead(process.pid, self._shared_metrics)  # type: ignore[no-untyped-call]
                    self.processes[index] = self._spawn()

    def signal(self, sig: int) -> None:
        """Pass a signal on to every worker (they drain as this process does).

        This process's copy of the public socket is closed now: it accepts nothing, and kept
        open past the workers' drain it went on listening, so connections the edge opened then
        hung until the replica exited instead of being refused (and retried elsewhere)."""
        self._stopping.set()
        self._signalled = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(sig)
        self._listener.close()

    def stop(self, timeout_sec: float = CONNECTION_DRAIN_SEC + 5) -> None:
        self._stopping.set()
        if not self._signalled:
            self.signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=timeout_sec)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
