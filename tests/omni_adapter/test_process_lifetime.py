"""No engine process outlives its gateway, however the gateway ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.redis_server import free_port


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command may contain spaces and parentheses: fields follow the last ')'.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"  # a zombie is dead, only not reaped yet


def _wait_all_dead(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


_FORK_FAMILY = """
import os, time
from omni_adapter.process_lifetime import engine_children_die_with_parent
engine_children_die_with_parent()
if os.fork() == 0:
    if os.fork() == 0:
        time.sleep(120)
    time.sleep(120)
time.sleep(120)
"""

# vLLM on the CPU spawns: the engine core is a new interpreter, and so is its worker.
_SPAWN_FAMILY = """
import multiprocessing, time
from omni_adapter.process_lifetime import engine_children_die_with_parent

def worker():
    time.sleep(120)

def engine_core():
    multiprocessing.get_context("spawn").Process(target=worker).start()
    time.sleep(120)

if __name__ == "__main__":
    engine_children_die_with_parent()
    multiprocessing.get_context("spawn").Process(target=engine_core).start()
    time.sleep(120)
"""


@pytest.mark.parametrize("program", [_FORK_FAMILY, _SPAWN_FAMILY], ids=["fork", "spawn"])
def test_children_and_grandchildren_die_with_a_sigkilled_parent(program: str, tmp_path: Path) -> None:
    script = tmp_path / "family.py"
    script.write_text(program)
    parent = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    family: list[int] = []
    try:
        deadline = time.monotonic() + 30
        # fork: two sleepers; spawn: the resource tracker too.
        while len(_descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let the grandchild's interpreter arm its signal
        family = _descendants(parent.pid)
        assert len(family) >= 2
        parent.kill()
        parent.wait()
        assert _wait_all_dead(family, 5) == []
    finally:
        for pid in [parent.pid, *family]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.engine
def test_sigkilled_gateway_leaves_no_engine_process(tmp_path: Path) -> None:
    """The real command: start serving, SIGKILL it while the engine loads, nothing stays."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_GATEWAY_")}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    family: list[int] = []
    try:
        # Wait for the engine's worker: then both engine processes exist.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and gateway.poll() is None:
            family = _descendants(gateway.pid)
            titles = [Path(f"/proc/{p}/cmdline").read_bytes() for p in family if _alive(p)]
            if any(b"VLLM::Worker" in t for t in titles):
                break
            time.sleep(0.2)
        assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
        assert len(family) >= 2, "the engine processes never appeared"
        gateway.send_signal(signal.SIGKILL)
        gateway.wait()
        assert _wait_all_dead(family, 15) == []
    finally:
        log.close()
        for pid in [gateway.pid, *family]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
