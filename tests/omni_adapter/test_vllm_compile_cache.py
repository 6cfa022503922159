"""vLLM's AOT compile cache loads on the CPU (omni_adapter/vllm_compile_cache.py).

A compiled start that loads the cache is measured in bench/engine_start.py (a cold
compile takes two minutes, too long for the suite); these check the two facts the
fix rests on, so an upgrade of vLLM or torch that changes either one fails here.
"""

from __future__ import annotations

import inspect

from omni_adapter.vllm_compile_cache import let_the_aot_cache_load


def test_vllm_finalizes_what_it_loads_from_its_aot_cache() -> None:
    from vllm.compilation import decorators

    source = inspect.getsource(decorators._try_load_aot_compiled_fn)
    assert "loaded_fn._artifacts.compiled_fn.finalize_loading(" in source


def test_torch_s_bundled_callable_can_be_finalized_and_is_left_as_it_was() -> None:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    let_the_aot_cache_load()
    let_the_aot_cache_load()  # twice: a second engine in the same process
    callable_ = object.__new__(BundledAOTAutogradSerializableCallable)
    before = dict(vars(callable_))
    assert callable_.finalize_loading(object()) is None
    assert vars(callable_) == before
