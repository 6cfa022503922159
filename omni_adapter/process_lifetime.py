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

- ``fork`` (vLLM's choice on a GPU host before CUDA is initialized): a fork
  hook sets it in the child;
- ``spawn`` (vLLM's choice on the CPU): the child is a new interpreter, so
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
import sys
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


def _die_with_parent_after_fork() -> None:
    _set_parent_death_signal()
    # The parent may have died between fork and prctl: then nobody will
    # signal us, and this process would be the orphan we meant to prevent.
    if os.getppid() != _parent_pid:
        os._exit(1)


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
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent_after_fork)
    launcher = Path(sys.executable).with_name(CHILD_LAUNCHER)
    if launcher.exists():
        multiprocessing.set_executable(str(launcher))
    else:
        logger.warning("%s is not installed beside %s: spawned engine processes will not "
                       "die with the gateway (reinstall the package)", CHILD_LAUNCHER, sys.executable)
    _installed = True
