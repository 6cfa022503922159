"""The ``vllm`` adapter: the engine port over an in-process ``AsyncLLM``.

A session is one ``AsyncLLM.generate()`` call whose prompt is an async
generator of ``StreamingInput``. While the user's input is still arriving, each
boundary-safe batch of tokens (see :mod:`omni_adapter.text_stream`) goes in as
an *intermediate* input with ``max_tokens=1``: the engine prefills it, samples
one token and discards that token when the next input arrives, so the prompt
stays exactly the input. After ``end_input`` the *final* input carries the rest
of the tokens, the chat template's generation prompt and the user's sampling
parameters; its outputs are the answer.

Two engine behaviours shape the input generator:

* ``RequestOutputCollector`` merges queued DELTA outputs when the consumer
  lags, so a throwaway token could merge into the answer. The generator yields
  the next input only after the previous intermediate output was received,
  batching whatever arrived meanwhile, and the answer starts only after all of
  them.
* vLLM rejects stop strings with streaming input, so they are matched here on
  the output text (the request is then aborted).

Inputs are passed as rendered token inputs (``tokens_input``), so vLLM neither
re-tokenizes nor re-renders them.

vLLM is imported lazily: importing this module needs no vLLM, and nothing from
``vllm.*`` (types or exceptions) leaves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast

from omni_adapter.compile_warmup import (
    CompileCache,
    WarmUp,
    choose,
    compile_key,
    launch_warmup,
    vllm_cache_root,
    warmup_command,
    warmup_config,
)
from omni_adapter.port import (
    Capabilities,
    EngineDeadError,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineUnavailableError,
    FinishReason,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    TokenLogprob,
    Usage,
)
from omni_adapter.process_lifetime import engine_children_die_with_parent
from omni_adapter.session_events import SessionEvents, check_servable
from omni_adapter.text_stream import Framed, IncrementalTokenizer, StreamingTokenizer, client
from omni_adapter.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    ToolCallParser,
    calls_tools,
    conversation,
    tool_call_parser_class,
)
from omni_adapter.vllm_compile_cache import let_the_aot_cache_load

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient, StreamingInput
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

#: A text without its first and last word (and the whitespace before the last).
_INSIDE_WORDS = re.compile(r"\S*(.*?)\S*\Z", re.DOTALL)

TEXT_ONLY = frozenset({"text"})
#: Tokens per engine step of a compiled model on the CPU: also the size of vLLM's warm-up forward.
COMPILED_CPU_BATCHED_TOKENS = 512
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class VllmEngineConfig:
    """What the in-process engine is started with."""

    model: str
    #: The name vLLM serves the model under (its ``served_model_name``, part of the compile key).
    served_model_name: str
    #: Further names requests may use for it (``--served-model-name``'s others; not vLLM's concern).
    aliases: tuple[str, ...] = ()
    dtype: str = "float32"
    max_model_len: int = 4096
    #: CPU KV cache size; exported as ``VLLM_CPU_KVCACHE_SPACE`` unless set.
    kv_cache_space_gib: int = 2
    #: Requests the engine runs at once (``None``: vLLM's default).
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    #: vLLM's parser of the model's own tool-call format (``--tool-call-parser``), for ``tool_choice: auto``.
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER
    #: KV cache block size, the prefix cache's granularity (``None``: vLLM's, 128 on the CPU).
    block_size: int | None = None
    #: torch.compile the model: ``True`` always, ``False`` never. ``None``: auto on the
    #: CPU (compile_warmup.py: eager, with the compile in the background, until this
    #: configuration's compile cache is warm; then compiled, decode ~1.25x and a
    #: ~25 s start); vLLM's default (compiled, CUDA graphs) on a GPU.
    compile: bool | None = None
    #: Sampling for what a request leaves unset, over the model's own defaults
    #: (its generation_config.json; the embedded model's: temperature 0.2, top-p 0.9).
    sampling_overrides: SamplingOptions = field(default_factory=SamplingOptions)


async def open_vllm_engine(config: VllmEngineConfig) -> VllmEngine:
    """Start the engine: 15-25 s on 2 cores eager, ~25 s compiled from a warm compile
    cache, most of it this process importing torch and vLLM; the engine's processes
    are forked from it. Auto (``compile`` unset on the CPU) starting eager launches
    the background compile once the engine is ready (compile_warmup.py).

    The start runs in a worker thread: it blocked the event loop for all of it
    (41 s measured), so every timeout pending on the loop expired at once when
    it returned (the "every Redis call stalled over 10 s" of issue 29), and a
    process that answers health checks while its engine starts did not.
    """
    # The engine's own thread, for as long as the engine lives: its process is
    # killed when the thread that started it ends (process_lifetime.py), so not
    # a pool thread that may go first.
    lifetime = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
    loop = asyncio.get_running_loop()
    try:
        started = await loop.run_in_executor(lifetime, _start_vllm, config)
    except BaseException:
        lifetime.shutdown(wait=False)
        raise
    llm = started.llm
    try:
        # Made off the loop, AsyncLLM did not start reading the engine core's
        # output (it does so only on a running loop): start it now, as it would
        # have, so a failure of the core before the first request is seen.
        llm._run_output_handler()
    except BaseException:
        await loop.run_in_executor(lifetime, llm.shutdown)
        lifetime.shutdown(wait=False)
        raise
    model_defaults = SamplingOptions.known(llm.model_config.get_diff_sampling_param())
    engine = VllmEngine(llm, started.streaming, (config.served_model_name, *config.aliases), started.tool_parser_cls,
                        config.sampling_overrides.or_defaults(model_defaults), lifetime=lifetime)
    engine.compiled = started.compiled
    if started.to_warm is not None:
        # Only now: compiling beside our own start would have slowed it by minutes.
        engine.compile_warmup = await launch_warmup(
            started.to_warm, warmup_command(warmup_config(config), started.to_warm.key), started.environ)
    return engine


def engine_args(config: VllmEngineConfig, compiled: bool, cpu: bool) -> dict[str, Any]:
    """``AsyncEngineArgs``' fields for ``config``, compiled or eager, on the CPU or not."""
    max_num_batched_tokens = None
    if compiled and cpu:
        # vLLM warms a compiled model up with one forward of max_num_batched_tokens
        # (2,048 on the CPU): 512 makes each compiled start ~5 s shorter; prefill then
        # goes in 512-token steps at the same speed (bench/README.md, engine start).
        # (vLLM requires a step to hold at least one token of each running request.)
        max_num_batched_tokens = max(COMPILED_CPU_BATCHED_TOKENS, config.max_num_seqs or 0)
    return {
        "model": config.model,
        "served_model_name": config.served_model_name,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "seed": config.seed,
        "enforce_eager": not compiled,
        "max_num_seqs": config.max_num_seqs,
        "block_size": config.block_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "disable_log_stats": True,
    }


