"""Engine processes die with the process that started them.

vLLM on the CPU starts an ``EngineCore`` process, which starts its
``Worker``; each holds the model and the KV cache (3.8 GB each here). The
worker watches the engine core through a pipe, but nothing watches the
gateway: a gateway killed with SIGKILL (an OOM kill, a liveness-probe kill,
``kill -9``) left both running for good, so a restarted pod had no memory
left for its new engine.

Linux delivers a chosen signal to a process when its parent dies
(``PR_SET_PDEATHSIG``). The setting belongs to the child, is cleared by
``fork`` and kept across ``exec``, so it is set in each child, both ways
Python's multiprocessing starts one:

- ``fork`` (vLLM's choice on a GPU host before CUDA is initialized, and ours
  on the CPU: vllm_engine.py): a fork hook sets it in the child. The same
  hook gives a forked child what a spawned one has anyway: none of the
  gateway's network sockets, no signal wakeup fd of the gateway's event loop,
  the OpenMP thread count its environment names, and a new interpreter's
  warning filters;
- ``spawn`` (vLLM's own choice on the CPU): the child is a new interpreter, so
  multiprocessing is pointed at ``omni-gateway-child``, a console script
  that sets it and then execs the real interpreter with the same arguments,
  its ``-c`` program first calling ``engine_children_die_with_parent()`` so
  the child's own children (the engine core's worker) are started the same
  way.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import stat
import sys
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: The console script (pyproject ``[project.scripts]``) beside the interpreter.
CHILD_LAUNCHER = "omni-gateway-child"
_installed = False
_parent_pid = 0


def _set_parent_death_signal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _remember_parent() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    _set_parent_death_signal()
    # The parent may have died between fork and prctl: then nobody will
    # signal us, and this process would be the orphan we meant to prevent.
    if os.getppid() != _parent_pid:
        os._exit(1)
    _drop_parents_network_sockets()
    # The parent's event loop pointed signals at its own wakeup socket: a signal
    # to this process would otherwise be reported to the parent's loop.
    signal.set_wakeup_fd(-1)
    _take_openmp_settings()
    _take_startup_warning_filters()


def _drop_parents_network_sockets() -> None:
    """Let go of every TCP and UDP socket the forked child inherited.

    They are the gateway's: its listeners, its clients' connections, Redis,
    WebRTC. A child holding a copy would keep a listener accepting into a
    backlog nobody reads after the gateway closed it to drain, and keep a
    connection open after the gateway closed it. Each fd is pointed at
    /dev/null rather than closed, so the number is not reused under a socket
    object the child inherited. Unix sockets and pipes (multiprocessing's own)
    are kept.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd != devnull and _is_network_socket(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _take_openmp_settings() -> None:
    """Run the OpenMP threads our environment names, as a spawned child would.

    OpenMP reads ``OMP_NUM_THREADS`` once, when torch loads it, so a forked
    child keeps its parent's count. vLLM starts its CPU worker with it set to
    the worker's cores (here 1); forked without this, the worker ran the
    gateway's 2 threads beside the engine core and decoded 20 % slower.
    (vLLM's ``OMP_PLACES`` binding is not redone: the worker's memory-node
    setup resets its CPU affinity to the node's cores anyway.)
    """
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit():
        torch.set_num_threads(int(threads))


def _take_startup_warning_filters() -> None:
    """The warning filters a new interpreter starts with: Python's defaults, then ``-W``
    and ``PYTHONWARNINGS`` (``sys.warnoptions``, which spawn passes on too).

    Filters the parent set in code are not a child's: under pytest's ``error``
    filter, a forked engine core turned xgrammar's DeprecationWarning into an
    exception and failed every request with a grammar (tool calls).
    """
    warnings.resetwarnings()
    # https://docs.python.org/3/library/warnings.html#default-warning-filter
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]


def _is_network_socket(fd: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        probe = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        return probe.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        probe.detach()


_ARM_CHILD = f"import {__name__} as _lifetime; _lifetime.engine_children_die_with_parent()\n"


def exec_child() -> None:
    """``omni-gateway-child ARGS``: exec the interpreter with ARGS, dying with our parent.

    multiprocessing runs ``python [flags] -c PROGRAM [args]``; the signal
    survives the exec, and PROGRAM is prefixed so the child arms its own
    children in turn.
    """
    _set_parent_death_signal()
    if os.getppid() == 1:  # orphaned already, before the signal was armed
        sys.exit(1)
    args = sys.argv[1:]
    if "-c" in args:
        program = args.index("-c") + 1
        args[program] = _ARM_CHILD + args[program]
    os.execv(sys.executable, [sys.executable, *args])


def engine_children_die_with_parent() -> None:
    """From now on, every process this one starts is killed when its parent dies.

    Call it before the engine starts; idempotent. The signal follows the
    *thread* that started the child, so start the engine from a thread that
    lives as long as the process (the app's main thread).
    """
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_remember_parent, after_in_child=_after_fork_in_child)
    launcher = Path(sys.executable).with_name(CHILD_LAUNCHER)
    if launcher.exists():
        multiprocessing.set_executable(str(launcher))
    else:
        logger.warning("%s is not installed beside %s: spawned engine processes will not "
                       "die with the gateway (reinstall the package)", CHILD_LAUNCHER, sys.executable)
    _installed = True
