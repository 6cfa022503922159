"""The ``omni`` adapter: the engine port over an in-process vLLM-Omni ``AsyncOmni``.

Coded against ``vllm-omni`` 0.30.0 (``entrypoints/async_omni.py``, its
realtime connection ``entrypoints/openai/realtime_connection.py`` and
``outputs/__init__.py``). ``AsyncOmni.generate`` takes the same async generator
of ``StreamingInput`` as vLLM's ``AsyncLLM``: each input goes to stage 0 (the
Thinker) as an incremental update, and when the generator ends the request is
closed with stage 0's parameters. So a session here is the ``vllm`` adapter's
session (:class:`omni_adapter.vllm_engine.VllmSession`: boundary-safe token
batches, intermediate inputs with ``max_tokens=1``, the final one with the
user's parameters) with four differences:

* ``sampling_params_list`` has one entry per stage: stage 0 is ours (DELTA,
  n=1, no stop strings, as ``AsyncOmni`` requires for streaming input); the
  later stages keep the engine's defaults, coerced to DELTA like the realtime
  connection does.
* Outputs come from several stages. Stage 0's text is the answer (and its
  outputs before the final input are the prefill acknowledgements); audio comes
  from ``multimodal_output["audio"]`` of the later stages, cumulative or as
  deltas, at ``multimodal_output["sr"]`` (default 24000). The session ends when
  the engine's output stream ends (the last stage finished), not when stage 0
  does, so no audio is cut off.
* Audio input: pcm16 / WAV chunks become vLLM audio items ``(float32 waveform,
  sample rate)`` (vLLM resamples to the model's rate). Consecutive audio chunks
  are merged up to :data:`AUDIO_SEGMENT_SEC` (vLLM's own realtime models use
  5 s segments); each item's placeholder (the model's
  ``get_placeholder_str("audio", i)``) goes into the token stream at its place,
  and the item rides on the engine input whose ids contain its audio token.
* The engine always runs with ``"text"`` among its output modalities: stage 0
  outputs are how an intermediate input is acknowledged.

vLLM-Omni is imported lazily (only ``open_omni_engine`` needs it); the session
code uses vLLM types only, so it is tested with real vLLM objects.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_adapter.audio import pcm16_from_waveform, pcm16_of, waveform_of
from omni_adapter.port import (
    AudioDelta,
    Capabilities,
    EngineError,
    EngineRequest,
    EngineUnavailableError,
    InputChunk,
)
from omni_adapter.text_stream import IncrementalTokenizer, StreamingTokenizer
from omni_adapter.tool_calls import ToolCallParser
from omni_adapter.vllm_engine import VllmEngine, VllmSession, engine_error_from

if TYPE_CHECKING:
    import numpy as np
    from vllm.engine.protocol import EngineClient, StreamingInput
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: The sample rate of output audio that does not say its own (vLLM-Omni's default).
DEFAULT_OUTPUT_SAMPLE_RATE = 24_000
#: Longest audio item built from consecutive input chunks.
AUDIO_SEGMENT_SEC = 5.0


@dataclass(frozen=True)
class AudioPrompting:
    """How audio enters a prompt for one model."""

    #: The text that stands for the ``i``-th audio item (1-based), like vLLM's
    #: chat rendering: ``SupportsMultiModal.get_placeholder_str("audio", i)``.
    placeholder: Callable[[int], str]
    #: The token the model's processor expands into the audio's features; once
    #: per item (e.g. ``<|AUDIO|>`` for Qwen2.5-Omni).
    audio_token_id: int


@dataclass
class OmniEngineConfig:
    model: str
    served_model_name: str
    #: Further names requests may use for it.
    aliases: tuple[str, ...] = ()
    #: Further ``AsyncOmni`` arguments (``deploy_config``, ``stage_init_timeout``, ...).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


async def open_omni_engine(config: OmniEngineConfig) -> OmniEngine:
    """Start vLLM-Omni's stages for the model (minutes, on GPUs)."""
    from vllm_omni.entrypoints import AsyncOmni

    try:
        omni = AsyncOmni(model=config.model, **config.engine_kwargs)
    except Exception as exc:
        raise EngineUnavailableError(f"the vLLM-Omni engine failed to start: {exc}") from exc
    try:
        streaming = StreamingTokenizer(await omni.get_tokenizer())
        audio = audio_prompting_for(omni.model_config, streaming)
        outputs = frozenset(omni.output_modalities) | {"text"}
    except BaseException:
        omni.shutdown()
        raise
    return OmniEngine(omni, streaming, (config.served_model_name, *config.aliases), outputs, audio)


