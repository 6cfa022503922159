"""No engine process outlives its gateway, however the gateway ends."""

from __future__ import annotations

import json
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


# The gateway's state when it forks the engine core: torch loaded with OpenMP's
# default thread count, a listening socket, an event loop's signal wakeup fd,
# warnings made errors in code.
_FORKED_ENGINE_CHILD = """
import json, multiprocessing, os, signal, socket, sys, warnings
import torch
from omni_adapter.process_lifetime import engine_children_die_with_parent

def child(report):
    fds = {int(fd) for fd in os.listdir("/proc/self/fd")}
    try:
        warnings.warn("a library's deprecation", DeprecationWarning)
        raised = False
    except DeprecationWarning:
        raised = True
    report.send({"warning_raised": raised, "listener_held": LISTENER in fds and os.path.realpath(f"/proc/self/fd/{LISTENER}").startswith("socket:"),
                 "threads": torch.get_num_threads(), "wakeup_fd": signal.set_wakeup_fd(-1)})
    report.close()
    signal.pause()

if __name__ == "__main__":
    listener = socket.create_server(("127.0.0.1", 0))
    LISTENER = listener.fileno()
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    torch.set_num_threads(2)
    warnings.simplefilter("error")  # as pytest's filterwarnings = error, set in code
    engine_children_die_with_parent()
    os.environ["OMP_NUM_THREADS"] = "1"  # what vLLM sets for its worker
    theirs, ours = multiprocessing.get_context("fork").Pipe(duplex=False)
    multiprocessing.get_context("fork").Process(target=child, args=(ours,), daemon=True).start()
    report = theirs.recv()
    port = listener.getsockname()[1]
    listener.close()  # the gateway stops listening, to drain
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        report["connects_after_close"] = True
    except ConnectionRefusedError:
        report["connects_after_close"] = False
    print(json.dumps(report))
"""


def test_a_forked_engine_child_holds_no_gateway_socket_and_takes_its_openmp_threads(tmp_path: Path) -> None:
    """vLLM's engine processes are forked from the gateway (a start's imports paid once): a
    forked child must not keep the gateway's listener (after the gateway closed it to drain,
    connections would queue where nobody accepts), nor report its signals to the gateway's
    event loop; it runs the OpenMP threads vLLM set for it, not the gateway's, and warns as a
    new interpreter does (under pytest's `error` filter, xgrammar's deprecation warning failed
    every tool call in the engine core)."""
    script = tmp_path / "forked.py"
    script.write_text(_FORKED_ENGINE_CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"warning_raised": False, "listener_held": False, "threads": 1, "wakeup_fd": -1,
                      "connects_after_close": False}
