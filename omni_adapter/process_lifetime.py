"""Engine processes die with the process that started them.

vLLM on the CPU forks an ``EngineCore`` process, which forks its ``Worker``;
each holds the model and the KV cache (3.8 GB each here). The worker watches
the engine core through a pipe, but nothing watches the gateway: a gateway
killed with SIGKILL (an OOM kill, a liveness-probe kill, ``kill -9``) left
both running for good, so a restarted pod had no memory left for its new
engine.

Linux can deliver a signal to a process when its parent dies
(``PR_SET_PDEATHSIG``). The setting belongs to the child and is cleared by
``fork``, so it is set again in every child forked from here on, from a
fork hook. Children started with ``spawn`` (vLLM chooses it when CUDA is
initialized) are new interpreters that do not run the hook; on a GPU the
pod's container runtime reaps them instead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_installed = False
_parent_pid = 0


def _remember_parent() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died between fork and prctl: then nobody will
    # signal us, and this process would be the orphan we meant to prevent.
    if os.getppid() != _parent_pid:
        os._exit(1)


def engine_children_die_with_parent() -> None:
    """From now on, every process forked from this one is killed when its parent dies.

    Call it before the engine starts. Idempotent. The hook is inherited by
    forked children, so the engine core's own worker gets it too. The
    signal follows the *thread* that forked, so the engine must be started
    from a thread that lives as long as the process (the app's main thread).
    """
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)
    _installed = True