def audio_prompting_for(model_config: Any, streaming: StreamingTokenizer) -> AudioPrompting | None:
    """The model's audio placeholder and token, or ``None`` if it takes no audio."""
    # A text-only model (e.g. a plain LLM as the Thinker) has no multimodal
    # processor: vLLM's cached_processor_from_config raises "The model is not
    # multimodal." for it (seen with the real AsyncOmni, docs/vllm-omni-on-cpu.md).
    if not getattr(model_config, "is_multimodal_model", False):
        return None
    from vllm.model_executor.model_loader import get_model_cls
    from vllm.transformers_utils.processor import cached_processor_from_config

    model_cls = get_model_cls(model_config)
    audio_token = getattr(cached_processor_from_config(model_config), "audio_token", None)
    if audio_token is None or not hasattr(model_cls, "get_placeholder_str"):
        return None
    return audio_prompting(lambda i: model_cls.get_placeholder_str("audio", i), audio_token, streaming)


def audio_prompting(
    placeholder: Callable[[int], str], audio_token: str, streaming: StreamingTokenizer
) -> AudioPrompting:
    ids = streaming.encode(audio_token)
    if len(ids) != 1 or streaming.encode(placeholder(1)).count(ids[0]) != 1:
        raise ValueError(f"{audio_token!r} is not one token appearing once per audio placeholder")
    return AudioPrompting(placeholder, ids[0])


class OmniEngine(VllmEngine):
    """One ``AsyncOmni`` (all stages) shared by every session of the process."""

    def __init__(
        self,
        omni: EngineClient,
        streaming: StreamingTokenizer,
        model_names: tuple[str, ...],
        output_modalities: frozenset[str],
        audio: AudioPrompting | None,
    ) -> None:
        super().__init__(omni, streaming, model_names)
        self._audio = audio
        self.capabilities = Capabilities(
            input_modalities=frozenset({"text", "audio"} if audio else {"text"}),
            output_modalities=output_modalities,
            incremental=streaming.incremental,
            model_names=model_names,
        )

    def _new_session(self, request: EngineRequest, tokens: IncrementalTokenizer, emitted: int,
                     tool_calls: ToolCallParser | None) -> OmniSession:
        # No tool parser here (``capabilities.tools`` is off): the gateway refuses tools first.
        return OmniSession(self._llm, request, tokens, self._max_model_len, self._audio, emitted)


class OmniSession(VllmSession):
    """A ``VllmSession`` whose engine has stages, audio in and audio out."""

    def __init__(
        self,
        omni: EngineClient,
        request: EngineRequest,
        tokens: IncrementalTokenizer,
        max_model_len: int,
        audio: AudioPrompting | None,
        emitted_tokens: int = 0,
    ) -> None:
        super().__init__(omni, request, tokens, max_model_len, emitted_tokens)
        self._audio = audio
        self.accepted_modalities = frozenset({"text", "audio"} if audio else {"text"})
        self._audio_in = AudioSegments()
        #: Audio items whose placeholders are in the token stream, not yet sent.
        self._audio_items: deque[tuple[np.ndarray, int]] = deque()
        self._audio_count = 0
        self._audio_out = AudioOutputs()
        #: Stage 0's finish reason; the session ends when all stages have.
        self._text_finish: str | None = None

    # -- input ------------------------------------------------------------------

    def _push(self, chunk: InputChunk) -> list[int]:
        if chunk.modality == "audio":
            pcm16, rate = pcm16_of(chunk)
            ids = self._close_audio_item() if self._audio_in.rate not in (None, rate) else []
            self._audio_in.add(pcm16, rate)
            if self._audio_in.seconds >= AUDIO_SEGMENT_SEC:
                ids += self._close_audio_item()
            return ids
        return self._close_audio_item() + super()._push(chunk)

    def _flush(self) -> list[int]:
        return self._close_audio_item() + super()._flush()

    def _close_audio_item(self) -> list[int]:
        """Put the buffered audio in as one item: its placeholder into the token stream."""
        segment = self._audio_in.take()
        if segment is None:
            return []
        assert self._audio is not None  # only audio-capable sessions buffer audio
        pcm16, rate = segment
        self._audio_items.append((waveform_of(pcm16), rate))
        self._audio_count += 1
        # The placeholder's audio tokens are control tokens: it is trusted text.
        return self._tokens.push(self._audio.placeholder(self._audio_count), trusted_text=True)

    def _prompt(self, ids: list[int]) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=ids)
        if self._audio is not None and (count := ids.count(self._audio.audio_token_id)):
            items = [self._audio_items.popleft() for _ in range(count)]
            prompt["multi_modal_data"] = {"audio": items}
        return prompt

    # -- the engine call ----------------------------------------------------------

    def _generate(
        self, inputs: AsyncGenerator[StreamingInput, None], params: SamplingParams
    ) -> AsyncIterator[Any]:
        modalities = list(dict.fromkeys(["text", *self._request.output_modalities]))
        outputs: AsyncIterator[Any] = self._llm.generate(
            inputs, request_id=self._request.request_id, output_modalities=modalities,
            sampling_params_list=stage_params(params, self._llm.default_sampling_params_list),
        )
        return outputs

    def _is_prefill_ack(self, output: Any) -> bool:
        return is_text_stage(output)

    async def _on_output(self, output: Any) -> None:
        for pcm16, rate in self._audio_out.deltas(output):
            self._events.emit(AudioDelta(pcm16, rate))
        if is_text_stage(output) and output.outputs:
            reason = await self._on_text(output.outputs[0])
            # The first finish reason is the answer's. AsyncOmni closes a
            # streaming-input request with one more (empty) stage-0 update
            # after the input generator ends; its output ("", "stop") must not
            # turn a "length" into a "stop" (seen with vLLM-Omni 0.30.0).
            if self._text_finish is None:
                self._text_finish = reason

    def _on_outputs_end(self) -> None:
        if self._text_finish is None:
            super()._on_outputs_end()
        else:
            self._settle(self._text_finish)

    def _error_from(self, exc: BaseException) -> EngineError:
        try:
            from vllm_omni.errors import OmniClientError
        except ImportError:  # vLLM-Omni is not installed (tests)
            return engine_error_from(exc)
        if isinstance(exc, OmniClientError):
            return EngineError(str(exc), code="invalid_request")
        return engine_error_from(exc)


