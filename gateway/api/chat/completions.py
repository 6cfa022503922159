"""``POST /v1/completions``: OpenAI's (legacy) text completion, as vLLM serves it.

The prompt is the whole input: a session with ``raw_prompt`` (no chat template; the
model's special tokens in the prompt are its own, and the tokenizer's BOS goes before it,
as vLLM tokenizes a completion's prompt). It runs as every chat completion runs (the same
session, limits, queue and errors), and its ``chat.completion`` or chunk frames are read
back as a ``text_completion``. vLLM's quickstart, ``vllm bench serve`` and evaluation
harnesses speak it.

Served: one text prompt (a string, or a list of one), ``max_tokens`` (16 unless set or null,
as OpenAI and vLLM), the sampling fields chat takes with vLLM's (``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``bad_words``... ``VllmRequestOptions``), ``echo``, ``stream`` with
``stream_options``. Refused with an error that says
why: several prompts, prompts of token ids and ``suffix`` (insertion) are 400s; ``n`` or
``best_of`` above 1 (one answer per request here) and an empty prompt are 400s. ``logprobs``
(the answer's tokens, as vLLM returns them) is served; with ``echo`` (the prompt's too) it is a 400.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.models import CompletionUsage, OpenAIBookkeeping
from gateway.api.chat.router import (
    ANSWER_ERRORS,
    CLIENT_LEFT,
    Identity,
    completion_unless_client_leaves,
    get_chat,
    named_as,
)
from gateway.api.chat.service import ChatService
from gateway.domain.policies import StartPolicy
from gateway.output.frames import DONE
from gateway.output.sse import FrameEvent
from gateway.service.models import (
    RAW_PROMPT_MAX_TOKENS,
    CreateSessionRequest,
    ResponseFormat,
    Seed,
    StreamOptions,
    StructuredOutputs,
    TopK,
    VllmRequestOptions,
)
from gateway.web.event_stream import EVENT_STREAM_CONTENT, EventStream
from gateway.web.resources import get_resources
from gateway.web.validation import IdempotencyKey, param_path

router = APIRouter(prefix="/v1", tags=["openai"])
WHEN_STOPPED = ("the completion goes on at another replica: read it as a chat.completion at "
                "GET /v1/streaming_input/sessions/{id}/result (the id in X-Session-Id), or ask again")


class CompletionRequest(VllmRequestOptions, OpenAIBookkeeping):
    """OpenAI's completion request, with vLLM's sampling extras."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    max_tokens: int | None = Field(RAW_PROMPT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Literal[1] = 1
    best_of: Literal[1] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, strict=True)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None

    @field_validator("max_tokens")
    @classmethod
    def _default_when_null(cls, value: int | None) -> int:
        return RAW_PROMPT_MAX_TOKENS if value is None else value  # as vLLM takes an explicit null


class TextLogprobs(BaseModel):
    """The legacy completions' log probabilities: a column per field, a row per token."""

    tokens: list[str]
    token_logprobs: list[float]
    #: Each token's likeliest alternatives (and itself): token -> log probability.
    top_logprobs: list[dict[str, float]]
    #: Where each token starts in the choice's text (after the echoed prompt).
    text_offset: list[int]


class TextCompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None


