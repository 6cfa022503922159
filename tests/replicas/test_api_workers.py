"""A replica on every core, for real: API worker processes beside the engine process.

The replica runs as ``omni-gateway serve`` runs it (``gateway/runtime/processes.py``)
with a scripted engine, against a real Redis. Calls reach the API workers on
the public port; the engine work they start runs in the engine process,
which learns of it at once from the announcement, not at its next tender
round (set to 30 s here, so a missed hand-off would show).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.runtime.listeners import ReplicaDir
from tests.redis_server import free_port, free_port_and, redis_process
from tests.replicas.gateways import wait_until

BASE = "/v1/streaming_input/sessions"


class Replica:
    """``omni-gateway serve``'s shape with a scripted engine: API workers on ``port``, the
    engine process on its Unix socket, or on ``engine_port`` when one is given."""

    def __init__(self, workdir: Path, redis_url: str, workers: int, *, port: int | None = None,
                 engine_port: int | None = None, drain_sec: float = 0, grace_sec: float = 0) -> None:
        self.port = port or free_port()
        self.engine_port = engine_port
        # Its own id: the runtime folder is named after it, and other test runs share /tmp.
        self.replica_id = f"workers-{uuid.uuid4().hex[:8]}"
        self.log = workdir / f"replica-{self.port}.log"
        env = os.environ | {"OMNI_GATEWAY_REDIS_URL": redis_url, "OMNI_GATEWAY_REPLICA_ID": self.replica_id,
                            "OMNI_GATEWAY_API_WORKERS": str(workers), "OMNI_GATEWAY_TEND_INTERVAL_SEC": "30",
                            "OMNI_GATEWAY_RATE_LIMIT_RPS": "0", "OMNI_GATEWAY_DRAIN_SEC": str(drain_sec),
                            "OMNI_GATEWAY_SHUTDOWN_GRACE_SEC": str(grace_sec)}
        engine_args = [] if engine_port is None else ["--engine-port", str(engine_port)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.replicas.scripted_replica", "--port", str(self.port), *engine_args],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_process(self) -> httpx.Client:
        """A client of the engine process's own server (its probes and metrics)."""
        if self.engine_port is not None:
            return httpx.Client(base_url=f"http://127.0.0.1:{self.engine_port}", timeout=5)
        engine_socket = ReplicaDir(self.replica_id).engine_socket
        return httpx.Client(base_url="http://engine", transport=httpx.HTTPTransport(uds=str(engine_socket)),
                            timeout=5)

    def workers(self) -> list[int]:
        # Replacements are started by another thread: its children are listed under its task.
        tasks = Path(f"/proc/{self.proc.pid}/task").glob("*/children")
        return sorted(int(pid) for task in tasks for pid in task.read_text().split())

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.tail()
        try:
            with httpx.Client(base_url=self.url, timeout=5) as public, self.engine_process() as engine:
                return public.get("/readyz").status_code == 200 and engine.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    with redis_process() as redis:
        yield from _running(Replica(tmp_path, redis.url, workers=2))


def _running(replica: Replica) -> Iterator[Replica]:
    try:
        wait_until(replica.ready, 60,
                   "the replica's processes ready", replica.tail)
        yield replica
    finally:
        if replica.proc.poll() is None:
            os.killpg(replica.proc.pid, signal.SIGKILL)
            replica.proc.wait(timeout=30)
        # Killed, it could not remove its runtime folder (a replica started again empties it).
        ReplicaDir(replica.replica_id).remove()


