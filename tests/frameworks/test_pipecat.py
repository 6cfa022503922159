"""pipecat's ``OpenAIRealtimeLLMService`` pointed at our URL, in a pipeline with pipecat's own
test transports (``pipecat.tests.utils.QueuedFrameProcessor`` at both ends, as its
``run_test`` builds it): a spoken turn in as microphone frames, audio frames out.

pipecat treats any ``error`` event but two codes as fatal and parses every server
event with its own models, so a clean run says the events fit it too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.services.openai.stt import OpenAISTTService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

from omni_adapter.audio import wav_of
from tests.frameworks.conftest import Gateway
from tests.voice import SPEECH_RATE, pieces, recognize, speech, word_error_rate

pytestmark = pytest.mark.engine


async def test_a_spoken_turn_in_audio_frames_out(gateway: Gateway) -> None:
    llm = OpenAIRealtimeLLMService(
        api_key="unused", base_url=gateway.ws_url,
        settings=OpenAIRealtimeLLMService.Settings(
            model=gateway.model, system_instruction="You are a helpful assistant. Answer in one short sentence.",
            max_tokens=24))
    down: asyncio.Queue[Frame] = asyncio.Queue()
    up: asyncio.Queue[Frame] = asyncio.Queue()
    pipeline = Pipeline([QueuedFrameProcessor(queue=up, queue_direction=FrameDirection.UPSTREAM),
                         llm, QueuedFrameProcessor(queue=down, queue_direction=FrameDirection.DOWNSTREAM)])
    worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker: Any, _frame: Any) -> None:
        started.set()

    runner = WorkerRunner()
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    received: list[Frame] = []
    try:
        await asyncio.wait_for(started.wait(), 30)
        # A microphone: the question in 20 ms frames, then a second of silence (server VAD ends the turn).
        for frame in pieces(speech("What is the capital of France?") + bytes(SPEECH_RATE), SPEECH_RATE, 20):
            await worker.queue_frame(InputAudioRawFrame(audio=frame, sample_rate=SPEECH_RATE, num_channels=1))
            await asyncio.sleep(0.005)
        async with asyncio.timeout(180):
            while not any(isinstance(f, LLMFullResponseEndFrame) for f in received):
                received.append(await down.get())
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(running, 60)
    finally:
        if not running.done():
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
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