class TextCompletion(BaseModel):
    """OpenAI's ``text_completion`` (a stream's chunks have this shape too); its ``id`` is the session's."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextCompletionChoice]
    usage: CompletionUsage | None = None


#: The fields that mean the same in a session, checked by its rules.
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "stream_options", "stop", "presence_penalty",
             "frequency_penalty", "logit_bias", "seed", "top_k", "min_p", "repetition_penalty", "response_format",
             "structured_outputs", "min_tokens", "ignore_eos", *VllmRequestOptions.model_fields}


@router.post("/completions", response_model=None,
             responses={200: {"model": TextCompletion,
                              "description": "a text_completion; with stream: true, text_completion chunks then "
                                             "[DONE] (the session id is in X-Session-Id)",
                              "content": EVENT_STREAM_CONTENT},
                        **ANSWER_ERRORS})
async def create_completion(body: CompletionRequest, request: Request, identity: Identity,
                            chat: Annotated[ChatService, Depends(get_chat)],
                            idempotency_key: IdempotencyKey = None) -> JSONResponse | EventStream:
    resources = get_resources(request)
    prompt = _prompt(body)
    model = body.model or resources.engine.capabilities.model_names[0]
    with named_as("prompt"):
        session_id = await chat.open(identity, _session(body), chat.text_input(prompt), idempotency_key)
    headers = {"X-Session-Id": session_id}
    echoed = prompt if body.echo else ""
    if body.stream:
        return EventStream(_chunks(chat.stream(identity, session_id), session_id, model, echoed,
                                   _Logprobs(0) if body.logprobs is not None else None),
                           ping_sec=resources.settings.sse_ping_sec, draining=resources.draining, headers=headers,
                           when_stopped=WHEN_STOPPED)
    with named_as("prompt"):
        answer = await completion_unless_client_leaves(request, chat, identity, session_id)
    if answer is None:
        return JSONResponse({}, status_code=CLIENT_LEFT)
    choice = answer["choices"][0]
    text = echoed + (choice["message"].get("content") or "")
    logprobs = _Logprobs(len(echoed)).of(choice["logprobs"]) if body.logprobs is not None else None
    return JSONResponse({**_shell(session_id, answer["created"], model), "usage": answer["usage"],
                         "choices": [_choice(text, choice["finish_reason"], logprobs)]}, headers=headers)


def _prompt(body: CompletionRequest) -> str:
    if body.suffix:
        raise errors.InvalidRequest("suffix (text inserted after the completion) is not served here", param="suffix")
    if body.echo and body.logprobs is not None:
        raise errors.InvalidRequest("the prompt's log probabilities (echo with logprobs) are not served here: the "
                                    "answer's are, without echo", param="logprobs")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > 1:
            raise errors.InvalidRequest("one prompt per request here: send each as its own request", param="prompt")
        prompt = prompt[0]
    if not prompt:  # "" or []
        raise errors.EmptyInput("the prompt is empty", param="prompt")
    if not isinstance(prompt, str):
        raise errors.InvalidRequest("the prompt is text here (a string), not token ids", param="prompt")
    return prompt


def _session(body: CompletionRequest) -> CreateSessionRequest:
    if body.stream_options is not None and not body.stream:
        raise errors.InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
    try:
        asked = {"logprobs": True, "top_logprobs": body.logprobs} if body.logprobs is not None else {}
        return CreateSessionRequest.model_validate(
            {**body.model_dump(include=_SAMPLING, exclude_none=True, by_alias=True), **asked, "raw_prompt": True,
             "start_policy": StartPolicy.ON_END_ONLY})
    except ValidationError as exc:  # a rule of the session's (stop words, logit_bias keys, the schema)
        first = exc.errors()[0]
        raise errors.ValidationFailed(str(first["msg"]).removeprefix("Value error, "),
                                      param=".".join(param_path(first["loc"])) or None) from None


def _shell(session_id: str, created: int, model: str) -> dict[str, Any]:
    return {"id": session_id, "object": "text_completion", "created": created, "model": model}


def _choice(text: str, finish_reason: str | None, logprobs: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class _Logprobs:
    """Chat's log probability entries as the legacy completions' columns, each token's
    ``text_offset`` counted on from the tokens before it."""

    def __init__(self, offset: int) -> None:
        self._offset = offset

    def of(self, chat: dict[str, Any] | None) -> dict[str, list[Any]]:
        columns: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in (chat or {}).get("content") or ():
            columns["tokens"].append(entry["token"])
            columns["token_logprobs"].append(entry["logprob"])
            # vLLM's: the token itself, then the likeliest (one entry when it is among them).
            columns["top_logprobs"].append({entry["token"]: entry["logprob"],
                                            **{t["token"]: t["logprob"] for t in entry["top_logprobs"]}})
            columns["text_offset"].append(self._offset)
            self._offset += len(entry["token"])
        return columns


async def _chunks(frames: AsyncGenerator[ServerSentEvent, None], session_id: str, model: str,
                  echoed: str, logprobs: _Logprobs | None) -> AsyncIterator[ServerSentEvent]:
    """The session's ``chat.completion.chunk`` frames as ``text_completion`` chunks; an error frame
    (the session failed) as it is, as a chat stream sends it. ``logprobs``: asked for (no echo)."""
    async for frame in frames:
        if frame.event == "error":
            yield frame
            return
        if frame.event:  # another kind of frame (the input's transcript)
            continue
        if frame.data == DONE:
            yield FrameEvent(data=DONE)
            return
        chunk = orjson.loads(str(frame.data))
        shell = _shell(session_id, chunk["created"], model)
        if echoed:
            yield FrameEvent(data=orjson.dumps({**shell, "choices": [_choice(echoed, None)]}).decode())
            echoed = ""
        told = [_choice(delta.get("content") or "", c.get("finish_reason"),
                        logprobs.of(c["logprobs"]) if logprobs is not None and c.get("logprobs") else None)
                for c in chunk.get("choices") or () if (delta := c.get("delta") or {})
                # The role frame (the first token) is a chunk of no text, as vLLM sends a token's.
                or c.get("finish_reason") or c.get("logprobs")]
        if told or chunk.get("usage"):
            out = {**shell, "choices": told}
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            yield FrameEvent(data=orjson.dumps(out).decode())
