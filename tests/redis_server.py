"""Start real ``redis-server`` processes on free loopback ports for the tests."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: Where ``free_port`` picks: below Linux's ephemeral range (32768-60999). A port
#: the OS handed out for a bind to port 0 and that was closed again can be handed
#: out to any process next: a replica's vLLM processes take several while it starts,
#: for a minute before it binds its own port, and one took it ("address already in
#: use", the replica exited). No bind to port 0 lands below the range.
FREE_PORT_RANGE = range(20_000, 32_768)
_picked: set[int] = set()


def free_port() -> int:
    """A loopback port free now, that no other call in this process returned."""
    while True:
        port = random.choice(FREE_PORT_RANGE)
        if port in _picked:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _picked.add(port)
        return port


def free_port_and(offset: int) -> int:
    """A free port whose port + ``offset`` is a valid, free port too."""
    while True:
        port = free_port()
        if port + offset > 65_535:
            continue
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    return free_port_and(10_000)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """One redis-server that a test can stop, freeze and start again (same port, same data dir)."""

    def __init__(self, workdir: Path, *, port: int | None = None, extra: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self._argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(workdir),
                      "--save", "", "--appendonly", "no", *extra]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        self._proc = subprocess.Popen(self._argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _answers_ping(self.port):
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """Stop it the hard way (kill -9): only what is on disk survives."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def freeze(self) -> None:
        """Stop answering without closing connections (SIGSTOP): clients hang, not fail."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            self._proc.wait(timeout=10)


@contextmanager
def redis_process(extra: Sequence[str] = ()) -> Iterator[RedisProcess]:
    with tempfile.TemporaryDirectory() as workdir:
        server = RedisProcess(Path(workdir), extra=extra)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@contextmanager
def redis_server() -> Iterator[str]:
    with redis_process() as server:
        yield server.url


@contextmanager
def redis_cluster(nodes: int = 3) -> Iterator[str]:
    """A Redis Cluster of ``nodes`` masters on loopback; yields a URL of one node."""
    with tempfile.TemporaryDirectory() as workdir:
        servers = []
        try:
            for i in range(nodes):
                folder = Path(workdir) / f"node{i}"
                folder.mkdir()
                server = RedisProcess(folder, port=free_cluster_port(), extra=["--cluster-enabled", "yes",
                                                     "--cluster-config-file", "nodes.conf"])
                server.start()
                servers.append(server)
            addresses = [f"127.0.0.1:{s.port}" for s in servers]
            subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create", *addresses,
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            _wait_cluster_ok(servers[0].port)
            yield servers[0].url
        finally:
            for server in servers:
                server.stop()


def _wait_cluster_ok(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"],
                              capture_output=True, text=True).stdout
        if "cluster_state:ok" in info:
            return
        time.sleep(0.1)
    raise RuntimeError("the Redis Cluster did not become ready")


class SentinelGroup:
    """A primary, its replica and a Sentinel watching them (quorum 1), on loopback.

    The shape ``redis_durability=replica`` needs: every acknowledged write is
    on the replica too, and when the primary dies Sentinel promotes the
    replica within about ``DOWN_AFTER_MS`` plus a failover.
    """

    MASTER = "omni-gateway"
    DOWN_AFTER_MS = 1000

    def __init__(self, workdir: Path) -> None:
        self.primary = RedisProcess(workdir / "primary", extra=["--appendonly", "no"])
        self.replica = RedisProcess(workdir / "replica", extra=[
            "--appendonly", "no", "--replicaof", "127.0.0.1", str(self.primary.port)])
        self.sentinel_port = free_port()
        self._conf = workdir / "sentinel.conf"
        self._conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.MASTER} {self.DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {self.MASTER} 10000\n")
        self._sentinel: subprocess.Popen[bytes] | None = None

    @property
    def sentinels(self) -> str:
        return f"127.0.0.1:{self.sentinel_port}"

    def start(self) -> None:
        for server in (self.primary, self.replica):
            server.workdir.mkdir(exist_ok=True)
            server.start()
        self._sentinel = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(self._conf),
                                           "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not (_answers_ping(self.sentinel_port) and self._replica_synced()):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica or the Sentinel did not come up")
            time.sleep(0.05)

    def _replica_synced(self) -> bool:
        info = subprocess.run(["redis-cli", "-p", str(self.replica.port), "info", "replication"],
                              capture_output=True, text=True).stdout
        return "master_link_status:up" in info

    def primary_port(self) -> int:
        """The port Sentinel names as the primary now."""
        reply = subprocess.run(["redis-cli", "-p", str(self.sentinel_port), "sentinel", "get-master-addr-by-name",
                                self.MASTER], capture_output=True, text=True).stdout.split()
        return int(reply[1])

    def stop(self) -> None:
        if self._sentinel is not None and self._sentinel.poll() is None:
            self._sentinel.terminate()
            self._sentinel.wait(timeout=10)
        for server in (self.primary, self.replica):
            server.stop()


@contextmanager
def sentinel_group() -> Iterator[SentinelGroup]:
    with tempfile.TemporaryDirectory() as workdir:
        group = SentinelGroup(Path(workdir))
        try:
            group.start()
            yield group
        finally:
            group.stop()
