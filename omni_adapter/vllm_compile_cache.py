"""vLLM's AOT compile cache, made to load on the CPU: a compiled restart without the compile.

With torch.compile on (``OMNI_GATEWAY_ENGINE_COMPILE=true``; vLLM's default on a
GPU), vLLM 0.32 saves the compiled model to its AOT cache and loads it at the
next start, skipping Dynamo's trace. On the CPU the load always failed ("'function'
object has no attribute 'finalize_loading'"), vLLM compiled again, and every
compiled restart took 49-51 s to ready; loading it, 25-34 s (bench/README.md,
"Engine start").

Why it failed: after loading, vLLM calls ``finalize_loading`` on what it loaded,
assuming its own piecewise backend compiled it. The CPU compiles the whole model
with stock Inductor (``CompilationMode.DYNAMO_TRACE_ONCE``), whose saved function is
torch's ``BundledAOTAutogradSerializableCallable``: complete once deserialized,
with nothing to finalize and no such method. Giving it one that does nothing lets
the load go on; the loaded model decodes as fast as a freshly compiled one.

The class is patched in this process before the engine's processes are forked
from it, so they have it too. A spawned engine process
(``VLLM_WORKER_MULTIPROC_METHOD=spawn``) does not: its load fails as before and
vLLM compiles again, which is slow but correct.
"""

from __future__ import annotations

from typing import Any


def _nothing_to_finalize(_callable: Any, _vllm_config: Any) -> None:
    """torch's bundled callable is whole once deserialized."""


def let_the_aot_cache_load() -> None:
    """Idempotent; leaves a torch whose callable has its own ``finalize_loading`` alone."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if not hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        BundledAOTAutogradSerializableCallable.finalize_loading = _nothing_to_finalize
