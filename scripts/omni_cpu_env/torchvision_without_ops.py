"""Let PyPI's torchvision import beside ``torch==2.13.0+cpu`` (second env only).

Installed into the vLLM-Omni CPU environment by ``scripts/try_vllm_omni_cpu.sh``
(with a ``.pth`` line, so it applies in every process, the stage engines'
included); never into the project's .venv.

vLLM-Omni's pipeline registry imports every model it knows, and through them
``transformers``' Qwen2-VL image processor, which imports ``torchvision``.
PyPI's torchvision 0.28.0 (the release for torch 2.13) is a CUDA build: its
``_C.so`` needs ``libtorch_cuda.so``, does not load on the CPU torch, and
``import torchvision`` then fails with ``operator torchvision::nms does not
exist`` (two fake-kernel registrations assume the C++ ops exist). This hook
declares those two operator schemas just before torchvision is first imported,
so the import succeeds; the C++ ops (nms, roi_align, ...) stay unavailable,
and nothing on a text Thinker's path calls them.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            name = schema.split("(", 1)[0]
            if not hasattr(torch.ops.torchvision, name):
                library.define(schema)
        _keep.append(library)
        return None  # the normal finders import torchvision itself


_keep: list[Any] = []
if not any(isinstance(f, _DeclareTorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeclareTorchvisionOps())