def test_api_workers_hand_started_work_to_the_engine_process_at_once(replica: Replica) -> None:
    assert len(replica.workers()) == 2
    with httpx.Client(base_url=replica.url, timeout=30) as client:
        handoffs = []
        for n in range(3):
            sid = client.post(BASE, json={"start_policy": "on_first_chunk"}).json()["session_id"]
            acked = client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": f"hello {n}",
                                                               "end_of_input": True})
            # An API worker has no room for engine work: it starts it for nobody.
            assert acked.status_code == 202 and acked.json()["started"], acked.text
            started = time.monotonic()
            result = client.get(f"{BASE}/{sid}/result", params={"wait": 20}).json()
            handoffs.append(time.monotonic() - started)
            assert result["state"] == "completed", result
            assert result["completion"]["choices"][0]["message"]["content"] == f"echo: hello {n}"
        # The tender's round is 30 s: only the announcement gets the work claimed this soon.
        assert max(handoffs) < 3, handoffs
    with replica.engine_process() as engine_process:
        owners = engine_process.get("/metrics").text
    assert 'omni_gateway_session_transitions_total{state="completed"} 3.0' in owners
    # A scrape of the public port reaches either worker, and each answers for the whole
    # replica: the chunks both workers took, the sessions the engine process completed.
    for _ in range(8):
        with httpx.Client(base_url=replica.url, timeout=10) as fresh_connection:
            scraped = fresh_connection.get("/metrics").text
        assert 'omni_gateway_chunks_total{modality="text",outcome="accepted"} 3.0' in scraped, scraped
        assert 'omni_gateway_session_transitions_total{state="completed"} 3.0' in scraped, scraped
        assert "omni_gateway_requests_in_flight" in scraped  # the answering process's own
        # Each metric once: Prometheus refuses a scrape that describes a metric twice.
        described = [line for line in scraped.splitlines() if line.startswith("# TYPE ")]
        assert len(described) == len(set(described)), scraped
    # Its engine is the scripted one, given in code: no worker loads the configured model's
    # tokenizer for checks that engine does not make. The load imported torch into each worker
    # after its heap was frozen, and every full collection then stalled its streams for 210 ms.
    assert "loading the tokenizer" not in replica.log.read_text(errors="replace")


def test_the_workers_check_requests_only_as_their_engine_does(replica: Replica) -> None:
    # The scripted engine counts no tokens, so nothing is too long for it: a one-process
    # replica takes this input, and the workers must too. (They used to check it against
    # the default model's tokenizer and context of 4,096 tokens, and refused it with 413.)
    long_text = "many words " * 4000
    with httpx.Client(base_url=replica.url, timeout=30) as client:
        sid = client.post(BASE, json={"start_policy": "on_end_only"}).json()["session_id"]
        acked = client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": long_text})
        assert acked.status_code == 202, acked.text
        # The engine calls functions, so the workers take tools (they refused them with 422,
        # "tools are not served here": the engine's card left its tools out).
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        chat = client.post("/v1/chat/completions", json={
            "model": "scripted", "messages": [{"role": "user", "content": "rain in Berlin?"}], "tools": [tool]})
        assert chat.status_code == 200, chat.text


def test_the_workers_die_with_the_engine_process_and_a_worker_that_dies_alone_comes_back(
        replica: Replica) -> None:
    first, second = replica.workers()
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: len(replica.workers()) == 2 and first not in replica.workers(), 20,
               "a new worker in place of the killed one", replica.tail)
    wait_until(replica.ready, 30, "the public port serving again", replica.tail)
    workers = replica.workers()
    replica.proc.kill()  # SIGKILL of the engine process alone, not of its group
    replica.proc.wait(timeout=30)

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                       for pid in workers)

    wait_until(gone, 20, "the API workers gone with their engine process", replica.tail)


def test_open_sse_streams_end_with_an_explicit_error_when_the_replica_stops(replica: Replica) -> None:
    """SIGTERM: each worker ends its open streams once the grace period (0 here) is over, with
    an ``error`` event that says so (their clients resume on another replica with Last-Event-ID),
    instead of holding the shutdown for uvicorn's 30 s graceful timeout."""
    with httpx.Client(base_url=replica.url, timeout=30) as client:
        sids = [client.post(BASE, json={"start_policy": "on_end_only"}).json()["session_id"] for _ in range(4)]
        with ExitStack() as streams:
            opened = [streams.enter_context(client.stream("GET", f"{BASE}/{sid}/events")) for sid in sids]
            assert all(response.status_code == 200 for response in opened)
            stopped = time.monotonic()
            replica.proc.send_signal(signal.SIGTERM)
            for response in opened:
                body = b"".join(response.iter_bytes())  # no frames were written: only the explicit end
                assert body.startswith(b"event: error") and b"replica_stopping" in body, body
            assert time.monotonic() - stopped < 10, "the streams ended with the shutdown"
    assert replica.proc.wait(timeout=20) == 0, replica.tail()
    assert "ASGI callable returned without completing response" not in replica.log.read_text(), replica.tail()


