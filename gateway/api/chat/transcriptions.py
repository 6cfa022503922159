"""``POST /v1/audio/transcriptions`` and ``/translations``: OpenAI's (and vLLM's) speech-to-text,
as a session that only hears.

The uploaded file is decoded (any container and codec FFmpeg reads: WAV, MP3, Ogg/Opus,
WebM, FLAC, M4A) to 16 kHz mono pcm16, in a worker thread, and sent as the input chunks of a
session with no output modalities: the engine's Listener hears it phrase by phrase and the
session ends without an answer. Its transcript is the text. It runs as every chat completion
runs (the same session, limits, queue and errors); ``stream: true`` sends OpenAI's
``transcript.text.delta`` events as phrases are heard, then ``transcript.text.done``.

Voice-agent frameworks (pipecat's and LiveKit's OpenAI STT) name OpenAI's models
(``whisper-1``, ``gpt-4o-transcribe``): any model name is taken, since this server has one
recognizer (the engine's). It hears English: another ``language`` is a 400, not a wrong
transcript; a translation (to English) is the English speech's transcript. ``prompt`` and
``temperature`` are taken and change nothing (the recognizer decodes greedily, without a prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.audio_files import RATE, decoded
from gateway.api.chat.router import (
    ANSWER_ERRORS,
    CLIENT_LEFT,
    Identity,
    answered_unless_client_leaves,
    get_chat,
)
from gateway.api.chat.service import ChatService
from gateway.api.languages import check_heard
from gateway.domain.policies import StartPolicy
from gateway.output.frames import TRANSCRIPT_EVENT
from gateway.output.sse import FrameEvent
from gateway.service.models import CreateSessionRequest
from gateway.store.records import ChunkRecord
from gateway.web.event_stream import EVENT_STREAM_CONTENT, EventStream
from gateway.web.resources import get_resources

router = APIRouter(prefix="/v1", tags=["openai"])

#: Each input chunk carries this much audio: the Listener hears the file as if it streamed, and a
#: streamed transcription tells each phrase once it is heard.
CHUNK_SEC = 2
WHEN_STOPPED = ("the transcription goes on at another replica: its text is the input_transcript of "
                "GET /v1/streaming_input/sessions/{id}/result (the id in X-Session-Id), or ask again")


#: What the routes answer in; the timed ones are refused with why, as is diarized_json (no speakers).
ResponseFormat = Literal["json", "text", "verbose_json", "srt", "vtt", "diarized_json"]
NO_TIMINGS = "the recognizer gives no timings: response_format is json, text or verbose_json (without segments)"


@router.post("/audio/transcriptions", response_model=None,
             responses={200: {"description": "json: {text, usage}; text: the text; verbose_json: also task, "
                                             "language, duration (no segments); with stream: true, "
                                             "transcript.text.delta events then transcript.text.done",
                              "content": {"text/plain": {}, **EVENT_STREAM_CONTENT}},
                        **ANSWER_ERRORS})
async def create_transcription(
        request: Request, identity: Identity, chat: Annotated[ChatService, Depends(get_chat)],
        file: Annotated[UploadFile, File(description="the audio: wav, mp3, ogg, webm, flac, m4a, ...")],
        model: Annotated[str, Form(description="any name: this server has one recognizer")],
        language: Annotated[str | None, Form(description="ISO-639-1; the recognizer hears en")] = None,
        languages: Annotated[list[str] | None, Form(alias="languages[]", description="each heard: en")] = None,
        prompt: Annotated[str | None, Form(description="taken; the recognizer takes no prompt")] = None,
        response_format: Annotated[ResponseFormat, Form()] = "json",
        temperature: Annotated[float | None, Form(ge=0, le=1, description="taken; decoding is greedy")] = None,
        stream: Annotated[bool, Form()] = False,
        timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
        granularities_unbracketed: Annotated[list[str] | None, Form(
            alias="timestamp_granularities", description="the same, as a plain form field")] = None,
) -> JSONResponse | PlainTextResponse | EventStream:
    for said in ([language] if language is not None else []) + (languages or []):
        check_heard(said, "language" if said == language else "languages")
    if timestamp_granularities or granularities_unbracketed:
        raise errors.InvalidRequest(NO_TIMINGS, param="timestamp_granularities")
    return await _heard(request, identity, chat, file, response_format, "transcribe", stream=stream)


@router.post("/audio/translations", response_model=None,
             responses={200: {"description": "json: {text}; text: the text; verbose_json: also task, language, "
                                             "duration (no segments)", "content": {"text/plain": {}}},
                        **ANSWER_ERRORS})
async def create_translation(
        request: Request, identity: Identity, chat: Annotated[ChatService, Depends(get_chat)],
        file: Annotated[UploadFile, File(description="the audio: wav, mp3, ogg, webm, flac, m4a, ...")],
        model: Annotated[str, Form(description="any name: this server has one recognizer")],
        prompt: Annotated[str | None, Form(description="taken; the recognizer takes no prompt")] = None,
        response_format: Annotated[ResponseFormat, Form()] = "json",
        temperature: Annotated[float | None, Form(ge=0, le=1, description="taken; decoding is greedy")] = None,
        language: Annotated[str | None, Form(description="vLLM's: the speech's language; the recognizer hears en")
                            ] = None,
) -> JSONResponse | PlainTextResponse | EventStream:
    """OpenAI's speech to English text. The recognizer hears English only, so this is the
    English speech's transcript: speech in another language is not understood."""
    if language is not None:
        check_heard(language, "language")
    return await _heard(request, identity, chat, file, response_format, "translate", stream=False)


