"""LiveKit Agents' OpenAI plugin: ``livekit.plugins.openai.realtime.RealtimeModel(base_url=...)``,
its STT and TTS, and ``openai.responses.LLM`` on its default WebSocket transport.

An ``AgentSession`` needs a LiveKit room (a LiveKit server, which does not run
here), so this drives the session class the plugin gives every agent
(``RealtimeModel.session()``, the same ``RealtimeSession`` an ``AgentSession``
uses) directly: a text turn from its chat context (``update_chat_ctx`` +
``generate_reply``) and a spoken turn of ``push_audio`` frames that server VAD
answers. Not covered: the room's transport and the ``AgentSession`` turn logic.
The plugin validates every server event it handles; an invalid one, or an
``error`` event, is its ``error`` event here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import llm, utils
from livekit.agents.stt import SpeechEventType
from livekit.plugins import openai
from livekit.plugins.openai.realtime import RealtimeModel

from tests.frameworks.conftest import Gateway
from tests.gateway.test_realtime import conforming
from tests.voice import SPEECH_RATE, pieces, recognize, speech, word_error_rate

pytestmark = pytest.mark.engine


async def said(generation: llm.GenerationCreatedEvent) -> tuple[str, bytes]:
    """The text and the audio of a generation's messages, read to their end."""
    text, audio = [], []

    async def read(message: llm.MessageGeneration) -> None:
        async def texts() -> None:
            async for piece in message.text_stream:
                text.append(str(piece))

        async def frames() -> None:
            async for frame in message.audio_stream:
                audio.append(bytes(frame.data))

        await asyncio.gather(texts(), frames())

    async with asyncio.timeout(180):
        async for message in generation.message_stream:
            await read(message)
    return "".join(text), b"".join(audio)


async def test_a_session_with_a_text_turn_and_a_spoken_turn(gateway: Gateway) -> None:
    model = RealtimeModel(model=gateway.model, base_url=f"{gateway.url}/v1", api_key="unused")
    session = model.session()
    failures: list[Any] = []
    raw: list[dict[str, Any]] = []
    session.on("error", failures.append)
    session.on("openai_server_event_received", raw.append)
    try:
        await session.update_instructions("You are a helpful assistant. Answer in one short sentence.")
        context = session.chat_ctx.copy()
        context.add_message(role="user", content="Hello! Say hi back.")
        await session.update_chat_ctx(context)
        text, audio = await said(await session.generate_reply())
        assert text.strip() and len(audio) > SPEECH_RATE // 2, "a spoken answer, with its words"

        spoken: asyncio.Future[llm.GenerationCreatedEvent] = asyncio.get_running_loop().create_future()
        session.on("generation_created", lambda ev: spoken.done() or spoken.set_result(ev))
        for piece in pieces(speech("What is the capital of France?") + bytes(SPEECH_RATE), SPEECH_RATE, 20):
            samples = np.frombuffer(piece, dtype="<i2")
            session.push_audio(rtc.AudioFrame(piece, SPEECH_RATE, 1, len(samples)))
            await asyncio.sleep(0.002)
        text, audio = await said(await asyncio.wait_for(spoken, 120))
        assert text.strip() and len(audio) > SPEECH_RATE // 2
        heard = gateway.engine.requests[-1]
        assert heard.input_role == "user" and heard.messages[-2:] != ()
    finally:
        await session.aclose()
        await model.aclose()
    assert failures == [], failures
    for event in raw:
        conforming(event)
    assert any(e["type"] == "input_audio_buffer.speech_started" for e in raw)


