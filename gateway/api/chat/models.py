"""Request and response bodies of ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.service.models import (
    FILE_AUDIO_FORMATS,
    BoundedConversation,
    ChatMessage,
    GenerationOptions,
    RefusalPart,
    StrictModel,
    TextPart,
    ToolCall,
)


class InputAudio(StrictModel):
    data: str = Field(description="base64")
    #: OpenAI's wav and mp3 (decoded by FFmpeg); pcm16 is the sessions API's (16 kHz).
    format: Literal["wav", "mp3", "pcm16"]


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


class OpenAIBookkeeping(StrictModel):
    """Fields of OpenAI's chat completions and responses that change nothing here, taken so
    that clients setting them (SDK helpers, the playground's code, frameworks) run unchanged:
    the caller's identity comes from credentials, nothing is kept for OpenAI's dashboard, there
    is one service tier, and no prompt cache to key (vLLM's prefix cache needs none)."""

    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = Field(None, strict=True)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class ChatCompletionRequest(GenerationOptions, OpenAIBookkeeping):
    """OpenAI's chat completion request; the last message (the user's, or a
    function's result) is the input."""

    messages: Annotated[list[ChatCompletionMessage], BoundedConversation] = Field(min_length=1)
    stream: bool = Field(False, strict=True)
    #: One answer per request: a session is one answer (several are several requests).
    n: int = Field(1, strict=True)
    #: Accepted as vLLM accepts it: the chat template may read it; a model that does not
    #: reason (the embedded default) answers as it would without.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    #: Accepted: a chat model's answer is as long as it is (``max_completion_tokens`` bounds it).
    verbosity: Literal["low", "medium", "high"] | None = None
    #: Accepted: predicted output only makes OpenAI answer sooner; the answer is the same without.
    prediction: dict[str, Any] | None = None
    #: Refused with a clear error: there is no web search here (no hosted tools).
    web_search_options: dict[str, Any] | None = None
    #: vLLM's: the answer's content starts with the last message's, when that is the assistant's
    #: (with ``continue_final_message``: the whole message, the prefilled start and what continues it).
    echo: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _streamed_audio_is_pcm16(self) -> ChatCompletionRequest:
        if self.stream and self.audio is not None and self.audio.format in FILE_AUDIO_FORMATS:
            raise ValueError(f"streamed audio comes as pcm16 deltas, not {self.audio.format}: ask for pcm16, or for "
                             f"{self.audio.format} without stream")
        return self

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("web search is not available on this server (it has no hosted tools); leave it out")
        return value

    @field_validator("n")
    @classmethod
    def _one_answer(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"one answer per request here, not {value}: send each as its own request (the same "
                             "input is prefilled once, from the engine's prefix cache)")
        return value


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni-gateway"
    #: vLLM's: the model the name serves (the engine's own name), none above it, and its context
    #: length (prompt and answer together), which clients read to budget their requests.
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


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