async def _heard(request: Request, identity: Identity, chat: ChatService, file: UploadFile,
                 response_format: ResponseFormat, task: str, *, stream: bool,
                 ) -> JSONResponse | PlainTextResponse | EventStream:
    """The file heard by a session that only hears, answered in ``response_format``."""
    if response_format in ("srt", "vtt"):
        raise errors.InvalidRequest(NO_TIMINGS, param="response_format")
    if response_format == "diarized_json":
        raise errors.InvalidRequest("the recognizer tells no speakers apart: response_format is json, text or "
                                    "verbose_json", param="response_format")
    resources = get_resources(request)
    chunks = await asyncio.to_thread(heard_chunks, await file.read(), resources.settings.max_payload_per_session)
    seconds = sum(len(chunk.payload) for chunk in chunks) / 2 / RATE
    hearing = CreateSessionRequest(model=resources.engine.capabilities.model_names[0], modalities=[],
                                   start_policy=StartPolicy.ON_END_ONLY)
    session_id = await chat.open(identity, hearing, chunks)
    headers = {"X-Session-Id": session_id}
    if stream:
        return EventStream(_transcript_events(chat.stream(identity, session_id)),
                           ping_sec=resources.settings.sse_ping_sec, draining=resources.draining, headers=headers,
                           when_stopped=WHEN_STOPPED)
    record = await answered_unless_client_leaves(request, chat, identity, session_id)
    if record is None:
        return JSONResponse({}, status_code=CLIENT_LEFT)
    text = record.input_transcript or ""
    if response_format == "text":
        return PlainTextResponse(text, headers=headers)
    if response_format == "verbose_json":  # LiveKit asks whisper-1 for it, for the language
        return JSONResponse({"task": task, "language": "english", "duration": seconds, "text": text,
                             "usage": _usage(seconds)}, headers=headers)
    return JSONResponse({"text": text, "usage": _usage(seconds)}, headers=headers)


def heard_chunks(data: bytes, max_bytes: int) -> list[ChunkRecord]:
    """The file as the input chunks of a session that hears it (blocking: the decoding, and each
    chunk's digest, are work no other session should wait for on the event loop)."""
    pcm = decoded(data, max_bytes)
    step = CHUNK_SEC * RATE * 2
    return [ChunkRecord(seq, "audio", pcm[at:at + step], "pcm16", None, RATE, end_of_input=at + step >= len(pcm),
                        audio_ms=len(pcm[at:at + step]) * 1000 // (2 * RATE)).prepared()
            for seq, at in enumerate(range(0, len(pcm), step))]


def _usage(seconds: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(seconds)}


async def _transcript_events(frames: AsyncGenerator[ServerSentEvent, None]) -> AsyncIterator[ServerSentEvent]:
    """The session's transcript frames as OpenAI's transcription stream events (the done event
    has no usage: the SDK reads token counts there, and no model made a token)."""
    told = ""
    async with contextlib.aclosing(frames):  # a client that leaves cancels the session (chat.stream)
        async for frame in frames:  # read to the end: a stream left early cancels its session
            if frame.event == TRANSCRIPT_EVENT:
                heard = json.loads(str(frame.data))["input_transcript"]
                delta = heard[len(told):] if heard.startswith(told) else heard
                told = heard
                if delta:
                    yield FrameEvent(json.dumps({"type": "transcript.text.delta", "delta": delta}))
            elif frame.event == "error":
                yield frame
            elif frame.data == "[DONE]":
                yield FrameEvent(json.dumps({"type": "transcript.text.done", "text": told}))
