"""Open the engine an installation asked for; import its library only then."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_adapter.port import (
    Capabilities,
    Engine,
    EngineRequest,
    PromptCounter,
    RequestChecks,
    SamplingOptions,
)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from omni_adapter.listener import RecognizerName

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EngineChoice:
    #: ``vllm``, ``omni`` or ``openai-http``.
    kind: str = "vllm"
    #: A local model folder; ``None`` means the embedded default.
    model: str | None = None
    #: The names it is served under (the first is vLLM's); none: the folder's name.
    served_model_name: tuple[str, ...] = ()
    dtype: str = "float32"
    max_model_len: int = 4096
    kv_cache_space_gib: int = 2
    max_num_seqs: int | None = None
    #: torch.compile the model (``None``: not on the CPU; see ``VllmEngineConfig.compile``).
    compile: bool | None = None
    #: ``openai-http`` only: where the engine serves, and how long to wait for it.
    engine_url: str | None = None
    engine_timeout_sec: float = 120.0
    engine_start_timeout_sec: float = 900.0
    engine_audio: bool = False
    #: ``vllm``: vLLM's parser of the model's own tool-call format.
    tool_call_parser: str = "xlam"
    #: Sampling for what a request leaves unset; unset here too: the served model's defaults.
    sampling_defaults: SamplingOptions = field(default_factory=SamplingOptions)
    #: The CPU Listener's recognizer (a text model's audio input).
    recognizer: RecognizerName = "moonshine"


async def open_engine(choice: EngineChoice) -> Engine:
    if choice.kind == "openai-http":
        return await _open_http(choice)
    if choice.kind not in ("vllm", "omni"):
        raise ValueError(f"unknown engine {choice.kind!r}")
    model, (name, *aliases) = await _model(choice)
    if choice.kind == "omni":
        from omni_adapter.omni_engine import OmniEngineConfig, open_omni_engine

        return await open_omni_engine(OmniEngineConfig(model=model, served_model_name=name, aliases=tuple(aliases)))
    from omni_adapter.vllm_engine import VllmEngineConfig, open_vllm_engine

    thinker = await open_vllm_engine(VllmEngineConfig(
        model=model, served_model_name=name, aliases=tuple(aliases), dtype=choice.dtype,
        max_model_len=choice.max_model_len, kv_cache_space_gib=choice.kv_cache_space_gib,
        max_num_seqs=choice.max_num_seqs, compile=choice.compile,
        sampling_overrides=choice.sampling_defaults, tool_call_parser=choice.tool_call_parser))
    return await _with_cpu_voice(thinker, choice.recognizer)


async def _with_cpu_voice(engine: Engine, recognizer: RecognizerName) -> Engine:
    """A text model hears through the CPU Listener (Moonshine) and speaks through the
    CPU Talker (hibari), if installed; an engine that takes and makes audio itself
    (vLLM-Omni, in process or a sidecar) is left as it is. Loading the recognizer,
    VAD and voice takes seconds: off the loop."""
    from omni_adapter.listener import with_listener
    from omni_adapter.talker import with_talker

    return await asyncio.to_thread(lambda: with_talker(with_listener(engine, recognizer)))


async def open_request_checks(choice: EngineChoice, capabilities: Capabilities,
                              tokenizer: Any = None) -> RequestChecks | None:
    """For a process that opens no engine (an API worker): the checks the engine would make, where
    they need only its tokenizer (the in-process ``vllm`` engine); ``None`` for the others, which
    check nothing before the engine runs the request either. ``tokenizer``: loaded ahead
    (``preload_tokenizer``)."""
    if choice.kind != "vllm":
        return None
    from omni_adapter.vllm_engine import load_tokenizer, tokenizer_checks

    if tokenizer is None:
        model, _ = await _model(choice)
        tokenizer = await asyncio.to_thread(load_tokenizer, model)
    checks = tokenizer_checks(tokenizer, choice.max_model_len, capabilities)
    try:  # before the worker serves and freezes its heap (TokenizerChecks.warm says why)
        await asyncio.to_thread(checks.warm)
    except Exception as exc:  # a template that cannot render a function, say: the checks still work
        logger.warning("request checks: the warm-up check failed (%s); the first request loads what it needs", exc)
    return checks


class CheckedCounter:
    """The engine's checks as its prompt counter: they tokenize, so in a worker thread."""

    def __init__(self, checks: RequestChecks) -> None:
        self._checks = checks

    @property
    def max_input_tokens(self) -> int:
        return self._checks.max_input_tokens

    async def prompt_tokens(self, request: EngineRequest) -> int:
        return await asyncio.to_thread(self._checks.check_request, request)

    async def aclose(self) -> None:
        return None


async def open_prompt_counter(choice: EngineChoice, checks: RequestChecks | None) -> PromptCounter | None:
    """How a process counts prompts as its engine does: by the engine's checks where it has them
    (its tokenizer); in front of an ``openai-http`` sidecar, by the sidecar (vLLM's ``/tokenize``),
    in every process of a replica, the API workers too; else ``None``: nothing is counted."""
    if checks is not None:
        return CheckedCounter(checks)
    if choice.kind != "openai-http" or not choice.engine_url:
        return None
    from omni_adapter.http_engine import HttpEngineConfig, open_sidecar_counter

    return await open_sidecar_counter(HttpEngineConfig(
        base_url=choice.engine_url, timeout_sec=choice.engine_timeout_sec,
        start_timeout_sec=choice.engine_start_timeout_sec))


async def preload_tokenizer(choice: EngineChoice) -> Any:
    """An API worker's tokenizer for its checks, loaded while its engine process starts: importing
    transformers and loading it took ~9 s of a restart when it waited for the engine first.

    Only from a model folder that is there already (an explicit one, or the default converted):
    the engine process converts a missing default, and two processes converting it at once
    would race. ``None``: load it later, as ``open_request_checks`` does.
    """
    if choice.kind != "vllm":
        return None
    from omni_adapter.model_bootstrap import converted_default_model
    from omni_adapter.vllm_engine import load_tokenizer

    model = choice.model or converted_default_model()
    if model is None:
        return None
    logger.info("loading the tokenizer of %s for request checks, while the engine process starts", model)
    return await asyncio.to_thread(load_tokenizer, str(model))


async def _model(choice: EngineChoice) -> tuple[str, tuple[str, ...]]:
    """The model folder and the names it is served under (at least one)."""
    if choice.model:
        return choice.model, choice.served_model_name or (Path(choice.model).name,)
    from omni_adapter.model_bootstrap import ensure_default_model

    # Downloading and converting the default takes a while the first time;
    # keep the event loop free meanwhile.
    return str(await asyncio.to_thread(ensure_default_model)), choice.served_model_name or (DEFAULT_SERVED_NAME,)


async def _open_http(choice: EngineChoice) -> Engine:
    from omni_adapter.http_engine import HttpEngineConfig, open_http_engine

    if not choice.engine_url:
        raise ValueError("the openai-http engine needs an engine URL")
    sidecar = await open_http_engine(HttpEngineConfig(
        base_url=choice.engine_url, timeout_sec=choice.engine_timeout_sec,
        start_timeout_sec=choice.engine_start_timeout_sec, audio=choice.engine_audio,
        sampling_overrides=choice.sampling_defaults, aliases=choice.served_model_name))
    # A Realtime voice call works on either engine.
    return await _with_cpu_voice(sidecar, choice.recognizer)
