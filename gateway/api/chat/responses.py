"""``POST /v1/responses``: OpenAI's Responses API as a chat completion in another shape.

The request is translated into a chat completion request (``chat_request``) and runs
as one: the same session, checks, limits and errors. Its answer is translated back
(``responses_out.py``): the stored ``chat.completion`` into a ``response`` object, or the
session's ``chat.completion.chunk`` frames into Responses stream events. Nothing is
stored to continue from: a client sends the conversation so far in ``input``, as
agent frameworks do by default.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway import errors
from gateway.api.chat.models import ChatCompletionRequest
from gateway.api.chat.responses_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    ResponseObject,
    ResponsesRequest,
)
from gateway.api.chat.responses_out import ResponseShape, response_events, response_of
from gateway.api.chat.router import (
    ANSWER_ERRORS,
    CLIENT_LEFT,
    Identity,
    completion_unless_client_leaves,
    get_chat,
    named_as,
    renamed,
)
from gateway.api.chat.service import ChatService
from gateway.web.event_stream import EVENT_STREAM_CONTENT, EventStream
from gateway.web.resources import get_resources
from gateway.web.validation import IdempotencyKey, param_path

router = APIRouter(prefix="/v1", tags=["openai"])
#: A Responses stream cannot be resumed (its events are not stored; the chat frames are).
WHEN_STOPPED = ("the answer goes on at another replica: read it whole as a chat.completion at "
                "GET /v1/streaming_input/sessions/{id}/result (the id in X-Session-Id), or ask again")


@router.post("/responses", response_model=None,
             responses={200: {"model": ResponseObject,
                              "description": "a response object; with stream: true, Responses stream events "
                                             "(response.created ... response.completed, each named by its type)",
                              "content": EVENT_STREAM_CONTENT},
                        **ANSWER_ERRORS})
async def create_response(body: ResponsesRequest, request: Request, identity: Identity,
                          chat: Annotated[ChatService, Depends(get_chat)],
                          idempotency_key: IdempotencyKey = None) -> JSONResponse | EventStream:
    resources = get_resources(request)
    session_id, shape = await start_response(chat, identity, body, resources.engine.capabilities.model_names[0],
                                             idempotency_key)
    headers = {"X-Session-Id": session_id}
    if body.stream:
        return EventStream(response_events(chat.stream(identity, session_id), shape, session_id),
                           ping_sec=resources.settings.sse_ping_sec, draining=resources.draining, headers=headers,
                           when_stopped=WHEN_STOPPED)
    with named_as("input", CHAT_NAMES):  # the engine's own refusal (a sidecar's context check) comes here
        completion = await completion_unless_client_leaves(request, chat, identity, session_id)
    if completion is None:
        return JSONResponse({}, status_code=CLIENT_LEFT)
    return JSONResponse(response_of(completion, shape), headers=headers)


async def start_response(chat: ChatService, identity: str, body: ResponsesRequest, served: str,
                         idempotency_key: str | None = None, previous_response_id: str | None = None,
                         ) -> tuple[str, ResponseShape]:
    """The session that answers ``body`` (any transport's), and the shape of its response.

    ``served``: the model a request that names none gets; ``previous_response_id``: the response
    ``body`` continues, whose items the transport has put at the start of its input (a
    WebSocket keeps its last response; HTTP keeps none)."""
    shape = ResponseShape.of(body, body.model or served, previous_response_id)
    with named_as("input", CHAT_NAMES):
        session_id = await chat.start(identity, chat_request(body), idempotency_key)
    return session_id, shape


#: Chat's names of the fields this door names otherwise (in an error's param and message).
CHAT_NAMES = {"response_format.json_schema.schema": "text.format.schema",
              "response_format.json_schema": "text.format", "response_format": "text.format",
              "max_completion_tokens": "max_output_tokens", "logprobs": "top_logprobs"}

#: Fields that mean the same in both requests, checked by the chat request's rules.
_SAMPLING = {"top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
             "logit_bias", "structured_outputs"}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that makes ``body``'s answer."""
    if body.previous_response_id is not None:
        raise errors.InvalidRequest(
            "responses are not kept here to continue from: send the conversation so far in input (a WebSocket "
            "on /v1/responses keeps its last response to continue)", param="previous_response_id")
    if body.conversation is not None:
        raise errors.InvalidRequest("conversations are not kept here: send the conversation so far in input",
                                    param="conversation")
    items = body.input
    if not items:
        raise errors.EmptyInput("input has no items", param="input")
    last = items[-1]
    # The last item is answered whoever's it is (the instructions alone, an assistant's message), as
    # chat completions answer it; a call is answered once its output follows it.
    if not isinstance(last, FunctionCallOutputItem | MessageItem):
        raise errors.ValidationFailed("the last input item is a function call: send its function_call_output "
                                      "after it", param=f"input.{len(items) - 1}")
    chat: dict[str, Any] = {
        "model": body.model, "messages": _with_instructions(body.instructions, _messages(items)), "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "metadata": body.metadata, "reasoning_effort": (body.reasoning or {}).get("effort"),
        "chat_template_kwargs": body.chat_template_kwargs,
        **({"logprobs": True, "top_logprobs": body.top_logprobs or 0} if body.logprobs_asked else {}),
        "parallel_tool_calls": False if body.max_tool_calls == 1 else body.parallel_tool_calls,
        **body.model_dump(include=_SAMPLING, exclude_none=True, by_alias=True),
    }
    if body.stream:  # response.completed carries the usage
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    elif text_format is not None:
        chat["response_format"] = {"type": text_format.type}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:  # a rule of chat's: across fields (tool_choice among the tools), or of a message
        first = exc.errors()[0]
        # The fields chat shares with responses keep their names; a message is an input item.
        param = "input" if first["loc"][:1] == ("messages",) else ".".join(param_path(first["loc"])) or None
        raise errors.ValidationFailed(renamed(str(first["msg"]).removeprefix("Value error, "), CHAT_NAMES),
                                      param=None if param is None else renamed(param, CHAT_NAMES)) from None


def _with_instructions(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``instructions`` as the system message first, joined with the input's own leading system
    (or developer) message if it has one: one system message, which every chat template takes
    (some refuse a second)."""
    if not instructions:
        return messages
    first = messages[0] if messages else None
    if first is None or first["role"] not in ("system", "developer"):
        return [{"role": "system", "content": instructions}, *messages]
    content = first["content"]
    joined = f"{instructions}\n\n{content}" if isinstance(content, str) else \
        [{"type": "text", "text": instructions}, *content]
    return [{"role": "system", "content": joined}, *messages[1:]]


def _messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call goes into the assistant message before it."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if not isinstance(item.output, str) and not all(isinstance(p, InputText) for p in item.output):
                raise errors.ValidationFailed("a function's result is text here", param=f"input.{index}.output")
            output = item.output if isinstance(item.output, str) else \
                "\n".join(part.text for part in item.output if isinstance(part, InputText))
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            messages.append({"role": item.role, "content": item.content if isinstance(item.content, str)
                             else [_part(part, f"input.{index}.content.{i}") for i, part in enumerate(item.content)]})
    return messages


def _part(part: InputText | OutputText | Refusal | InputImage, where: str) -> dict[str, Any]:
    if isinstance(part, InputText | OutputText):
        return {"type": "text", "text": part.text}
    if isinstance(part, Refusal):
        return {"type": "refusal", "refusal": part.refusal}
    if part.image_url is None:
        raise errors.ValidationFailed("an image is sent as a data: URL in image_url (no files are kept here)",
                                      param=where)
    return {"type": "image_url", "image_url": {"url": part.image_url, **({"detail": part.detail} if part.detail
                                                                          else {})}}