def stage_params(stage0: SamplingParams, defaults: Sequence[Any]) -> list[Any]:
    """One entry per stage: ``stage0`` first, then the engine's defaults for the rest.

    Later stages stream too: their vLLM ``SamplingParams`` are switched to DELTA
    (as vLLM-Omni's ``coerce_param_message_types`` does for its realtime API);
    other kinds (diffusion parameters) pass unchanged.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params: list[Any] = [stage0]
    for default in defaults[1:]:
        if isinstance(default, SamplingParams) and default.output_kind != RequestOutputKind.DELTA:
            default = default.clone()
            default.output_kind = RequestOutputKind.DELTA
        params.append(default)
    return params


def is_text_stage(output: Any) -> bool:
    """Stage 0 (the Thinker) or an output without stages."""
    return getattr(output, "stage_id", None) in (0, None)


class AudioSegments:
    """Consecutive pcm16 input audio at one rate, until it is taken as one item."""

    def __init__(self) -> None:
        self._pcm16 = bytearray()
        self.rate: int | None = None

    def add(self, pcm16: bytes, rate: int) -> None:
        self._pcm16 += pcm16
        self.rate = rate

    @property
    def seconds(self) -> float:
        return len(self._pcm16) / 2 / self.rate if self.rate else 0.0

    def take(self) -> tuple[bytes, int] | None:
        if not self._pcm16 or self.rate is None:
            return None
        segment = bytes(self._pcm16), self.rate
        self._pcm16, self.rate = bytearray(), None
        return segment


class AudioOutputs:
    """New audio of each output as pcm16, whether outputs carry deltas or the waveform so far.

    Same rule as vLLM-Omni's realtime connection: an array that starts with
    everything emitted so far is cumulative (emit its tail), anything else is a
    delta (emit it whole).
    """

    def __init__(self) -> None:
        self._emitted: np.ndarray | None = None

    def deltas(self, output: Any) -> list[tuple[bytes, int]]:
        mm = multimodal_output(output)
        if not isinstance(mm, Mapping) or mm.get("audio") is None:
            return []
        audio = mm["audio"]
        if isinstance(audio, list | tuple):
            if not audio:
                return []
            audio = audio[-1]  # the newest piece; earlier ones were seen before
        waveform = _as_waveform(audio)
        new = self._new_part(waveform)
        if new.size == 0:
            return []
        return [(pcm16_from_waveform(new), _sample_rate(mm))]

    def _new_part(self, waveform: np.ndarray) -> np.ndarray:
        import numpy as np

        seen = self._emitted
        if seen is None:
            self._emitted = waveform.copy()
            return waveform
        if waveform.shape[0] >= seen.shape[0] and np.allclose(
            waveform[: seen.shape[0]], seen, rtol=1e-3, atol=2e-4
        ):
            self._emitted = waveform.copy()
            return waveform[seen.shape[0]:]
        self._emitted = np.concatenate([seen, waveform])
        return waveform


def multimodal_output(output: Any) -> Any:
    """Like ``OmniRequestOutput.multimodal_output``: the completions' first, then the request's."""
    for completion in getattr(output, "outputs", None) or ():
        if mm := getattr(completion, "multimodal_output", None):
            return mm
    return getattr(output, "multimodal_output", None)


def _as_waveform(value: Any) -> np.ndarray:
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor, possibly on a GPU
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32).reshape(-1)


def _sample_rate(mm: Mapping[str, Any]) -> int:
    rate = mm.get("sr")
    if isinstance(rate, list | tuple):
        rate = next((r for r in reversed(rate) if r is not None), None)
    if rate is None:
        return DEFAULT_OUTPUT_SAMPLE_RATE
    return int(rate.item() if hasattr(rate, "item") else rate)
