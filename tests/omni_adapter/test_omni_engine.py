"""The ``omni`` adapter's request building and output translation.

vLLM-Omni cannot run here (no GPU; it is not installed), so ``AsyncOmni`` is
the one thing faked: :class:`FakeAsyncOmni` consumes the ``StreamingInput``
generator the way ``AsyncOmni.generate`` does (one stage-0 output per
intermediate input, then the answer) and answers with real vLLM objects:
``RequestOutput`` / ``CompletionOutput`` carrying ``stage_id`` and
``multimodal_output`` (torch tensors) as vLLM-Omni 0.30.0 attaches them.
Everything else is real: the SmolLM2 tokenizer with Qwen2-Audio's audio tokens
added, vLLM's ``Qwen2AudioForConditionalGeneration.get_placeholder_str`` (the
same placeholder as Qwen2.5-Omni's Thinker), vLLM's ``SamplingParams``,
``StreamingInput`` and ``TokensPrompt``.
"""

from __future__ import annotations

import asyncio
import io
import wave
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from vllm.engine.protocol import StreamingInput
from vllm.model_executor.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from omni_adapter.audio import pcm16_from_waveform
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.omni_engine import (
    AUDIO_SEGMENT_SEC,
    AudioOutputs,
    OmniEngine,
    audio_prompting,
    audio_prompting_for,
)
from omni_adapter.port import (
    AudioDelta,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    InputChunk,
    SamplingOptions,
    TextDelta,
)
from omni_adapter.text_stream import StreamingTokenizer
from tests.omni_adapter.sessions import HISTORY, MODEL, collect, request, text_chunks

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]


def completion(text: str = "", ids: tuple[int, ...] = (), finish: str | None = None,
               audio: dict[str, Any] | None = None) -> CompletionOutput:
    out = CompletionOutput(index=0, text=text, token_ids=list(ids), cumulative_logprob=None,
                           logprobs=None, finish_reason=finish)
    if audio is not None:
        # vLLM-Omni attaches the stage's audio to the completion like this.
        out.multimodal_output = audio  # type: ignore[attr-defined]
    return out