async def test_its_openai_stt_hears_a_recorded_utterance(gateway: Gateway) -> None:
    """LiveKit's ``openai.STT`` (a pipeline agent's speech to text) sends the utterance's frames as
    a WAV file; for ``whisper-1`` it asks for ``verbose_json``, for the language."""
    question = "Turn the music down a little."
    frames = [rtc.AudioFrame(piece, SPEECH_RATE, 1, len(piece) // 2)
              for piece in pieces(speech(question), SPEECH_RATE, 20)]
    for model in ("whisper-1", "gpt-4o-mini-transcribe"):
        stt = openai.STT(model=model, base_url=f"{gateway.url}/v1", api_key="unused", use_realtime=False)
        try:
            event = await stt.recognize(frames)
        finally:
            await stt.aclose()
        assert event.type == SpeechEventType.FINAL_TRANSCRIPT
        assert word_error_rate(question, event.alternatives[0].text) == 0, event.alternatives[0].text


async def test_its_openai_stt_streams_over_a_realtime_transcription_session(gateway: Gateway) -> None:
    """LiveKit's ``openai.STT(use_realtime=True)``: a stream of microphone frames, cut into
    utterances by server VAD, each one's interim and final transcript as it is spoken."""
    said = ["Turn the music down a little.", "What is the capital of France?"]
    async with utils.http_context.open():
        stt = openai.STT(model="gpt-4o-mini-transcribe", base_url=f"{gateway.url}/v1", api_key="unused",
                         use_realtime=True)
        stream = stt.stream()
        try:
            for words in said:
                for piece in pieces(speech(words) + bytes(SPEECH_RATE * 2), SPEECH_RATE, 20):
                    stream.push_frame(rtc.AudioFrame(piece, SPEECH_RATE, 1, len(piece) // 2))
                    await asyncio.sleep(0.002)
            events = []
            async with asyncio.timeout(30):
                async for event in stream:
                    events.append(event)
                    if sum(e.type == SpeechEventType.FINAL_TRANSCRIPT for e in events) == len(said):
                        break
        finally:
            await stream.aclose()
            await stt.aclose()
    kinds = [e.type for e in events]
    assert kinds.count(SpeechEventType.START_OF_SPEECH) == kinds.count(SpeechEventType.END_OF_SPEECH) == 2
    final = [e.alternatives[0].text for e in events if e.type == SpeechEventType.FINAL_TRANSCRIPT]
    assert [word_error_rate(words, text) for words, text in zip(said, final, strict=True)] == [0, 0], final
    assert gateway.engine.requests and all(r.output_modalities == () for r in gateway.engine.requests), \
        "each utterance is a session that only hears: the model is asked nothing"


async def test_its_openai_tts_speaks_a_sentence(gateway: Gateway) -> None:
    """LiveKit's ``openai.TTS`` (a pipeline agent's text to speech) asks for mp3 and decodes it; a
    tuned ``speed`` speaks faster."""
    sentence = "Your table is booked for seven tonight."
    length = {}
    for speed in (1.0, 1.25):
        tts = openai.TTS(base_url=f"{gateway.url}/v1", api_key="unused", speed=speed)
        try:
            frames = [event.frame async for event in tts.synthesize(sentence)]
        finally:
            await tts.aclose()
        said = b"".join(bytes(frame.data) for frame in frames)
        assert word_error_rate(sentence, recognize(said, frames[0].sample_rate)) <= 0.15, speed
        length[speed] = len(said) / frames[0].sample_rate
    assert length[1.25] < 0.93 * length[1.0], length


async def test_its_responses_llm_over_its_default_websocket_two_turns(gateway: Gateway) -> None:
    """LiveKit's ``openai.responses.LLM`` (a pipeline agent's LLM), its default transport a
    WebSocket on ``/v1/responses``: the second turn continues the first by its
    ``previous_response_id`` on the same socket, sending only the new items."""
    async with utils.http_context.open():
        model = openai.responses.LLM(model=gateway.model, base_url=f"{gateway.url}/v1/responses", api_key="unused",
                                     temperature=0, max_output_tokens=48)
        try:
            context = llm.ChatContext()
            context.add_message(role="system", content="Answer in a few words.")
            said = []
            for question in ("Say hello.", "Say goodbye."):
                context.add_message(role="user", content=question)
                async with model.chat(chat_ctx=context) as stream:
                    text = "".join([chunk.delta.content async for chunk in stream
                                    if chunk.delta is not None and chunk.delta.content])
                assert text.strip()
                said.append(text)
                context.add_message(role="assistant", content=text)
            first, second = gateway.engine.requests[-2:]
            # The second turn starts from the first one's items, kept by the connection (its input and
            # its answer); then what LiveKit sent: every item after the context it last sent, its own
            # copy of the answer too.
            answer = {"role": "assistant", "content": said[0]}
            assert second.messages == (*first.messages, {"role": "user", "content": "Say hello."}, answer, answer)
            assert model._prev_resp_id, "it continued by the previous response's id"
        finally:
            await model.aclose()