@dataclass
class _Started:
    """What ``_start_vllm`` hands back to the loop."""

    llm: Any
    streaming: StreamingTokenizer
    tool_parser_cls: Any
    compiled: bool
    #: Auto chose eager: this configuration's compile cache, to warm in the background.
    to_warm: CompileCache | None = None
    #: The environment the engine was started in, before vLLM's CPU platform added its own.
    environ: dict[str, str] = field(default_factory=dict)


def _compile_or_not(config: VllmEngineConfig, cpu: bool) -> tuple[bool, CompileCache | None]:
    """Compile the model?, and the cache to warm when auto says not yet (compile_warmup.py)."""
    if config.compile is not None:
        return config.compile, None
    if not cpu:
        return True, None  # vLLM's default on a GPU: compiled, CUDA graphs
    cache = CompileCache(vllm_cache_root(), compile_key(engine_args(config, compiled=True, cpu=True), config.model))
    choice = choose(cache)
    logger.info("engine compile: auto chose %s", choice.reason)
    return choice.compiled, None if choice.compiled else cache


def _start_vllm(config: VllmEngineConfig) -> _Started:
    """vLLM imported, its engine core process started, and the tokenizer and tool parser loaded:
    blocking work (a worker thread's)."""
    # A background compile starts in this, not in what vLLM leaves in os.environ: torch reads
    # TORCHINDUCTOR_CPP_DYNAMIC_THREADS, which vLLM's CPU platform sets after torch's import
    # here, at its own import there; so a warm-up inheriting it compiled under another
    # Inductor config, vLLM's AOT key differed, and the next start compiled cold (measured).
    environ = dict(os.environ)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_space_gib))
    # No engine process may outlive the gateway (a SIGKILLed gateway used to
    # leave two 3.8 GB processes behind).
    engine_children_die_with_parent()
    # Read before vLLM's config overwrites it: an explicit spawn keeps vLLM's way on the CPU.
    start_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    cpu = current_platform.is_cpu()
    compile_model, to_warm = _compile_or_not(config, cpu)
    if compile_model and cpu:
        let_the_aot_cache_load()  # a compiled restart in ~25 s, not 49-51 (vllm_compile_cache.py)
    args = AsyncEngineArgs(**engine_args(config, compile_model, cpu))
    try:
        vllm_config = args.create_engine_config()
        if cpu and start_method != "spawn":
            # vLLM's CPU platform has just asked for spawn: each engine process a
            # new interpreter importing torch and vLLM again, two of a start's
            # three imports. Forked, they have ours: a restart took 24 s instead
            # of 45 (bench/engine_start.py). What spawn gave a child that fork
            # does not (none of our sockets, vLLM's OpenMP thread count, a new
            # interpreter's warning filters) the fork hook gives it (process_lifetime.py).
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
    except Exception as exc:
        raise EngineUnavailableError(f"the vLLM engine failed to start: {exc}") from exc
    try:
        streaming = StreamingTokenizer(llm.get_tokenizer())
        return _Started(llm, streaming, tool_call_parser_class(config.tool_call_parser, streaming.tokenizer),
                        compile_model, to_warm, environ)
    except BaseException:
        llm.shutdown()
        raise


