"""Opt-in backport for vLLM 0.30's streaming input (second env only).

Installed beside ``torchvision_without_ops`` by ``scripts/try_vllm_omni_cpu.sh``
and active only in processes started with ``OMNI_CPU_BACKPORT_MAX_TOKENS=1``
(the variable is inherited by vLLM-Omni's stage engine processes).

vLLM 0.30.0's ``Scheduler._update_request_as_session`` takes each streaming
update's ``sampling_params`` but keeps the *first* input's ``max_tokens``:
every later input of a streaming session generates at most as many tokens as
the first one allowed. The adapters send intermediate inputs with
``max_tokens=1``, so the answer stops after one token (``finish_reason
"length"``). vLLM 0.32 sets ``session.max_tokens = update.max_tokens`` there;
this hook adds that one line to 0.30 after the module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_TARGET = "vllm.v1.core.sched.scheduler"


def _patch(module: Any) -> None:
    scheduler = module.Scheduler
    original = scheduler._update_request_as_session
    if getattr(original, "_backported", False):
        return

    def _update_request_as_session(self: Any, session: Any, update: Any) -> None:
        original(self, session, update)
        session.max_tokens = update.max_tokens

    _update_request_as_session._backported = True  # type: ignore[attr-defined]
    scheduler._update_request_as_session = _update_request_as_session


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("OMNI_CPU_BACKPORT_MAX_TOKENS") == "1" and not any(
    isinstance(f, _Finder) for f in sys.meta_path
):
    sys.meta_path.insert(0, _Finder())
