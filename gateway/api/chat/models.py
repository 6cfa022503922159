"""Request and response bodies of ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from gateway.service.models import (
    ChatMessage,
    GenerationOptions,
    RefusalPart,
    StrictModel,
    TextPart,
    ToolCall,
)


class InputAudio(StrictModel):
    data: str = Field(description="base64")
    format: Literal["wav", "pcm16"]


class AudioPart(StrictModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImageUrl(StrictModel):
    url: str = Field(description="a data: URL (data:image/png;base64,...)")
    detail: str | None = None


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | AudioPart | ImagePart | RefusalPart, Field(discriminator="type")]


class ChatCompletionMessage(ChatMessage):
    """A message as chat completions take it: the last one (the input) may carry audio and images."""

    #: Wider than the history's (hence the ignore): the input may carry audio and images.
    content: str | list[ContentPart] | None = None  # type: ignore[assignment]


class ChatCompletionRequest(GenerationOptions):
    """OpenAI's chat completion request; the last message (the user's, or a
    function's result) is the input."""

    messages: list[ChatCompletionMessage] = Field(min_length=1)
    stream: bool = Field(False, strict=True)
    n: Literal[1] = 1
    #: Accepted for OpenAI compatibility (the caller's identity comes from credentials).
    user: str | None = None
    #: Accepted for OpenAI compatibility (the OpenAI playground's code sends them): nothing is
    #: kept for OpenAI's dashboard here, and there is one service tier.
    store: bool | None = Field(None, strict=True)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    #: Accepted as vLLM accepts it: the chat template may read it; a model that does not
    #: reason (the embedded default) answers as it would without.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    #: Log probabilities are not returned: ``false`` (or none) only.
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:  # true, or a count above 0
            raise ValueError("log probabilities are not returned by this server; send false (0) or leave it out")
        return value


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni-gateway"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionAudio(BaseModel):
    id: str
    data: str = Field(description="base64 wav of the whole spoken answer")
    expires_at: int
    transcript: str


class CompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    audio: CompletionAudio | None = None
    tool_calls: list[ToolCall] | None = None


class CompletionChoice(BaseModel):
    index: int
    message: CompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """OpenAI's ``chat.completion``; its ``id`` is the session's."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