class TokenizerChecks:
    """What the engine can check before anything is stored, from its tokenizer alone.

    The engine checks through these (the port's ``RequestChecks``); so does an
    API worker, which opens no engine but loads the same tokenizer from the
    same model folder (:func:`load_tokenizer_checks`), so a request over the
    context or one the chat template cannot render is a 4xx at the call on
    every process of a replica, and an update reports the tokens it kept.
    """

    def __init__(self, streaming: StreamingTokenizer, max_model_len: int, capabilities: Capabilities) -> None:
        self._streaming = streaming
        self._max_model_len = max_model_len
        self._capabilities = capabilities
        #: Token ids the model has (its added tokens too): what a logit_bias may name.
        self._vocabulary = len(cast("Sized", streaming.tokenizer))

    @property
    def max_input_tokens(self) -> int:
        return self._max_model_len - 1

    def warm(self) -> None:
        """Check one request that uses all a check can (a function, a JSON schema), so what checks
        import (vLLM, its chat parsers, the grammar compiler) is loaded now (blocking).

        An API worker does this before it serves. It froze its heap at start, and the
        ~1,650 modules its first check imported came after that: every full collection
        walked their ~190,000 objects, while every stream the worker served waited. Its
        first request also waited 1.2 s for them.
        """
        caps = self._capabilities
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
        request = EngineRequest(request_id="warm-up", model=caps.model_names[0] if caps.model_names else "",
                                messages=({"role": "user", "content": "hi"},),
                                sampling=SamplingOptions(max_tokens=1,
                                                         response_format=schema if caps.structured_outputs else None),
                                tools=(tool,) if caps.tools else ())
        self.check_request(request)

    def check_request(self, request: EngineRequest) -> int:
        """Everything ``open_session`` would refuse, and the prompt tokens around the input."""
        prefix, suffix = self.frame(request)
        stream = self._streaming.open(prefix, suffix)
        return len(stream.finish())

    def input_tokens_at_least(self, text: str) -> int:
        # Only the words strictly inside the text: those tokenize the same
        # whatever text comes before and after (the first and last word may
        # merge with their neighbours); one more token is kept as a margin.
        inside = _INSIDE_WORDS.match(text)
        interior = inside.group(1).rstrip() if inside else ""
        if not interior:
            return 0
        # Text too long to fit even were every token the longest: that bound is the answer (a
        # 16 MiB chunk took 20 s of a core to tokenize before its 413).
        fewest = len(interior) // self._streaming.max_token_bytes  # (a token's bytes bound its characters)
        if fewest > self.max_input_tokens:
            return fewest
        count = len(self._streaming.encode_plain(interior))
        if self._streaming.has_control_tokens(interior):
            # A raw prompt's special tokens are one token each, not their text's (the session
            # is not known here: the smaller count bounds both).
            count = min(count, sum(1 if isinstance(part, int) else len(self._streaming.encode_plain(part))
                                   for part in self._streaming.split_trusted(interior)))
        return max(0, count - 1)

    def common_prefix_tokens(self, old: str, new: str) -> tuple[int, int]:
        before, after = self._streaming.encode_plain(old), self._streaming.encode_plain(new)
        kept = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
                    min(len(before), len(after)))
        return kept, len(after)

    def settled_tokens(self, text: str) -> tuple[int, int]:
        # The streaming tokenizer's own cut (the pre-token boundaries it commits
        # at while feeding the engine), without its forced cut of a long run
        # with no boundary: that one may change tokens, and a count must not.
        if not self._streaming.incremental:
            return 0, 0
        cut = self._streaming.split_point(text)
        return cut, len(self._streaming.encode_plain(text[:cut])) if cut else 0

    def frame(self, request: EngineRequest) -> tuple[Framed, Framed]:
        """The chat template around the streamed input; raises for what the engine would refuse."""
        check_servable(self._capabilities, request)
        if request.raw_prompt:
            prefix, suffix = self._streaming.raw_frame
            self._check_sampling(request)
            return prefix, suffix
        messages, tools = conversation(request.messages, request.tools, request.tool_choice,
                                       self._streaming.takes_tools)
        streamed: dict[str, Any] = {"role": request.input_role}
        if request.input_tool_call_id is not None:
            streamed["tool_call_id"] = request.input_tool_call_id
        try:
            prefix, suffix = self._streaming.chat_frame(
                messages, tools=tools, streamed=streamed, template_kwargs=request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message)
        except Exception as exc:
            raise EngineRejectedError(f"the chat template cannot render the messages: {exc}") from exc
        self._check_sampling(request)
        return prefix, suffix

    def _check_sampling(self, request: EngineRequest) -> None:
        """Built here to reject invalid options now, not after the input."""
        sampling = request.sampling
        params = sampling_params(sampling, max_tokens=sampling.max_tokens)  # None: up to the context
        check_schema(sampling.response_format)
        check_tool_schemas(request.tools, request.tool_choice)
        vocabulary = self._vocabulary
        # vLLM refuses these when the request reaches the engine, after the input.
        for param, tokens in (("logit_bias", [int(token) for token in sampling.logit_bias or ()]),
                              ("stop_token_ids", sampling.stop_token_ids or ())):
            if unknown := [str(token) for token in tokens if token >= vocabulary]:
                raise EngineRejectedError(f"{param} names token ids the model does not have ({', '.join(unknown[:5])}; "
                                          f"its vocabulary is {vocabulary} tokens)", param=param)
        if sampling.bad_words:
            try:
                params.update_from_tokenizer(self._streaming.tokenizer)  # as vLLM's input processor does
            except Exception as exc:
                raise EngineRejectedError(f"bad_words cannot be held to: {exc}", param="bad_words") from exc


