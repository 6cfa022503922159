"""Request and response bodies of ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.service.models import GenerationOptions, StrictModel, ToolCall, check_message_fields


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


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


class RefusalPart(StrictModel):
    """An assistant's refusal, as a part of its content."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | AudioPart | ImagePart | RefusalPart, Field(discriminator="type")]


class EarlierAudio(StrictModel):
    """An earlier spoken answer: OpenAI's request names it by its id (OpenAI keeps the audio; this
    server does not); the SDK's dump of an answer also holds its audio, expiry and transcript."""

    id: str
    transcript: str | None = None
    data: str | None = None
    expires_at: int | None = None


class ChatCompletionMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: ``None`` only for an assistant message that only calls functions (or refused).
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    #: A ``tool`` message: the call whose result it is.
    tool_call_id: str | None = None
    # What an answer carries when a client sends it back as history, as the openai SDK
    # dumps it (``completion.choices[0].message.model_dump()``): all null, or a refusal,
    # which is what the assistant said. ``function_call`` is the legacy form of tool_calls.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: EarlierAudio | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("function_call")
    @classmethod
    def _legacy_call(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError("function_call is the legacy form of a call: send it in tool_calls")

    @property
    def said(self) -> str | list[ContentPart] | None:
        """What the message says: its content; an assistant's refusal, or its audio's transcript."""
        transcript = self.audio.transcript if self.audio is not None else None
        return next((words for words in (self.content, self.refusal, transcript) if words is not None), None)

    @model_validator(mode="after")
    def _roles(self) -> ChatCompletionMessage:
        said = self.said
        if self.role != "assistant" and (self.refusal is not None or self.audio is not None or (
                isinstance(self.content, list) and any(isinstance(p, RefusalPart) for p in self.content))):
            raise ValueError("only assistant messages have a refusal or audio")
        if said is None and self.audio is not None and not self.tool_calls:
            raise ValueError("an earlier spoken answer is not kept here by its audio id: send its transcript "
                             "as the message's content")
        check_message_fields(self.role, said, self.tool_calls, self.tool_call_id)
        return self


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