def test_a_stopping_replica_gives_its_streams_their_grace_refuses_new_connections_and_exits_clean(
        tmp_path: Path) -> None:
    """SIGTERM with API workers, as a rolling deploy sends it: after the drain period the port
    refuses connections (an edge retries them elsewhere; they used to hang until the replica
    died), open streams run on for the grace period and then end with ``replica_stopping``
    (the engine process used to die as its own server ended, taking its workers and their
    streams with it), and the replica exits 0, its runtime folder removed."""
    with redis_process() as redis:
        replica = Replica(tmp_path, redis.url, workers=1, drain_sec=0.5, grace_sec=3)
        for _ in _running(replica):
            with httpx.Client(base_url=replica.url, timeout=30) as client:
                sids = [client.post(BASE, json={"start_policy": "on_end_only"}).json()["session_id"]
                        for _ in range(2)]
                with ExitStack() as streams:
                    opened = [streams.enter_context(client.stream("GET", f"{BASE}/{sid}/events")) for sid in sids]
                    stopped = time.monotonic()
                    replica.proc.send_signal(signal.SIGTERM)
                    time.sleep(1.5)
                    with pytest.raises(ConnectionRefusedError):
                        socket.create_connection(("127.0.0.1", replica.port), timeout=2).close()
                    for response in opened:
                        body = b"".join(response.iter_bytes())
                        assert body.startswith(b"event: error") and b"replica_stopping" in body, body
                    assert time.monotonic() - stopped > 3, "the streams had their grace period"
            assert replica.proc.wait(timeout=30) == 0, replica.tail()
            assert not ReplicaDir(replica.replica_id).path.exists(), "the runtime folder is removed"


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process and its children listen on."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {conn.laddr.port for proc in tree for conn in proc.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN}


def test_replicas_on_adjacent_ports_both_become_ready_each_on_one_tcp_port(tmp_path: Path) -> None:
    """The engine process serves on a Unix socket: no replica takes its neighbour's port."""
    port = free_port_and(1)  # and its neighbour: the habit of compose files and local clusters
    with redis_process() as redis, ExitStack() as running:
        first = running.enter_context(contextmanager(_running)(Replica(tmp_path, redis.url, workers=1, port=port)))
        second = running.enter_context(contextmanager(_running)(
            Replica(tmp_path, redis.url, workers=1, port=port + 1)))
        assert listening_ports(first.proc.pid) == {port}, first.tail()
        assert listening_ports(second.proc.pid) == {port + 1}, second.tail()
        for replica in (first, second):
            with httpx.Client(base_url=replica.url, timeout=30) as client:
                sid = client.post(BASE, json={"start_policy": "on_end_only"}).json()["session_id"]
                client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "hi", "end_of_input": True})
                result = client.get(f"{BASE}/{sid}/result", params={"wait": 20}).json()
                assert result["completion"]["choices"][0]["message"]["content"] == "echo: hi", result


def serve_on_a_held_port(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``omni-gateway serve`` for real (the default engine: vLLM, which would load the model
    for a minute first if the port were bound after it); how it ended and how soon."""
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-m", "gateway.runtime.cli", "serve", "--host", "127.0.0.1", *args],
                           env=os.environ | env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    return ended, time.monotonic() - started


def test_a_port_in_use_stops_the_replica_before_the_model_loads_naming_port_and_setting() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        ended, took = serve_on_a_held_port(["--port", str(port)], {"OMNI_GATEWAY_API_WORKERS": "0"})
    assert ended.returncode == 1, ended.stderr
    assert f"cannot listen on 127.0.0.1:{port}: another process is listening there" in ended.stderr, ended.stderr
    assert "choose another with --port" in ended.stderr, ended.stderr
    # Python's start and the imports; the model would take a minute more.
    assert took < 10, (took, ended.stderr)


def test_an_engine_port_in_use_stops_the_replica_at_once_naming_engine_port() -> None:
    with redis_process() as redis, socket.create_server(("127.0.0.1", 0)) as held:
        port, engine_port = free_port(), held.getsockname()[1]
        ended, took = serve_on_a_held_port(["--port", str(port), "--engine-port", str(engine_port)],
                                           {"OMNI_GATEWAY_REDIS_URL": redis.url, "OMNI_GATEWAY_API_WORKERS": "1"})
        assert ended.returncode == 1, ended.stderr
        assert f"cannot listen on 127.0.0.1:{engine_port}" in ended.stderr, ended.stderr
        assert "choose another with --engine-port" in ended.stderr, ended.stderr
        assert took < 10, (took, ended.stderr)
        # It let the public port go again: nothing of it is left listening.
        with socket.create_server(("127.0.0.1", port)):
            pass