def stage_output(stage_id: int, *completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    output = RequestOutput(request_id="r", prompt=None, prompt_token_ids=None, prompt_logprobs=None,
                           outputs=list(completions), finished=finished)
    output.stage_id = stage_id  # type: ignore[attr-defined]
    return output


@dataclass
class FakeAsyncOmni:
    """``AsyncOmni``'s streaming-input contract, answering from a script."""

    answer: list[RequestOutput] = field(default_factory=list)
    fail_with: BaseException | None = None
    max_len: int = 2048
    inputs: list[StreamingInput] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    @property
    def model_config(self) -> Any:
        return SimpleNamespace(max_model_len=self.max_len)

    @property
    def default_sampling_params_list(self) -> list[Any]:
        return [SamplingParams(), SamplingParams(max_tokens=4096, output_kind=RequestOutputKind.FINAL_ONLY),
                {"diffusion": "params stay as they are"}]

    async def generate(self, prompt: AsyncGenerator[StreamingInput, None], *, request_id: str,
                       output_modalities: list[str], sampling_params_list: list[Any]) -> AsyncIterator[Any]:
        self.calls.append({"request_id": request_id, "output_modalities": output_modalities,
                           "sampling_params_list": sampling_params_list})
        async for item in prompt:
            self.inputs.append(item)
            params = item.sampling_params
            assert params is not None and params.output_kind == RequestOutputKind.DELTA
            assert params.n == 1 and not params.stop  # AsyncOmni's streaming-input rule
            if params.max_tokens == 1:  # an intermediate input: one throwaway token
                yield stage_output(0, completion("x", (1,)))
                continue
            if self.fail_with is not None:
                raise self.fail_with
            for output in self.answer:
                await asyncio.sleep(0)
                yield output

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


@pytest.fixture(scope="module")
def streaming() -> StreamingTokenizer:
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    return StreamingTokenizer(tokenizer)


def omni_engine(fake: FakeAsyncOmni, streaming: StreamingTokenizer, *, audio: bool = True) -> OmniEngine:
    prompting = audio_prompting(
        lambda i: Qwen2AudioForConditionalGeneration.get_placeholder_str("audio", i), "<|AUDIO|>", streaming)
    return OmniEngine(fake, streaming, (MODEL,), frozenset({"text", "audio"}), prompting if audio else None)


def talker_audio(samples: list[float], sr: Any = None) -> RequestOutput:
    audio: dict[str, Any] = {"audio": torch.tensor(samples, dtype=torch.float32)}
    if sr is not None:
        audio["sr"] = sr
    return stage_output(1, completion(audio=audio))


ANSWER = [
    stage_output(0, completion("Hello", (10,))),
    stage_output(0, completion(" world", (11,), finish="stop")),
    # The talker's waveform so far, twice: cumulative.
    talker_audio([0.5, -0.5], sr=torch.tensor(22050)),
    talker_audio([0.5, -0.5, 0.25], sr=torch.tensor(22050)),
]


def rendered_ids(streaming: StreamingTokenizer, user_content: str) -> list[int]:
    prefix, suffix = streaming.chat_frame(HISTORY)
    return streaming.encode(prefix.text + user_content + suffix.text)


async def test_streamed_text_and_audio_in_text_and_audio_out(streaming: StreamingTokenizer) -> None:
    fake = FakeAsyncOmni(answer=list(ANSWER))
    engine = omni_engine(fake, streaming)
    req = EngineRequest("s1", MODEL, HISTORY, SamplingOptions(temperature=0.0, max_tokens=16),
                        output_modalities=("audio",))
    session = engine.open_session(req)
    pcm = (np.sin(np.arange(1600) / 5) * 12000).astype("<i2").tobytes()
    await session.feed(text_chunks(b"Please listen to this clip carefully: ", 7))
    await asyncio.sleep(0.05)
    await session.feed([InputChunk(10, "audio", pcm[:1600], format="pcm16"),
                        InputChunk(11, "audio", pcm[1600:], format="pcm16")])
    await session.feed([InputChunk(12, "text", b" what do you hear?")])
    await asyncio.sleep(0.05)
    await session.end_input()
    async with asyncio.timeout(10):
        events = [event async for event in session.events()]

    assert events[:2] == [TextDelta("Hello"), TextDelta(" world")]
    assert events[2:4] == [AudioDelta(pcm16_from_waveform(np.array([0.5, -0.5])), 22050),
                           AudioDelta(pcm16_from_waveform(np.array([0.25])), 22050)]
    end = events[-1]
    assert isinstance(end, Finished) and end.finish_reason == "stop"

    # The prompt is exactly the one-shot rendering with the audio placeholder in place.
    placeholder = Qwen2AudioForConditionalGeneration.get_placeholder_str("audio", 1)
    expected = rendered_ids(streaming, f"Please listen to this clip carefully: {placeholder} what do you hear?")
    fed = [i for item in fake.inputs for i in item.prompt["prompt_token_ids"]]
    assert fed == expected and end.usage.prompt_tokens == len(expected)
    assert len(fake.inputs) >= 3, "the input was not streamed"
    # The audio rides, once, with the input holding its audio token; as vLLM's (waveform, sr).
    with_audio = [item.prompt for item in fake.inputs if "multi_modal_data" in item.prompt]
    assert len(with_audio) == 1
    ((waveform, rate),) = with_audio[0]["multi_modal_data"]["audio"]
    assert rate == 16000 and waveform.dtype == np.float32
    assert np.allclose(waveform, np.frombuffer(pcm, dtype="<i2") / 32768.0)
    assert with_audio[0]["prompt_token_ids"].count(streaming.encode("<|AUDIO|>")[0]) == 1

    (call,) = fake.calls
    assert call["output_modalities"] == ["text", "audio"]  # text always: stage 0 acknowledges inputs
    stage0, talker, diffusion = call["sampling_params_list"]
    assert stage0.output_kind == RequestOutputKind.DELTA and stage0.n == 1 and not stage0.stop
    assert talker.output_kind == RequestOutputKind.DELTA and talker.max_tokens == 4096
    assert diffusion == {"diffusion": "params stay as they are"}
    final = fake.inputs[-1].sampling_params
    assert final is not None and final.max_tokens == 16 and final.temperature == 0.0


async def test_audio_deltas_and_the_end_of_all_stages(streaming: StreamingTokenizer) -> None:
    # Stage 0 finishes first; the talker's audio still counts, as deltas, default rate.
    answer = [stage_output(0, completion("Hi", (5,), finish="length")),
              talker_audio([0.1, 0.2]), talker_audio([-0.3]), talker_audio([])]
    fake = FakeAsyncOmni(answer=answer)
    session = omni_engine(fake, streaming).open_session(request(max_tokens=1 + 1))
    await session.feed(text_chunks(b"Say hi.", 3))
    await session.end_input()
    text, end = await collect(session.events())
    assert text == "Hi"
    assert isinstance(end, Finished) and end.finish_reason == "length"
    assert end.usage.completion_tokens == 1


async def test_output_audio_conversions() -> None:
    outputs = AudioOutputs()
    cumulative = [talker_audio([0.5]), talker_audio([0.5, 1.5]),  # clipped to 1.0
                  stage_output(1, completion(audio={"audio": [torch.zeros(1), torch.tensor([0.5, 1.5, -1.0])],
                                                    "sr": [None, 16000]}))]
    deltas = [outputs.deltas(o) for o in cumulative]
    assert deltas == [[(pcm16_from_waveform(np.array([0.5])), 24000)],
                      [(pcm16_from_waveform(np.array([1.0])), 24000)],
                      [(pcm16_from_waveform(np.array([-1.0])), 16000)]]
    assert pcm16_from_waveform(np.array([1.5, -2.0])) == np.array([32767, -32767], "<i2").tobytes()
    assert outputs.deltas(stage_output(0, completion("text only"))) == []


async def test_the_first_finish_reason_is_the_answers(streaming: StreamingTokenizer) -> None:
    # AsyncOmni 0.30.0 ends a streaming-input request with one more stage-0
    # update after the generator ends; its output comes after the answer's
    # own finish (measured: ("The", "length") then ("", "stop")).
    answer = [stage_output(0, completion("The", (504,), finish="length")),
              stage_output(0, completion("", (), finish="stop"), finished=True)]
    session = omni_engine(FakeAsyncOmni(answer=answer), streaming).open_session(request(max_tokens=2))
    await session.feed(text_chunks(b"What is the capital of France?", 8))
    await session.end_input()
    text, end = await collect(session.events())
    assert text == "The"
    assert isinstance(end, Finished) and end.finish_reason == "length"
    assert end.usage.completion_tokens == 1


def test_a_text_only_model_takes_no_audio(streaming: StreamingTokenizer) -> None:
    # vLLM's cached_processor_from_config raises "The model is not multimodal."
    # for a plain LLM Thinker (the real AsyncOmni with SmolLM2 met it first).
    text_only = SimpleNamespace(is_multimodal_model=False)
    assert audio_prompting_for(text_only, streaming) is None


async def test_stop_strings_end_the_session_and_abort(streaming: StreamingTokenizer) -> None:
    fake = FakeAsyncOmni(answer=[stage_output(0, completion("Hello. More", (1, 2))),
                                 stage_output(0, completion(" text", (3,), finish="stop"))])
    session = omni_engine(fake, streaming).open_session(request(stop=(".",)))
    await session.feed(text_chunks(b"Hi", 2))
    await session.end_input()
    text, end = await collect(session.events())
    assert text == "Hello" and isinstance(end, Finished) and end.finish_reason == "stop"
    assert fake.aborted == [session._request.request_id]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("error", "code"), [(EngineDeadError("gone"), "engine_unavailable"),
                                             (RuntimeError("boom"), "engine_error")])
