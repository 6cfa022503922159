"""pipecat's ``OpenAIRealtimeLLMService`` (and its STT, TTS and ``OpenAIResponsesLLMService``) pointed at our URL, in a pipeline with pipecat's own
test transports (``pipecat.tests.utils.QueuedFrameProcessor`` at both ends, as its
``run_test`` builds it): a spoken turn in as microphone frames, audio frames out.

pipecat treats any ``error`` event but two codes as fatal and parses every server
event with its own models, so a clean run says the events fit it too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.services.openai.responses.llm import OpenAIResponsesLLMService
from pipecat.services.openai.stt import OpenAIRealtimeSTTService, OpenAISTTService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

from omni_adapter.audio import wav_of
from tests.frameworks.conftest import Gateway
from tests.voice import SPEECH_RATE, pieces, recognize, speech, word_error_rate

pytestmark = pytest.mark.engine


@contextlib.asynccontextmanager
async def running(service: Any) -> AsyncIterator[tuple[PipelineWorker, asyncio.Queue[Frame], asyncio.Queue[Frame]]]:
    """``service`` in a started pipeline with pipecat's test queues at both ends (the frames it
    sends down, and up); ended with an ``EndFrame`` when the block ends."""
    down: asyncio.Queue[Frame] = asyncio.Queue()
    up: asyncio.Queue[Frame] = asyncio.Queue()
    pipeline = Pipeline([QueuedFrameProcessor(queue=up, queue_direction=FrameDirection.UPSTREAM),
                         service, QueuedFrameProcessor(queue=down, queue_direction=FrameDirection.DOWNSTREAM)])
    worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker: Any, _frame: Any) -> None:
        started.set()

    runner = WorkerRunner()
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    try:
        await asyncio.wait_for(started.wait(), 30)
        yield worker, down, up
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(run, 60)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)


async def test_a_spoken_turn_in_audio_frames_out(gateway: Gateway) -> None:
    llm = OpenAIRealtimeLLMService(
        api_key="unused", base_url=gateway.ws_url,
        settings=OpenAIRealtimeLLMService.Settings(
            model=gateway.model, system_instruction="You are a helpful assistant. Answer in one short sentence.",
            max_tokens=24))
    received: list[Frame] = []
    async with running(llm) as (worker, down, up):
        # A microphone: the question in 20 ms frames, then a second of silence (server VAD ends the turn).
        for frame in pieces(speech("What is the capital of France?") + bytes(SPEECH_RATE), SPEECH_RATE, 20):
            await worker.queue_frame(InputAudioRawFrame(audio=frame, sample_rate=SPEECH_RATE, num_channels=1))
            await asyncio.sleep(0.005)
        async with asyncio.timeout(180):
            while not any(isinstance(f, LLMFullResponseEndFrame) for f in received):
                received.append(await down.get())
    failures = [f for f in [*received, *drain(up)] if isinstance(f, ErrorFrame)]
    assert failures == [], failures
    audio = b"".join(f.audio for f in received if isinstance(f, TTSAudioRawFrame))
    assert len(audio) > SPEECH_RATE, "more than half a second of speech came out"
    rate = next(f.sample_rate for f in received if isinstance(f, TTSAudioRawFrame))
    assert recognize(audio, rate).strip(), "what came out is speech"
    asked = gateway.engine.requests[-1]
    assert asked.input_role == "user" and asked.messages[0]["content"].startswith("You are a helpful assistant")


def drain(queue: asyncio.Queue[Frame]) -> list[Frame]:
    frames = []
    while not queue.empty():
        frames.append(queue.get_nowait())
    return frames


async def test_its_openai_stt_service_hears_a_recorded_utterance(gateway: Gateway) -> None:
    """pipecat's ``OpenAISTTService`` (a cascaded pipeline's speech to text) sends each utterance
    to ``/v1/audio/transcriptions`` as a WAV file, naming OpenAI's default model."""
    stt = OpenAISTTService(api_key="unused", base_url=f"{gateway.url}/v1")
    question = "Please book a table for two tonight."
    frames = [frame async for frame in stt.run_stt(wav_of(speech(question), SPEECH_RATE))]
    assert [type(f) for f in frames] == [TranscriptionFrame], frames
    assert word_error_rate(question, frames[0].text) == 0, frames[0].text


