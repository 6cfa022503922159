"""Real ``omni-gateway serve`` processes on loopback, for the replica tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.redis_server import free_port


@dataclass
class Gateway:
    """One replica: its own process group, its log in ``workdir``."""

    name: str
    workdir: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: What runs: ``omni-gateway serve`` (vLLM), or e.g. ``tests.replicas.scripted_replica``.
    module: str = "gateway.runtime.cli serve"
    args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        # One process per replica: these tests are about replicas; API workers
        # beside an engine process have their own (test_api_workers.py).
        env = os.environ | {"OMNI_GATEWAY_API_WORKERS": "0"} | self.env | {"OMNI_GATEWAY_REPLICA_ID": self.name}
        with self.log.open("ab") as out:  # appended: a replica started again keeps its earlier log
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.module.split(), "--host", "127.0.0.1", "--port", str(self.port),
                 *self.args],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name}\n" + "\n".join(text.splitlines()[-lines:])


def wait_until(condition: Callable[[], bool], timeout: float, what: str, diagnostics: Callable[[], str],
               every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s\n{diagnostics()}"
        time.sleep(every)


def ready(gateway: Gateway) -> bool:
    assert gateway.alive(), f"{gateway.name} exited\n{gateway.tail()}"
    try:
        return httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def stop_all(gateways: list[Gateway]) -> None:
    for gateway in gateways:
        if gateway.alive():
            assert gateway.proc is not None
            os.killpg(gateway.proc.pid, signal.SIGKILL)
            gateway.proc.wait(timeout=30)
