"""The floor under streaming TTFT: the engine alone, nothing of ours.

With streaming input the best any front end can do after the last page
arrives is what the engine needs to prefill only that page (everything
before it already cached) and decode one token. Measured on vLLM's
``AsyncLLM`` directly, with the same model, chat template and text as the
TTFT runs: for each query, first prefill the prompt up to the last page
(``max_tokens=1``, result ignored), then time the full prompt to its first
token (``warm``). ``cold`` is the full prompt with nothing cached: what an
idle engine needs when it sees the input only at the end.
"""

from __future__ import annotations

import os
import time
import uuid

from bench.stats import summary
from bench.trace import PageSource, make_trace
from bench.ttft import SYSTEM, TtftConfig


async def measure(config: TtftConfig, samples: int = 8) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_adapter.model_bootstrap import ensure_default_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # The gateway's own engine settings (omni_adapter/vllm_engine.py).
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(ensure_default_model()), dtype="float32", max_model_len=4096, seed=0,
        gpu_memory_utilization=0.5, disable_log_stats=True))
    tokenizer = llm.get_tokenizer()
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    async def first_token_sec(ids: list[int]) -> float:
        started = time.perf_counter()
        async for _ in llm.generate({"prompt_token_ids": ids}, one_token, request_id=uuid.uuid4().hex):
            return time.perf_counter() - started
        raise RuntimeError("no output")

    source = PageSource(config.page_chars, config.seed + 1)
    trace = make_trace(source, queries=samples * 2, pages_per_query=config.pages_per_query,
                       rate_per_sec=1.0, seed=config.seed, label="floor")
    warm, cold, prompt_tokens, last_page_tokens = [], [], [], []
    try:
        await first_token_sec(tokenizer.encode("warm up"))  # first request pays one-off costs
        for n, query in enumerate(trace):
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "".join(query.pages)}],
                tokenize=False, add_generation_prompt=True)
            full = tokenizer.encode(text, add_special_tokens=False)
            if n % 2:  # half the queries: nothing cached
                cold.append(await first_token_sec(full))
                continue
            before_last = tokenizer.encode(text[:text.rindex(query.pages[-1])], add_special_tokens=False)
            await first_token_sec(before_last)
            warm.append(await first_token_sec(full))
            prompt_tokens.append(len(full))
            last_page_tokens.append(len(full) - len(before_last))
    finally:
        llm.shutdown()
    return {"warm_s": summary(warm, 4), "cold_s": summary(cold, 4),
            "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens)),
            "last_page_tokens_mean": round(sum(last_page_tokens) / len(last_page_tokens))}
