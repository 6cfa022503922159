"""``POST /v1/audio/speech``: OpenAI's text to speech, as a session that speaks its input.

The text is the input of a session with ``speak_input``: the engine's Talker speaks it phrase
by phrase, with no model asked, and the audio is sent as it is made, in the asked format
(``output/audio_file.py``), so the first phrase plays while the rest is spoken; or, with
``stream_format: sse``, the same bytes in ``speech.audio.delta`` events. It runs as every
session runs (limits, queue, errors, a client that leaves cancels it).

Voice-agent frameworks (pipecat's ``OpenAITTSService``, LiveKit's ``openai.TTS``) name OpenAI's
models and voices: any model name and voice are taken, since this server has one voice (the
Talker's). ``instructions`` are taken and change nothing. ``speed`` (0.25 to 4) is the voice's own:
hibari speaks from 0.5 to 1.3 times its pace and a speed beyond is said at the nearest (faster, it
drops consonants; slower, the recognizer loses words); an engine whose voice has one pace refuses
another speed than 1 (a 400).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.router import (
    ANSWER_ERRORS,
    CLIENT_LEFT,
    Identity,
    get_chat,
    named_as,
    unless_client_leaves,
)
from gateway.api.chat.service import ChatService
from gateway.domain.policies import StartPolicy
from gateway.output.audio_file import MEDIA_TYPES, AudioFileWriter, SpeechFormat
from gateway.output.sse import FrameEvent
from gateway.service.models import CreateSessionRequest, StrictModel
from gateway.web.event_stream import EventStream
from gateway.web.resources import get_resources

router = APIRouter(prefix="/v1", tags=["openai"])
WHEN_STOPPED = ("the speech goes on at another replica: its whole audio is in the result of "
                "GET /v1/streaming_input/sessions/{id}/result (the id in X-Session-Id), or ask again")


class SpeechRequest(StrictModel):
    model: str = Field(description="any name: this server has one voice")
    input: str = Field(min_length=1, max_length=4096)
    voice: str | dict[str, Any] = Field(description="any voice (a name, or {id}): this server has one")
    instructions: str | None = Field(None, description="taken; the voice takes no instructions")
    response_format: SpeechFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, description="a multiple of the voice's pace; hibari's from 0.5 to "
                         "1.3, a speed beyond said at the nearest")
    stream_format: Literal["audio", "sse"] = Field(
        "audio", description="audio: the file's bytes; sse: speech.audio.delta events carrying them, then "
        "speech.audio.done")


@router.post("/audio/speech", response_model=None,
             responses={200: {"description": "the audio file, sent as it is spoken",
                              "content": {media: {} for media in MEDIA_TYPES.values()}},
                        **ANSWER_ERRORS})
async def create_speech(body: SpeechRequest, request: Request, identity: Identity,
                        chat: Annotated[ChatService, Depends(get_chat)]
                        ) -> StreamingResponse | EventStream | JSONResponse:
    resources = get_resources(request)
    writer = AudioFileWriter(body.response_format)
    session = CreateSessionRequest(model=resources.engine.capabilities.model_names[0], modalities=["text", "audio"],
                                   speak_input=True, start_policy=StartPolicy.ON_END_ONLY,
                                   speed=None if body.speed == 1.0 else body.speed)
    with named_as("input"):
        session_id = await chat.open(identity, session, chat.text_input(body.input))
    audio = _file_bytes(chat.stream(identity, session_id), writer)
    first = await _first_audio(request, chat, identity, session_id, audio)
    if first is None:
        return JSONResponse({}, status_code=CLIENT_LEFT)
    headers = {"X-Session-Id": session_id}
    if body.stream_format == "sse":  # LiveKit asks for it: the file's bytes in events
        return EventStream(_speech_events(_after(first, audio)), ping_sec=resources.settings.sse_ping_sec,
                           draining=resources.draining, headers=headers, when_stopped=WHEN_STOPPED)
    return StreamingResponse(_after(first, audio), media_type=MEDIA_TYPES[body.response_format], headers=headers)


async def _first_audio(request: Request, chat: ChatService, identity: str, session_id: str,
                       audio: AsyncGenerator[bytes, None]) -> bytes | None:
    """The file's first bytes, before the answer's status is sent: the session's error before
    any audio is the status. No engine slot free within the chat queue's timeout is a 503, as
    for a chat; ``None``: the client left (the session is cancelled, as chat.stream does)."""
    timeout_sec = get_resources(request).settings.chat_queue_timeout_sec
    try:
        async with asyncio.timeout(timeout_sec):
            first = await unless_client_leaves(request, anext(audio))
    except TimeoutError:
        await chat.cancel(identity, session_id)
        raise errors.CapacityExhausted(
            f"no speech began within {timeout_sec:g} s (every engine slot busy); the request was dropped, "
            "retry later") from None
    return first


async def _file_bytes(frames: AsyncGenerator[Any, None], writer: AudioFileWriter) -> AsyncGenerator[bytes, None]:
    """The file's bytes as the session's audio frames come, encoded in a worker thread; the
    session's error if it fails (raised after bytes went out, too: the response then breaks off,
    never ends as if the file were whole)."""
    spoken = False
    async with contextlib.aclosing(frames):  # a client that leaves cancels the session (chat.stream)
        async for frame in frames:  # read to the end: a stream left early cancels its session
            if frame.event == "error":
                raise errors.from_envelope(orjson.loads(str(frame.data)))
            if frame.data == "[DONE]":
                continue
            for choice in orjson.loads(str(frame.data)).get("choices") or ():
                audio = (choice.get("delta") or {}).get("audio") or {}
                if audio.get("data"):
                    spoken = True
                    if data := await asyncio.to_thread(writer.write, base64.b64decode(audio["data"])):
                        yield data
    if not spoken:  # before any byte: the answer's status says it, not an empty file
        raise errors.InvalidRequest("the input has nothing the voice can say (no words in English, the "
                                    "language it speaks)", param="input")
    yield await asyncio.to_thread(writer.close)


async def _speech_events(audio: AsyncIterator[bytes]) -> AsyncIterator[ServerSentEvent]:
    """OpenAI's speech stream events: the file's bytes in ``speech.audio.delta`` events, then
    ``speech.audio.done`` (no model made a token: the usage is zero); an ``error`` event if the
    session fails on the way."""
    try:
        async for data in audio:
            if data:  # (the file's end may add nothing: no empty delta for it)
                yield FrameEvent(json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}))
    except errors.GatewayError as exc:
        yield FrameEvent(exc.envelope_json(), event="error")
        return
    yield FrameEvent(json.dumps({"type": "speech.audio.done",
                                      "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}))


async def _after(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    yield first
    async with contextlib.aclosing(rest):
        async for data in rest:
            yield data
