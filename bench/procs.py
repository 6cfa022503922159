"""Start and stop the processes a benchmark measures (gateway, bare app)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def server(module_args: list[str], *, port: int, env: dict[str, str], log: Path,
           ready_path: str = "/healthz", start_timeout_sec: float = 900,
           cwd: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python -m <module_args>`` until the block ends; wait until ``ready_path`` answers 200.

    ``cwd``: the tree whose modules run (``-m`` looks there first), e.g. another commit's.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", *module_args], env=os.environ | env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=cwd)
    try:
        deadline = time.monotonic() + start_timeout_sec
        while True:
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{module_args[0]} exited; the end of {log}:\n{tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{module_args[0]} not ready after {start_timeout_sec} s; see {log}")
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], timeout_sec: float = 30) -> None:
    """SIGTERM to the process's group, SIGKILL if it is still there after ``timeout_sec``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_sec)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@contextmanager
def embedded_gateway(env: dict[str, str], workdir: Path) -> Iterator[str]:
    """``gateway.runtime.cli serve`` on its embedded default (real vLLM on the CPU, voice), ready; its URL."""
    from tests.redis_server import free_port

    port = free_port()
    with server(["gateway.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], port=port, env=env,
                log=workdir / "gateway.log", ready_path="/readyz"):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def embedded_gateway_on_redis(env: dict[str, str]) -> Iterator[str]:
    """``embedded_gateway`` on a real Redis of its own, its log in a temporary folder; its URL."""
    from tests.redis_server import redis_process

    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp, \
            embedded_gateway(env | {"OMNI_GATEWAY_REDIS_URL": redis.url}, Path(tmp)) as url:
        yield url


def write_results(directory: Path, name: str, result: dict, markdown: str) -> None:
    """``<name>.json`` and ``<name>.md`` in ``directory``; the markdown is printed too."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (directory / f"{name}.md").write_text(markdown)
    print(markdown)
