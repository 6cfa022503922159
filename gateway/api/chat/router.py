"""OpenAI routes: ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator, Mapping
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.models import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from gateway.api.chat.service import ChatService
from gateway.output.audio import in_format
from gateway.output.frames import DONE
from gateway.output.sse import FrameEvent
from gateway.store.session_hash import SessionRecord
from gateway.web.event_stream import EVENT_STREAM_CONTENT, RESUME_ELSEWHERE, EventStream
from gateway.web.resources import Resources, get_identity, get_resources
from gateway.web.validation import IdempotencyKey

router = APIRouter(prefix="/v1", tags=["openai"])
T = TypeVar("T")

Identity = Annotated[str, Depends(get_identity)]


async def get_chat(request: Request) -> ChatService:
    return chat_service(get_resources(request))


def chat_service(resources: Resources) -> ChatService:
    """The chat use cases on what the lifespan opened (any transport's)."""
    return ChatService(resources.service, resources.settings.max_chunk_bytes, resources.draining)


_ANSWER = {
    "model": ChatCompletion,
    "description": "a chat.completion; with stream: true, chat.completion.chunk frames then [DONE] "
                   "(the session id is in X-Session-Id)",
    "content": EVENT_STREAM_CONTENT,
}


#: What a chat's answer may fail with: chat completions and responses alike.
ANSWER_ERRORS = errors.error_responses(
    errors.InvalidJson, errors.InvalidRequest, errors.PromptTooLong, errors.ValidationFailed, errors.InvalidPayload,
    errors.UnsupportedModality, errors.EmptyInput, errors.ModelNotFound, errors.ChunkTooLarge, errors.Unauthorized,
    errors.TooManyRequests, errors.TooManySessions, errors.SessionExpired, errors.SessionCancelled,
    errors.StoreUnavailable, errors.Overloaded, errors.StreamingInputDisabled, errors.CapacityExhausted,
    errors.EngineUnavailable, errors.IdempotencyKeyReused)
#: nginx's "client closed request": the answer of a client that hung up, which no one reads.
CLIENT_LEFT = 499
#: A chat stream with no ids cut by a stopping replica: there is no id to resume after.
WITHOUT_IDS_STOPPED = ("the answer goes on at another replica: read it whole at GET "
                       "/v1/streaming_input/sessions/{id}/result, or its stream from the start at .../events "
                       "(the id in X-Session-Id; X-Event-Ids: true gives a stream ids to resume after)")


@router.post("/chat/completions", response_model=None, responses={200: _ANSWER, **ANSWER_ERRORS})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, identity: Identity,
                                 chat: Annotated[ChatService, Depends(get_chat)],
                                 idempotency_key: IdempotencyKey = None) -> JSONResponse | EventStream:
    if not body.modalities:  # a completion has an answer; hearing alone is transcription's
        raise errors.ValidationFailed("modalities needs text (and may add audio); for the transcript alone use "
                                      "/v1/audio/transcriptions, or the sessions API's modalities []",
                                      param="modalities")
    session_id = await chat.start(identity, body, idempotency_key)
    headers = {"X-Session-Id": session_id}
    resources = get_resources(request)
    echoed = _echoed(body)
    if body.stream:
        frames = chat.stream(identity, session_id)
        if echoed:
            frames = with_echo(frames, echoed)
        with_ids = request.headers.get("x-event-ids", "").lower() in ("1", "true")
        return EventStream(frames if with_ids else as_openai_sends(frames), ping_sec=resources.settings.sse_ping_sec,
                           draining=resources.draining, headers=headers,
                           when_stopped=RESUME_ELSEWHERE if with_ids else WITHOUT_IDS_STOPPED)
    answer = await completion_unless_client_leaves(request, chat, identity, session_id)
    if answer is None:
        return JSONResponse({}, status_code=CLIENT_LEFT)
    if body.audio is not None and body.audio.format not in (None, "wav"):
        # (minutes of audio: decoded and encoded off the loop)
        answer = await asyncio.to_thread(in_format, answer, body.audio.format)
    if echoed:
        message = answer["choices"][0]["message"]
        message["content"] = echoed + (message.get("content") or "")
    return JSONResponse(answer, headers=headers)


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's ``echo``: the last message's text, which the answer's content starts with, when it is
    the assistant's (the answer's role). Only the door's answer has it: the session's result and
    events hold the answer alone, as a completion's ``echo``."""
    last = body.messages[-1]
    return str(last.as_history().get("content") or "") if body.echo and last.role == "assistant" else ""