def load_tokenizer(model: str) -> Any:
    """The engine's tokenizer without the engine, from the model folder (blocking: it imports
    transformers). vLLM's own ``get_tokenizer`` loads the same ``AutoTokenizer`` (and only caches it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def load_tokenizer_checks(model: str, max_model_len: int, capabilities: Capabilities) -> TokenizerChecks:
    """``tokenizer_checks`` with the tokenizer loaded from the model folder (blocking)."""
    return tokenizer_checks(load_tokenizer(model), max_model_len, capabilities)


def tokenizer_checks(tokenizer: Any, max_model_len: int, capabilities: Capabilities) -> TokenizerChecks:
    """The engine's checks without the engine. ``capabilities`` are the engine's as it announced
    them (with its Listener and Talker stages), so audio in or out passes here as there."""
    return TokenizerChecks(StreamingTokenizer(tokenizer), max_model_len, capabilities)


class VllmEngine:
    """One ``AsyncLLM`` shared by every session of the process."""

    def __init__(self, llm: EngineClient, streaming: StreamingTokenizer, model_names: tuple[str, ...],
                 tool_parser_cls: Any = None, sampling_defaults: SamplingOptions | None = None,
                 lifetime: ThreadPoolExecutor | None = None) -> None:
        self._llm = llm
        #: The thread that started the engine, which shuts it down (``None``: the loop's pool).
        self._lifetime = lifetime
        #: What a request's unset sampling fields become (the served model's defaults).
        self.sampling_defaults = sampling_defaults or SamplingOptions()
        self._streaming = streaming
        #: vLLM's parser class for the model's tool calls (``None``: the engine calls no functions).
        self._tool_parser_cls = tool_parser_cls
        self._max_model_len: int = llm.model_config.max_model_len
        self._sessions: weakref.WeakSet[VllmSession] = weakref.WeakSet()
        self._closed = False
        #: The model runs torch.compiled (set by ``open_vllm_engine``).
        self.compiled = False
        #: Auto's background compile of this configuration, while this engine runs eager.
        self.compile_warmup: WarmUp | None = None
        self.capabilities = Capabilities(
            input_modalities=TEXT_ONLY,
            output_modalities=TEXT_ONLY,
            incremental=streaming.incremental,
            model_names=model_names,
            tools=tool_parser_cls is not None,
            structured_outputs=True,
            raw_prompt=True,
            logprobs=True,
        )

    @property
    def _checks(self) -> TokenizerChecks:
        # Built per call, not once: the vLLM-Omni adapter widens ``capabilities``
        # (audio) after this constructor, and the checks must see what it serves.
        return TokenizerChecks(self._streaming, self._max_model_len, self.capabilities)

    @property
    def max_input_tokens(self) -> int:
        return self._checks.max_input_tokens

    def check_request(self, request: EngineRequest) -> int:
        return self._checks.check_request(request)

    def input_tokens_at_least(self, text: str) -> int:
        return self._checks.input_tokens_at_least(text)

    def common_prefix_tokens(self, old: str, new: str) -> tuple[int, int]:
        return self._checks.common_prefix_tokens(old, new)

    def settled_tokens(self, text: str) -> tuple[int, int]:
        return self._checks.settled_tokens(text)

    def open_session(self, request: EngineRequest) -> VllmSession:
        if self._closed:
            raise EngineUnavailableError("the engine is closed")
        request = replace(request, sampling=request.sampling.or_defaults(self.sampling_defaults))
        prefix, suffix = self._checks.frame(request)
        tokens = self._streaming.open(prefix, suffix + client(request.assistant_prefix))
        # After a hand-off the answer so far is part of the prompt; it still
        # counts against max_tokens and in the usage as completion tokens.
        emitted = len(self._streaming.encode_plain(request.assistant_prefix)) if request.assistant_prefix else 0
        tool_calls = None
        if calls_tools(request.tools, request.tool_choice) and self._tool_parser_cls is not None:
            tool_calls = ToolCallParser(self._tool_parser_cls, self._streaming.tokenizer, request.tools,
                                        request.tool_choice, parallel=request.parallel_tool_calls)
        session = self._new_session(request, tokens, emitted, tool_calls)
        self._sessions.add(session)
        return session

    def _new_session(self, request: EngineRequest, tokens: IncrementalTokenizer, emitted: int,
                     tool_calls: ToolCallParser | None) -> VllmSession:
        return VllmSession(self._llm, request, tokens, self._max_model_len, emitted, tool_calls)

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        if self._closed:
            raise EngineUnavailableError("the engine is closed")
        try:
            await self._llm.check_health()
        except VllmEngineDead as exc:
            # vLLM does not start a dead engine core again: neither can this process.
            raise EngineDeadError(f"the vLLM engine died: {exc}") from exc
        except Exception as exc:
            raise EngineUnavailableError(f"the vLLM engine is not healthy: {exc}") from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.compile_warmup is not None:
            await self.compile_warmup.stop()
        for session in list(self._sessions):
            await session.abort()
        # The reader of the engine core's output stops first, on the loop: with the
        # shutdown off the loop it would otherwise see the core go and log it as a
        # failure (EngineDeadError) before the shutdown cancelled it.
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # Joins the engine core's process: seconds, off the loop.
        await asyncio.get_running_loop().run_in_executor(self._lifetime, self._llm.shutdown)
        if self._lifetime is not None:
            self._lifetime.shutdown(wait=False)
        # AsyncLLM.__del__ shuts down again. Frames kept alive by tracebacks
        # stored during its start hold it until interpreter exit, where that
        # second call fails on torn-down module globals; once is enough.
        self._llm.shutdown = _already_shut_down


class Phase(StrEnum):
    """Where a session's input stands; ``_NEXT`` is the one table of how it moves on.

    ::

        FEEDING ──sent──► AWAITING_PREFILL ──prefilled──► FEEDING
           │ ended               │ ended
           ▼                     ▼
        INPUT_ENDED ◄─prefilled─ ENDED_AWAITING_PREFILL
           │ sent_final
           ▼
        FINAL_SENT                       any phase ──closed──► CLOSING
    """

    #: Input arriving; the engine has prefilled all that went in.
    FEEDING = "feeding"
    #: Input arriving; an intermediate input is in the engine, its one output not back yet.
    AWAITING_PREFILL = "awaiting_prefill"
    #: Input complete, but the last intermediate input's output is not back yet.
    ENDED_AWAITING_PREFILL = "ended_awaiting_prefill"
    #: Input complete; the final input (the rest, with the user's parameters) goes in next.
    INPUT_ENDED = "input_ended"
    #: The final input is in: the engine's outputs are the answer.
    FINAL_SENT = "final_sent"
    #: Closed for good: the input generator must end without a final input.
    CLOSING = "closing"


class Step(StrEnum):
    #: An intermediate input (``max_tokens=1``) went to the engine.
    SENT = "sent"
    #: The engine's one output for it arrived (its token is thrown away).
    PREFILLED = "prefilled"
    #: ``end_input``: no more input will come.
    ENDED = "ended"
    #: The final input went to the engine.
    SENT_FINAL = "sent_final"
    #: Aborted, failed, or the engine stopped reading the input.
    CLOSED = "closed"


P = Phase
_NEXT: dict[tuple[Phase, Step], Phase] = {
    (P.FEEDING, Step.SENT): P.AWAITING_PREFILL,
    (P.AWAITING_PREFILL, Step.PREFILLED): P.FEEDING,
    (P.FEEDING, Step.ENDED): P.INPUT_ENDED,
    (P.AWAITING_PREFILL, Step.ENDED): P.ENDED_AWAITING_PREFILL,
    (P.ENDED_AWAITING_PREFILL, Step.PREFILLED): P.INPUT_ENDED,
    (P.INPUT_ENDED, Step.SENT_FINAL): P.FINAL_SENT,
    **{(phase, Step.CLOSED): P.CLOSING for phase in Phase},
}
del P
#: The phases after ``end_input``.
_INPUT_COMPLETE = frozenset({Phase.ENDED_AWAITING_PREFILL, Phase.INPUT_ENDED, Phase.FINAL_SENT})


class VllmSession:
    """One streamed request: token batches in, answer text out.

    The ``omni`` adapter's session extends it through the hooks below
    (``_push``/``_flush`` for input, ``_prompt`` for each engine input,
    ``_generate``/``_is_prefill_ack``/``_on_output``/``_on_outputs_end`` for
    the engine call and its outputs).
    """

    #: Input modalities this session takes.
    accepted_modalities: frozenset[str] = TEXT_ONLY

    def __init__(
        self,
        llm: EngineClient,
        request: EngineRequest,
        tokens: IncrementalTokenizer,
        max_model_len: int,
        emitted_tokens: int = 0,
        tool_calls: ToolCallParser | None = None,
    ) -> None:
        self._llm = llm
        #: The answer's text through vLLM's tool-call parser (``None``: no tools).
        self._tool_calls = tool_calls
        #: Structured output (``required`` / a named function, or ``response_format``)
        #: holds the whole input for one final engine input: vLLM sets a request's grammar when
        #: the request is added, and an input after the first changes its
        #: sampling parameters but not its grammar.
        self._whole_input = (tool_calls is not None and tool_calls.structured_outputs is not None) \
            or request.sampling.response_format is not None
        #: Tokens of the answer that an earlier holder already emitted.
        self._emitted = emitted_tokens
        self._request = request
        self._tokens = tokens
        self._max_model_len = max_model_len
        self._stops = StopStrings(request.sampling.stop, keep=bool(request.sampling.include_stop_str_in_output))
        self._events = SessionEvents()
        #: Committed ids not yet handed to the engine.
        self._ready: list[int] = []
        self._fed = 0
        self._completion_tokens = 0
        self._answer_started = False
        self._phase = Phase.FEEDING
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._inputs: AsyncGenerator[StreamingInput, None] | None = None
        #: ``end_input`` was called: what is ready waits for the final input.
        self._ending = False

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        for chunk in chunks:
            if chunk.modality not in self.accepted_modalities:
                accepted = ", ".join(sorted(self.accepted_modalities))
                raise EngineRejectedError(f"this engine accepts {accepted} only, not {chunk.modality}")
        if self._phase is Phase.CLOSING:
            return
        if self._phase in _INPUT_COMPLETE:
            raise EngineRejectedError("the input has already ended")
        # Tokenizing is CPU work (a 2 MB chunk takes seconds): off the event
        # loop, so other sessions' appends, streams and heartbeats go on.
        ids = await asyncio.to_thread(self._push_all, chunks)
        # Not `self._ready += await ...`: that reads the list before the await,
        # and the driver may have taken it meanwhile.
        self._ready += ids
        await self._check_length()
        self._start()

    def _push_all(self, chunks: Sequence[InputChunk]) -> list[int]:
        return [i for chunk in chunks for i in self._push(chunk)]

    async def end_input(self) -> None:
        if self._phase is Phase.CLOSING or self._phase in _INPUT_COMPLETE:
            return
        # Set before the first await: input fed just before (the last words a
        # Listener heard, a last chunk read with the end) goes in with the
        # final input, one engine pass instead of a prefill and then another
        # pass for the generation prompt (about 0.1 s before the first token,
        # bench/README.md).
        self._ending = True
        ids = await asyncio.to_thread(self._flush)
        self._ready += ids
        await self._check_length()
        self._step(Step.ENDED)
        self._start()

    def events(self) -> AsyncIterator[OutputEvent]:
        return self._events.stream()

    async def abort(self) -> None:
        if self._events.ended:
            return
        await self._close_request()
        self._finish("abort")

    # -- hooks ------------------------------------------------------------------

    def _push(self, chunk: InputChunk) -> list[int]:
        """The ids one input chunk makes final (a raw prompt's special tokens are the model's)."""
        return self._tokens.push(chunk.data, trusted_text=self._request.raw_prompt)

    def _flush(self) -> list[int]:
        """The remaining ids at the end of input."""
        return self._tokens.finish()

    def _prompt(self, ids: list[int]) -> Any:
        """One engine input for a batch of ids."""
        from vllm.inputs import tokens_input

        return tokens_input(ids)

    def _generate(self, inputs: AsyncGenerator[StreamingInput, None], params: SamplingParams) -> AsyncIterator[Any]:
        outputs: AsyncIterator[Any] = self._llm.generate(inputs, params, self._request.request_id)
        return outputs

    def _is_prefill_ack(self, output: Any) -> bool:
        """Whether an output before the final input is the one of an intermediate input."""
        return True

    async def _on_output(self, output: RequestOutput) -> None:
        if output.outputs and (reason := await self._on_text(output.outputs[0])):
            self._settle(reason)

    def _on_outputs_end(self) -> None:
        """The engine's outputs ended without this session ending."""
        self._fail(EngineError("the engine ended the request without a result"))

    # -- internals --------------------------------------------------------------

    def _step(self, step: Step) -> None:
        """Move on by the table; a step it does not list for this phase changes
        nothing (an output after close, ``end_input`` during a close)."""
        self._phase = _NEXT.get((self._phase, step), self._phase)

    async def _check_length(self) -> None:
        """Fail the session on input that leaves no room to generate.

        Raised to the caller too: it is the client's fault, at append time.
        """
        # Text still pending (no word boundary yet) counts too, as the fewest
        # tokens it can become: it cannot pile up past the context unnoticed.
        prompt_tokens = self._fed + len(self._ready) + self._tokens.pending_tokens_at_least
        if prompt_tokens < self._max_model_len:
            return
        message = (
            f"the input is at least {prompt_tokens} tokens, which leaves no room to "
            f"generate within the model's context of {self._max_model_len} tokens"
        )
        self._fail(
            EngineError(
                message,
                code="invalid_request",
                details={"prompt_tokens": prompt_tokens, "max_model_len": self._max_model_len},
            )
        )
        await self._close_request()
        raise EngineRejectedError(message)

    def _start(self) -> None:
        self._wake.set()
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(
                self._drive(), name=f"vllm-session-{self._request.request_id}"
            )

    async def _drive(self) -> None:
        """Run the generation and turn its outputs into events."""
        from vllm.sampling_params import RequestOutputKind

        self._inputs = self._input_stream()
        # Used by the engine to validate the request and to close it after
        # the input stream ends; each input carries its own parameters.
        params = sampling_params(at_most(self._request.sampling, 1), max_tokens=1)
        params.output_kind = RequestOutputKind.DELTA
        try:
            async for output in self._generate(self._inputs, params):
                if self._phase is Phase.FINAL_SENT:
                    if not self._events.ended:
                        await self._on_output(output)
                elif self._is_prefill_ack(output):
                    # The single output of an intermediate input: its token is
                    # thrown away by the engine; it only means "prefilled".
                    self._step(Step.PREFILLED)
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(self._error_from(exc))
        else:
            self._on_outputs_end()
        # The engine no longer reads the input; make sure it is closed.
        if self._phase is not Phase.FINAL_SENT:
            self._step(Step.CLOSED)
        await self._close_inputs()

    async def _on_text(self, completion: CompletionOutput) -> str | None:
        """Emit the text of one output; return its finish reason once there is one.

        A stop string ends the session here and now (and aborts the request).
        """
        self._completion_tokens += len(completion.token_ids)
        text, stopped = self._stops.feed(completion.text)
        done = stopped or completion.finish_reason is not None
        if done and not stopped:
            text += self._stops.flush()
        logprobs = () if self._request.sampling.logprobs is None else \
            token_logprobs(completion.token_ids, completion.logprobs, self._request.sampling.logprobs)
        self._emit_text(text, completion.token_ids, done, logprobs)
        if stopped:
            self._finish(self._reason("stop"))
            # Ends the generate() loop with an "abort" output, ignored.
            await self._llm.abort(self._request.request_id)
            return None
        reason: str | None = completion.finish_reason
        return reason

    def _emit_text(self, text: str, token_ids: Sequence[int], done: bool,
                   logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """The answer's text as it is, or through the tool-call parser: content and calls. The
        tokens' log probabilities go with the text they made (before a parser's events)."""
        began, self._answer_started = self._answer_started, True
        if self._tool_calls is None:
            if text or logprobs or not began:  # the first token began the answer, even saying nothing
                self._events.emit(TextDelta(text, logprobs))
            return
        if logprobs or not began:
            self._events.emit(TextDelta("", logprobs))
        for event in self._tool_calls.parse(text, token_ids, finished=done):
            self._events.emit(event)

    def _reason(self, reason: FinishReason) -> FinishReason:
        """OpenAI's: ``tool_calls`` when the answer called functions (``stop`` for a named one)."""
        calls = self._tool_calls
        if reason == "stop" and calls is not None and calls.called and not calls.named:
            return "tool_calls"
        return reason

    def _settle(self, engine_reason: str) -> None:
        reason = _FINISH_REASONS.get(engine_reason)
        if reason is None:
            self._fail(EngineError(f"generation failed ({engine_reason})"))
        else:
            self._finish(self._reason(reason))

    def _error_from(self, exc: BaseException) -> EngineError:
        return engine_error_from(exc)

    async def _input_stream(self) -> AsyncGenerator[StreamingInput, None]:
        """The prompt generator consumed by the engine.

        Ending it normally tells the engine the input is complete; that may
        only happen after the final input. Raising ``CancelledError`` is how
        an aborted session ends it without the engine starting an answer.
        """
        from vllm.engine.protocol import StreamingInput
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        prefill_only = SamplingParams(
            max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.DELTA,
            **fixed_at_first_input(self._request.sampling),
        )
        while True:
            # One token stays behind until the end so the final input, which
            # starts the answer, is never empty.
            while not (
                self._phase in (Phase.CLOSING, Phase.INPUT_ENDED)
                or (self._phase is Phase.FEEDING and len(self._ready) > 1
                    and not self._ending and not self._whole_input)
            ):
                self._wake.clear()
                await self._wake.wait()
            if self._phase is Phase.CLOSING:
                raise asyncio.CancelledError
            if self._phase is Phase.INPUT_ENDED:
                break
            batch, self._ready = self._ready[:-1], self._ready[-1:]
            self._fed += len(batch)
            self._step(Step.SENT)
            yield StreamingInput(self._prompt(batch), prefill_only)
        batch, self._ready = self._ready, []
        self._fed += len(batch)
        room = self._max_model_len - self._fed
        requested = self._request.sampling.max_tokens
        if requested is not None:
            # At least one: a hand-off right at the limit may overshoot by one token.
            requested = max(1, requested - self._emitted)
        most = room if requested is None else min(requested, room)
        final = sampling_params(at_most(self._request.sampling, most), max_tokens=most)
        final.output_kind = RequestOutputKind.DELTA
        if self._tool_calls is not None and self._tool_calls.structured_outputs is not None:
            final.structured_outputs = self._tool_calls.structured_outputs  # never with response_format's
        self._step(Step.SENT_FINAL)
        yield StreamingInput(self._prompt(batch), final)
        # The phase moves while this generator is suspended (an abort), which
        # the type checker cannot see: read it through a call.
        if self._closing():
            raise asyncio.CancelledError

    def _closing(self) -> bool:
        return self._phase is Phase.CLOSING

    def _finish(self, reason: FinishReason) -> None:
        self._events.finish(reason, Usage(prompt_tokens=self._fed - self._emitted,
                                          completion_tokens=self._emitted + self._completion_tokens))

    def _fail(self, error: EngineError) -> None:
        self._events.fail(error)

    async def _close_request(self) -> None:
        """Stop the engine request and the input generator, from outside the driver."""
        self._step(Step.CLOSED)
        self._wake.set()
        driver = self._driver
        if driver is None:
            return
        if driver is not asyncio.current_task() and not driver.done():
            # generate() aborts the request and cancels the engine's reader
            # of the input generator when it is cancelled.
            driver.cancel()
            await asyncio.wait([driver])
        try:
            await self._llm.abort(self._request.request_id)
        except Exception:
            logger.debug("abort of %s failed", self._request.request_id, exc_info=True)
        await self._close_inputs()

    async def _close_inputs(self) -> None:
        self._wake.set()
        if self._inputs is None:
            return
        # RuntimeError: suspended inside the engine's reader task, where it
        # raises CancelledError as soon as it resumes (``Phase.CLOSING``).
        with contextlib.suppress(RuntimeError):
            await self._inputs.aclose()


class StopStrings:
    """Stop strings matched on the streamed text, as vLLM does for one-shot input.

    Text that could still be the start of a stop string is held back, so no
    part of a stop string is ever emitted, unless ``keep`` (vLLM's
    ``include_stop_str_in_output``): then the answer ends with the stop string.
    Of several, the one that ends first stops it (the first listed at a tie), as in vLLM.
    """

    def __init__(self, stops: Sequence[str], *, keep: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._keep = keep
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add output text; return the text safe to emit and whether a stop hit."""
        search_from = max(0, len(self._text) - self._hold)
        self._text += delta
        hits = [(i + len(s), i) for s in self._stops if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            end, start = min(hits, key=lambda hit: hit[0])
            return self._emit(end if self._keep else start), True
        return self._emit(len(self._text) - self._hold), False

    def flush(self) -> str:
        return self._emit(len(self._text))

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        text = self._text[self._emitted : end]
        self._emitted = end
        return text


def _already_shut_down(timeout: float | None = None) -> None:
    return None


def at_most(options: SamplingOptions, max_tokens: int) -> SamplingOptions:
    """``options`` for an input that makes at most ``max_tokens`` (an intermediate input's one, or
    what is left after a hand-off): ``min_tokens`` no more than those, which vLLM requires."""
    if options.min_tokens is None or options.min_tokens <= max_tokens:
        return options
    return replace(options, min_tokens=max_tokens)


def fixed_at_first_input(options: SamplingOptions) -> dict[str, Any]:
    """The options vLLM's output processor takes from a streamed request's first input and keeps
    (its detokenizer's, its log probabilities'): an intermediate input carries them too."""
    fixed = {"skip_special_tokens": options.skip_special_tokens,
             "spaces_between_special_tokens": options.spaces_between_special_tokens,
             "include_stop_str_in_output": options.include_stop_str_in_output, "logprobs": options.logprobs}
    return {name: value for name, value in fixed.items() if value is not None}


def sampling_params(options: SamplingOptions, *, max_tokens: int | None) -> SamplingParams:
    """The OpenAI options as vLLM parameters, without stop strings.

    Raises ``EngineRejectedError`` for values vLLM refuses.
    """
    from vllm.sampling_params import SamplingParams

    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        # OpenAI's default, for a model with none of its own (the engine fills
        # in the served model's defaults before this: VllmEngine.open_session).
        "temperature": 1.0 if options.temperature is None else options.temperature,
    }
    optional = {
        "top_p": options.top_p,
        "top_k": options.top_k,
        "seed": options.seed,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repetition_penalty,
        "min_p": options.min_p,
        # OpenAI's keys are strings; vLLM's engine compares them with token ids.
        "logit_bias": {int(token): bias for token, bias in options.logit_bias.items()} if options.logit_bias else None,
        "min_tokens": options.min_tokens,
        "ignore_eos": options.ignore_eos,
        "stop_token_ids": list(options.stop_token_ids) if options.stop_token_ids else None,
        "bad_words": list(options.bad_words) if options.bad_words else None,
        **fixed_at_first_input(options),
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    try:
        return SamplingParams(**fields, structured_outputs=structured_outputs(options.response_format))
    except Exception as exc:
        # vLLM's reason names the field first ("min_tokens must be ... max_tokens=...").
        named = min((name for name in fields if name in str(exc)), key=str(exc).find, default=None)
        raise EngineRejectedError(f"invalid sampling options: {exc}", param=named) from exc


def token_logprobs(token_ids: Sequence[int], positions: Sequence[Mapping[int, Logprob] | None] | None,
                   top: int) -> tuple[TokenLogprob, ...]:
    """vLLM's log probabilities of an output's new tokens, OpenAI's way: each token's own, and the
    ``top`` likeliest at its place, likeliest first (vLLM lists the sampled token first)."""
    tokens = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        if not position or token_id not in position:
            continue
        chosen = position[token_id]
        likeliest = sorted(position.values(), key=lambda p: p.logprob, reverse=True)[:top]
        tokens.append(TokenLogprob(chosen.decoded_token or "", _finite(chosen.logprob),
                                   tuple((p.decoded_token or "", _finite(p.logprob)) for p in likeliest)))
    return tuple(tokens)


def _finite(logprob: float) -> float:
    """As vLLM's server says it: a token the model rules out (-inf) is -9999.0 in JSON."""
    return max(logprob, -9999.0)


def check_schema(response_format: Mapping[str, Any] | None) -> None:
    """A JSON schema the grammar compiler refuses (``minimum`` above ``maximum``...), a regex or
    grammar it cannot read, is the client's mistake: refused now. In the engine core it failed
    the request as a server error."""
    if response_format is None or response_format["type"] == "json_object":
        return
    if response_format["type"] != "json_schema":
        _check_grammar(response_format)
        return
    _check_json_schema(response_format["json_schema"].get("schema") or {}, "response_format")


def check_tool_schemas(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] | None) -> None:
    """The parameters of the functions an answer is held to (``required``, a named function),
    checked as ``response_format``'s schema is: vLLM compiles them into the answer's grammar."""
    if not tools or not (tool_choice == "required" or isinstance(tool_choice, Mapping)):
        return
    named = tool_choice["function"]["name"] if isinstance(tool_choice, Mapping) else None
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is None or function["name"] == named:
            _check_json_schema(function.get("parameters") or {}, f"tools.{i}.function.parameters")


def _check_json_schema(schema: Mapping[str, Any], param: str) -> None:
    import json

    import xgrammar

    loop = _ref_loop(schema)
    if loop is not None:  # the compiler takes it, and the engine core fails the request at its first token
        raise EngineRejectedError(f"{param}'s schema admits no value: {loop[:64]!r} refers only to itself",
                                  param=param)
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except RuntimeError as exc:
        # The grammar compiler's reason, without the time and C++ source line it cites.
        reason = re.sub(r"\[\d{1,2}:\d{2}:\d{2}\]\s*|\S+\.(cc|h):\d+:?\s*", "", str(exc)).strip()
        raise EngineRejectedError(f"{param}'s schema cannot be held to: {reason}", param=param) from exc


def _check_grammar(constraint: Mapping[str, Any]) -> None:
    """A regex or grammar of vLLM's ``structured_outputs`` checked as vLLM's server checks it when
    it takes the request (its engine core failed the request otherwise)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=structured_outputs(constraint)))
    except (ValueError, VLLMValidationError) as exc:
        reason = re.sub(r"\[\d{1,2}:\d{2}:\d{2}\]\s*|\S+\.(cc|h):\d+:?\s*", "", str(exc)).strip()
        raise EngineRejectedError(f"structured_outputs cannot be held to: {reason}",
                                  param="structured_outputs") from exc


#: Keywords that say nothing of a schema's values: a schema of these and a ``$ref`` is the ``$ref``.
_ANNOTATIONS = frozenset({"$defs", "definitions", "title", "description", "$comment", "default", "examples"})


def _ref_loop(schema: Any) -> str | None:
    """A ``$ref`` that leads back to itself through schemas that are nothing but a ``$ref``."""

    def target(ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node: Any = schema
        for step in filter(None, ref[1:].split("/")):
            step = step.replace("~1", "/").replace("~0", "~")
            node = node.get(step) if isinstance(node, Mapping) else None
        return node

    nodes, seen_nodes = [schema], 0
    while nodes and seen_nodes < 10_000:  # (a bound: the schema's size is capped by the body's)
        node, seen_nodes = nodes.pop(), seen_nodes + 1
        if isinstance(node, Mapping):
            refs: list[str] = []
            current: Any = node
            while isinstance(current, Mapping) and "$ref" in current and set(current) - _ANNOTATIONS <= {"$ref"}:
                if current["$ref"] in refs:
                    return str(current["$ref"])
                refs.append(current["$ref"])
                current = target(current["$ref"])
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    return None


def structured_outputs(response_format: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as vLLM's grammar for the answer (what vLLM's own server does)."""
    from vllm.sampling_params import StructuredOutputsParams

    if response_format is None:
        return None
    kind = response_format["type"]
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind in ("regex", "choice", "grammar"):  # vLLM's structured_outputs
        return StructuredOutputsParams(**{kind: response_format[kind]})
    # json_schema; OpenAI's schema is optional (any JSON then), as in vLLM's server.
    return StructuredOutputsParams(json=response_format["json_schema"].get("schema") or {"type": "object"})


def engine_error_from(exc: BaseException) -> EngineError:
    """Translate an exception raised by vLLM into the port's error event."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, VLLMClientError):
        return EngineError(str(exc), code="invalid_request")
    if isinstance(exc, GracefulHTTPError):
        return EngineError(str(exc), code="engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return EngineError("the engine stopped working", code="engine_unavailable")
    logger.warning("vLLM request failed", exc_info=exc)
    return EngineError(f"the engine failed: {type(exc).__name__}", code="engine_error")