async def test_engine_errors_end_the_session(streaming: StreamingTokenizer, error: Exception,
                                             code: str) -> None:
    session = omni_engine(FakeAsyncOmni(fail_with=error), streaming).open_session(request())
    await session.feed(text_chunks(b"Hi there", 4))
    await session.end_input()
    _, end = await collect(session.events())
    assert isinstance(end, EngineError) and end.code == code


async def test_no_text_finish_is_an_error(streaming: StreamingTokenizer) -> None:
    session = omni_engine(FakeAsyncOmni(answer=[talker_audio([0.1])]), streaming).open_session(request())
    await session.feed(text_chunks(b"Hi", 2))
    await session.end_input()
    _, end = await collect(session.events())
    assert isinstance(end, EngineError) and "without a result" in end.message


def wav_file(samples: np.ndarray, rate: int, channels: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.astype("<i2").tobytes())
    return buffer.getvalue()


async def test_audio_segments_wav_and_rejections(streaming: StreamingTokenizer) -> None:
    fake = FakeAsyncOmni(answer=[stage_output(0, completion("ok", (1,), finish="stop"))])
    engine = omni_engine(fake, streaming)
    session = engine.open_session(request())
    long_pcm = np.zeros(int(16000 * AUDIO_SEGMENT_SEC), "<i2").tobytes()
    stereo = np.array([[1000, 3000]] * 8000)  # 0.5 s at 8 kHz, two channels
    await session.feed([InputChunk(0, "audio", long_pcm, format="pcm16"),   # a full segment: one item
                        InputChunk(1, "audio", wav_file(stereo, 8000, 2), format="wav")])  # new rate
    with pytest.raises(EngineRejectedError):
        await session.feed([InputChunk(2, "audio", b"\0\0", format="mp3")])
    await session.end_input()
    _, end = await collect(session.events())
    assert isinstance(end, Finished)
    items = [a for item in fake.inputs for a in item.prompt.get("multi_modal_data", {}).get("audio", [])]
    assert [(len(w), rate) for w, rate in items] == [(16000 * AUDIO_SEGMENT_SEC, 16000), (8000, 8000)]
    assert np.allclose(items[1][0], 2000 / 32768)  # the stereo WAV, downmixed

    text_only = omni_engine(FakeAsyncOmni(), streaming, audio=False)
    assert text_only.capabilities.input_modalities == frozenset({"text"})
    session = text_only.open_session(request())
    with pytest.raises(EngineRejectedError):
        await session.feed([InputChunk(0, "audio", b"\0\0")])
    await session.abort()


def test_audio_prompting_checks_the_audio_token(streaming: StreamingTokenizer) -> None:
    with pytest.raises(ValueError, match="once per audio placeholder"):
        audio_prompting(lambda i: "<|AUDIO|><|AUDIO|>", "<|AUDIO|>", streaming)
    with pytest.raises(ValueError):
        audio_prompting(lambda i: "x", "not one token", streaming)
