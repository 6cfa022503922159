"""deploy/local/cluster.sh run as a user runs it: start, wait for "cluster: ready", stop, kill what is left.

The cluster's start (a `vllm serve` sidecar importing torch and vLLM three times in
turn, two gateways, Redis, the edge) takes about a minute; tests/conftest.py
launches it ahead, so it starts beside other tests rather than in front of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy import render_manifests
from tests.redis_server import free_port

SCRIPT = render_manifests.ROOT / "deploy" / "local" / "cluster.sh"
SERVICES = ("redis", "engine", "gateway-a", "gateway-b", "edge")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class LocalCluster:
    """One cluster.sh run in its own process group, its state and output in ``workdir``."""

    def __init__(self, workdir: Path | None = None) -> None:
        workdir = workdir or Path(tempfile.mkdtemp(prefix="local-cluster-"))
        self.state = workdir / "state"
        self.output = workdir / "cluster.out"
        self.ports = {name: free_port() for name in ("edge", "a", "b", "engine", "redis")}
        self.pgids: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def launched(self) -> bool:
        return self.proc is not None

    def launch(self, niceness: int = 0) -> None:
        """Start cluster.sh and return at once (``wait_ready`` waits for it); with a
        niceness, its processes take the CPU only as far as others leave it."""
        env = os.environ | {
            "EDGE_PORT": str(self.ports["edge"]),
            "GATEWAY_A_PORT": str(self.ports["a"]), "GATEWAY_B_PORT": str(self.ports["b"]),
            "ENGINE_PORT": str(self.ports["engine"]), "REDIS_PORT": str(self.ports["redis"]),
            "STATE_DIR": str(self.state), "READY_TIMEOUT": "900", "VENV": sys.prefix,
        }
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(["nice", "-n", str(niceness), "bash", str(SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def diagnostics(self) -> str:
        parts = [f"--- cluster.sh\n{tail(self.output)}"]
        parts += [f"--- {name}.log\n{tail(self.state / f'{name}.log', 25)}" for name in SERVICES]
        return "\n".join(parts)

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while "cluster: ready" not in (self.output.read_text() if self.output.exists() else ""):
            assert self.proc.poll() is None, f"cluster.sh exited with {self.proc.returncode}\n{self.diagnostics()}"
            assert time.monotonic() < deadline, f"not ready after {timeout} s\n{self.diagnostics()}"
            time.sleep(1)
        for name in SERVICES:
            self.pgids[name] = int((self.state / f"{name}.pid").read_text())

    def stop(self, timeout: float) -> int:
        """SIGTERM to the script, as Ctrl-C or a supervisor would; its trap stops the rest."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill_everything(self) -> None:
        """Last resort, also on failure: no process of this test may outlive it."""
        groups = set(self.pgids.values())
        for pid_file in self.state.glob("*.pid"):
            try:
                groups.add(int(pid_file.read_text()))
            except (OSError, ValueError):
                continue
        if self.proc is not None:
            groups.add(self.proc.pid)
        for pgid in groups:
            if group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait(timeout=30)