async def with_echo(frames: AsyncGenerator[ServerSentEvent, None], echoed: str) -> AsyncGenerator[ServerSentEvent, None]:
    """The frames with ``echoed`` in a content chunk of its own right after the role chunk, as vLLM
    streams it."""
    async with contextlib.aclosing(frames):
        async for frame in frames:
            yield frame
            if echoed and not frame.event and frame.data != DONE:
                chunk = orjson.loads(str(frame.data))
                chunk["choices"] = [{"index": 0, "delta": {"content": echoed}, "finish_reason": None}]
                yield FrameEvent(data=orjson.dumps(chunk).decode())
                echoed = ""


@contextlib.contextmanager
def named_as(param: str, fields: Mapping[str, str] | None = None) -> Iterator[None]:
    """An error named in the chat request's terms (its messages), named in another door's (``input``,
    ``prompt``): what the engine refused is that door's input. ``fields``: chat's names of other
    fields (a path's start) and the door's, in the param and the message."""
    try:
        yield
    except errors.GatewayError as exc:
        if exc.param is not None and exc.param.startswith("messages"):
            exc.param = param
        if fields:
            exc.message = renamed(exc.message, fields)
            exc.param = None if exc.param is None else renamed(exc.param, fields)
        raise


def renamed(text: str, fields: Mapping[str, str]) -> str:
    """``text`` with chat's field names (the longest first) in another door's."""
    for chat_name in sorted(fields, key=len, reverse=True):
        text = text.replace(chat_name, fields[chat_name])
    return text


async def as_openai_sends(frames: AsyncGenerator[ServerSentEvent, None]) -> AsyncIterator[ServerSentEvent]:
    """The frames without their ``id:`` lines, as OpenAI and vLLM send a chat stream: some clients
    read each event as ``data: <json>`` alone (vLLM's ``vllm bench serve``). ``X-Event-Ids: true``
    keeps them, for a resume at the session's events with ``Last-Event-ID``."""
    async with contextlib.aclosing(frames):  # closed with this one (a client that left): the session is cancelled
        async for frame in frames:
            frame.id = None
            yield frame


async def completion_unless_client_leaves(request: Request, chat: ChatService, identity: str,
                                          session_id: str) -> dict[str, Any] | None:
    """The session's ``chat.completion``; ``None`` once the client hung up, and its work is stopped."""
    record = await answered_unless_client_leaves(request, chat, identity, session_id)
    return None if record is None else record.result


async def answered_unless_client_leaves(request: Request, chat: ChatService, identity: str,
                                        session_id: str) -> SessionRecord | None:
    """The completed session; ``None`` once the client hung up, and its work is stopped."""
    timeout_sec = get_resources(request).settings.chat_queue_timeout_sec
    record = await unless_client_leaves(request, chat.answered(identity, session_id, timeout_sec))
    if record is None:  # nobody waits for it any more: stop the engine work
        await chat.cancel(identity, session_id)
    return record


async def unless_client_leaves(request: Request, answer: Awaitable[T]) -> T | None:
    """``answer``, or ``None`` as soon as the client hangs up (its body is read: the next
    message of the request is the disconnect)."""
    waiting = asyncio.ensure_future(answer)
    leaving = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not waiting.done():
            waiting.cancel()
        await asyncio.gather(waiting, leaving, return_exceptions=True)
    return None if waiting.cancelled() else waiting.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/models", response_model=ModelList,
            responses=errors.error_responses(errors.Unauthorized, errors.TooManyRequests, errors.StoreUnavailable,
                                             errors.Overloaded))
async def list_models(request: Request, identity: Identity) -> ModelList:
    resources = get_resources(request)
    return ModelList(data=[_card(resources, name) for name in resources.engine.capabilities.model_names])


@router.get("/models/{model:path}", response_model=ModelCard,  # served names may hold a "/"
            responses=errors.error_responses(errors.ModelNotFound, errors.Unauthorized, errors.TooManyRequests,
                                             errors.StoreUnavailable, errors.Overloaded))
async def retrieve_model(model: str, request: Request, identity: Identity) -> ModelCard:
    """One served model (the openai SDK's ``models.retrieve``); 404 ``model_not_found`` for any other."""
    names = get_resources(request).engine.capabilities.model_names
    if model not in names:
        raise errors.ModelNotFound(f"model {model!r} is not served here (served: {', '.join(names)})", param="model")
    return _card(get_resources(request), model)


def _card(resources: Resources, name: str) -> ModelCard:
    # Like vLLM: the models exist from now on, as far as a client can tell.
    limit = resources.service.max_input_tokens  # the context less the one token an answer needs
    return ModelCard(id=name, created=int(time.time()), root=resources.engine.capabilities.model_names[0],
                     max_model_len=None if limit is None else limit + 1)
