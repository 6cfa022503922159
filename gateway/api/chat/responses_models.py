"""Request bodies of ``POST /v1/responses``: OpenAI's Responses API, as far as a chat engine goes.

A response here is a chat completion in another shape (``responses.py`` translates),
so the fields are those with a chat equivalent; the rest of OpenAI's (hosted tools,
stored conversations, background runs) are a 400 that says so, never
accepted and ignored. A few fields that change nothing for an answer are accepted
as chat completions accept theirs (the SDKs and agent frameworks send them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from gateway.api.chat.models import OpenAIBookkeeping
from gateway.service.models import BoundedConversation, Seed, StrictModel, StructuredOutputs, TopK


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    #: OpenAI's cache hint (the Agents SDK passes it through): vLLM caches prefixes by itself.
    prompt_cache_breakpoint: dict[str, Any] | None = Field(None, exclude=True)


class OutputText(StrictModel):
    """An earlier answer's text, as the SDK sends an output item back."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(StrictModel):
    type: Literal["input_image"]
    #: A ``data:`` URL (this server fetches nothing).
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None


ContentItem = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]


#: What an item sent back as OpenAI made it may carry, which changes nothing here.
ItemStatus = Literal["in_progress", "completed", "incomplete"] | None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentItem]
    id: str | None = None
    status: ItemStatus = None
    phase: str | None = None


class FunctionCallItem(StrictModel):
    """A call the model made, sent back before its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class InputFile(StrictModel):
    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    #: Text here (a function's image or file is a 400 that says so).
    output: str | list[Annotated[InputText | InputImage | InputFile, Field(discriminator="type")]]
    id: str | None = None
    status: ItemStatus = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class ReasoningItem(StrictModel):
    """A reasoning model's thoughts, sent back as clients copy an answer's output into the next
    input (switching providers, too): taken and left out, as a chat template leaves them out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: ItemStatus = None


def _item_type(item: Any) -> str:
    """A message item may leave out its ``type``."""
    found = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return str(found)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="unsupported_item",
                  custom_error_message="an input item is a message, a function_call, a function_call_output or "
                                       "a reasoning item "
                                       "(nothing is kept here to refer to, and no hosted tools run)")]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)
    #: Accepted as the agents SDK sends them; they concern OpenAI's hosted tool search.
    output_schema: dict[str, Any] | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, strict=True)


class TextOptions(StrictModel):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    #: Accepted: a chat model's answer is as long as it is (``max_output_tokens`` bounds it).
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictModel):
    #: Accepted: no obfuscation field is added (it pads events against a side channel on
    #: shared networks; this server's events go to its own client).
    include_obfuscation: bool | None = Field(None, strict=True)


#: What ``include`` names to have the output text's log probabilities.
LOGPROBS_INCLUDED = "message.output_text.logprobs"


class ResponsesRequest(OpenAIBookkeeping):
    model: str | None = None
    #: A string is one user message. (Read as a list, so that a bad item's error names the item.)
    input: Annotated[list[InputItem], BoundedConversation] = Field(
        description="the conversation so far: items, or a string (one user message)")
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextOptions | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    #: Nothing is kept to retrieve or continue from later: ``previous_response_id`` and
    #: ``conversation`` are 400s (``store: true`` is taken as the SDKs send it by default).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = Field(None, strict=True)
    #: ``message.output_text.logprobs`` returns them; the rest is accepted and returns nothing more
    #: (no hosted tools, no reasoning).
    include: list[str] | None = None
    #: Accepted as vLLM accepts it: a model that does not reason answers as it would without.
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    #: Accepted: the client sends the whole conversation each time (nothing is kept here to compact).
    context_management: list[dict[str, Any]] | None = None
    #: vLLM's: the chat template's variables (``{"enable_thinking": false}``), as on chat completions.
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the answer held to a choice, a regex, a grammar or a JSON schema, as on chat completions.
    structured_outputs: StructuredOutputs | None = None
    #: 1: one call at most (``parallel_tool_calls: false``); more is what an answer makes anyway.
    max_tool_calls: int | None = Field(None, ge=1)
    #: vLLM's sampling options, as its Responses API takes them (and chat completions here).
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    #: With it (or ``include: ["message.output_text.logprobs"]``) each output token's log
    #: probability, and this many of the likeliest beside it.
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def logprobs_asked(self) -> bool:
        return bool(self.top_logprobs) or LOGPROBS_INCLUDED in (self.include or ())

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_message(cls, value: object) -> object:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not run here: stream the response, or wait for it")
        return value


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's ``response`` (what this server fills of it); its ``id`` is the session's."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    #: ``message`` items (``output_text`` parts) and ``function_call`` items, in the answer's order.
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    store: bool