async def test_its_realtime_stt_service_transcribes_each_utterance_as_it_is_spoken(gateway: Gateway) -> None:
    """pipecat's ``OpenAIRealtimeSTTService`` (streaming speech to text over a Realtime
    transcription session), in its two modes: its default, where the pipeline's own VAD
    commits each utterance (the frames a transport's VAD sends, here sent by the test), and
    server VAD. Two utterances each; nothing but its URL changed."""
    said = ["Please book a table for two tonight.", "What is the capital of France?"]
    for server_vad in (False, True):
        stt = OpenAIRealtimeSTTService(api_key="unused", base_url=gateway.ws_url,
                                       turn_detection={"type": "server_vad"} if server_vad else False)
        received: list[Frame] = []
        async with running(stt) as (worker, down, up):
            for words in said:
                if not server_vad:
                    await worker.queue_frame(VADUserStartedSpeakingFrame())
                for frame in pieces(speech(words) + bytes(SPEECH_RATE), SPEECH_RATE, 20):
                    await worker.queue_frame(InputAudioRawFrame(audio=frame, sample_rate=SPEECH_RATE, num_channels=1))
                    await asyncio.sleep(0.002)
                if not server_vad:
                    await worker.queue_frame(VADUserStoppedSpeakingFrame())
            async with asyncio.timeout(30):
                while sum(isinstance(f, TranscriptionFrame) for f in received) < len(said):
                    received.append(await down.get())
        failures = [f for f in [*received, *drain(up)] if isinstance(f, ErrorFrame)]
        assert failures == [], failures
        final = [f.text for f in received if isinstance(f, TranscriptionFrame)]
        assert [word_error_rate(words, text) for words, text in zip(said, final, strict=True)] == [0, 0], final
        assert any(isinstance(f, InterimTranscriptionFrame) for f in received), "interim words while it streams"
    assert gateway.engine.requests and all(r.output_modalities == () for r in gateway.engine.requests), \
        "each utterance is a session that only hears: the model is asked nothing"


async def test_its_openai_tts_service_speaks_a_sentence(gateway: Gateway) -> None:
    """pipecat's ``OpenAITTSService`` (a cascaded pipeline's text to speech) reads
    ``/v1/audio/speech`` as 24 kHz pcm while it streams, naming OpenAI's model and voice; a tuned
    ``speed`` speaks slower."""
    sentence = "Your table is booked for seven tonight."
    length = {}
    for speed in (None, 0.75):
        received: list[Frame] = []
        settings = OpenAITTSService.Settings(speed=speed) if speed else None
        service = OpenAITTSService(api_key="unused", base_url=f"{gateway.url}/v1", settings=settings)
        async with running(service) as (worker, down, up):
            await worker.queue_frame(TTSSpeakFrame(sentence))
            async with asyncio.timeout(60):
                while not any(isinstance(f, TTSStoppedFrame) for f in received):
                    received.append(await down.get())
        failures = [f for f in [*received, *drain(up)] if isinstance(f, ErrorFrame)]
        assert failures == [], failures
        audio = [f for f in received if isinstance(f, TTSAudioRawFrame)]
        said = b"".join(f.audio for f in audio)
        assert word_error_rate(sentence, recognize(said, audio[0].sample_rate)) <= 0.15, speed
        length[speed] = len(said) / audio[0].sample_rate
    assert length[0.75] > 1.2 * length[None], length


async def test_its_responses_llm_service_over_its_websocket_continues_by_previous_response_id(
        gateway: Gateway) -> None:
    """``OpenAIResponsesLLMService`` (pipecat's Responses LLM; its transport a WebSocket on
    ``/v1/responses``): two turns of a context; the second sends only the new message with the
    first response's id, which the connection kept."""
    llm = OpenAIResponsesLLMService(
        api_key="unused", ws_url=gateway.url.replace("http", "ws") + "/v1/responses",
        settings=OpenAIResponsesLLMService.Settings(model=gateway.model, system_instruction="Answer in a few words.",
                                                    temperature=0, max_completion_tokens=48))
    sent: list[dict[str, Any]] = []
    send = llm._ws_send

    async def watched(message: dict[str, Any]) -> None:  # (what it sends, read on the way)
        sent.append(message)
        await send(message)

    llm._ws_send = watched  # type: ignore[method-assign]
    context = LLMContext()
    said: list[str] = []
    received: list[Frame] = []
    async with running(llm) as (worker, down, up):
        for question in ("Say hello.", "Say goodbye."):
            context.add_message({"role": "user", "content": question})
            await worker.queue_frame(LLMContextFrame(context))
            turn: list[Frame] = []
            async with asyncio.timeout(120):
                while not any(isinstance(f, LLMFullResponseEndFrame) for f in turn):
                    turn.append(await down.get())
            said.append("".join(f.text for f in turn if isinstance(f, LLMTextFrame)))
            assert said[-1].strip()
            context.add_message({"role": "assistant", "content": said[-1]})
            received += turn
    failures = [f for f in [*received, *drain(up)] if isinstance(f, ErrorFrame)]
    assert failures == [], failures
    assert "previous_response_id" not in sent[0]
    assert sent[1]["input"] == [{"role": "user", "content": "Say goodbye."}] and sent[1]["previous_response_id"]
    first, second = gateway.engine.requests[-2:]
    # The second turn starts from the first's items, kept by the connection.
    assert second.messages == (*first.messages, {"role": "user", "content": "Say hello."},
                               {"role": "assistant", "content": said[0]})
