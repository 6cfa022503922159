"""Request and response bodies of the session API."""

from __future__ import annotations

import functools
import json
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.domain.policies import MinLengthKind, StartPolicy
from gateway.domain.states import SessionState
from gateway.errors import ErrorDetail, InvalidPayload

#: The most messages (or Responses items) a request's conversation holds. Each is work on the
#: event loop before any check (validating, dumping, rendering: ~10 µs), and no model's context
#: takes a conversation of more (a message costs its template's tokens too).
MAX_MESSAGES = 10_000


def _at_most_max_messages(value: Any) -> Any:
    """Counted before the items are validated (pydantic's ``max_length`` counts after)."""
    if isinstance(value, list) and len(value) > MAX_MESSAGES:
        raise ValueError(f"a conversation here holds at most {MAX_MESSAGES:,} messages, not {len(value):,}")
    return value


#: A conversation's list, bounded (``MAX_MESSAGES``).
BoundedConversation = BeforeValidator(_at_most_max_messages)

#: What a pcm16 chunk's ``sample_rate`` may say: telephony's 8 kHz to studio audio's 192 kHz.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8_000, 192_000
#: vLLM's bounds of ``seed`` and ``top_k``: its engine sends them as 64-bit integers, so a larger
#: one failed the request at run time (a 500) instead of here.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TopK = Annotated[int, Field(ge=-1, le=2**31 - 1, description="-1 or 0: no limit")]

Modality = Literal["text", "audio", "image", "video"]


OutputModality = Literal["text", "audio"]


class StrictModel(BaseModel):
    #: Unknown fields are a client bug worth a 422, not something to drop silently.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        """An explicit ``null`` for a field that takes none is the field left out (its default),
        as OpenAI and vLLM take it: clients that send every unset option as null (``"n": null``,
        ``"stream": null``) run unchanged."""
        if isinstance(data, dict) and None in data.values():
            unset = _not_nullable(cls)
            return {key: value for key, value in data.items() if value is not None or key not in unset}
        return data

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Every text a request carries is valid Unicode: JSON's ``\\ud800`` escape parses into a
        string UTF-8 cannot hold, which the tokenizer, Redis and every reply fail on later (a 500).
        Refused here, named by its place (``web/validation.py`` makes it ``invalid_payload``)."""
        if value is None or isinstance(value, _NO_TEXT) or isinstance(value, str) and value.isascii():
            return value  # (most fields: this runs for every field of every request)
        within = lone_surrogate_at(value)
        if within is not None:
            raise PydanticCustomError(LONE_SURROGATE, "not valid Unicode (a lone surrogate)",
                                      {"within": ".".join(map(str, within))})
        return value


#: The pydantic error type of a text with a lone surrogate.
LONE_SURROGATE = "lone_surrogate"
#: Values that hold no text of their own (a model checked its own fields).
_NO_TEXT = (bool, int, float, BaseModel)


def lone_surrogate_at(value: Any) -> list[str | int] | None:
    """Where in ``value`` (a string, or JSON's lists and objects) a text holds a lone surrogate: the
    keys and indexes that lead to it (an object's key: the object's place), or ``None``. A model
    inside is left alone: it checked its own fields."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while todo:  # (a loop, not recursion: JSON nests as deep as the parser let it)
        item, place = todo.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return list(place)
        elif isinstance(item, dict):
            if not all(_encodes(key) for key in item if isinstance(key, str)):
                return list(place)
            todo.extend((inner, (*place, key)) for key, inner in reversed(item.items())
                        if inner is not None and not isinstance(inner, _NO_TEXT))
        elif isinstance(item, list | tuple):
            todo.extend((inner, (*place, i)) for i, inner in reversed(list(enumerate(item)))
                        if inner is not None and not isinstance(inner, _NO_TEXT))
    return None


def not_unicode(param: str | None) -> InvalidPayload:
    """The error of a text with a lone surrogate at ``param`` (a chunk's text gets it too)."""
    return InvalidPayload(f"{param or 'the request'} is not valid Unicode (a lone surrogate)", param=param)


def _encodes(text: str) -> bool:
    """Whether UTF-8 holds ``text`` (``isascii`` is a flag of the string: no scan for most text)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@functools.cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The names (and aliases) of ``model``'s fields whose type does not take ``None``."""
    return frozenset(name for field_name, info in model.model_fields.items()
                     if not _takes_none(info.annotation) for name in (field_name, info.alias) if name)


def _takes_none(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or annotation is Any or any(
        _takes_none(arg) for arg in typing.get_args(annotation))


class ChunkIn(StrictModel):
    """One input chunk. Give ``text`` for text, or ``payload`` (base64) for any modality."""

    sequence_id: int = Field(ge=0, strict=True)
    modality: Modality = "text"
    text: str | None = None
    payload: str | None = Field(None, description="base64 of the raw bytes")
    format: str | None = Field(None, description="audio: pcm16 | wav; image: png | jpeg; ...")
    mime_type: str | None = None
    sample_rate: int | None = Field(None, ge=MIN_SAMPLE_RATE, le=MAX_SAMPLE_RATE,
                                    description="for pcm16 audio; default 16000")
    end_of_input: bool = Field(False, strict=True)

    @model_validator(mode="after")
    def _one_body(self) -> ChunkIn:
        if (self.text is None) == (self.payload is None):
            raise ValueError("give exactly one of `text` and `payload`")
        if self.text is not None and self.modality != "text":
            raise ValueError("`text` is only for modality 'text'; send other modalities as `payload`")
        return self


class FunctionCall(StrictModel):
    name: str
    #: A JSON object, as text (as the model wrote it).
    arguments: str


class ToolCall(StrictModel):
    """A function call the assistant made (OpenAI's ``tool_calls`` item)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(StrictModel):
    type: Literal["text"]
    text: str
    #: OpenAI's hint where a cached prefix ends (LiveKit sends it): vLLM caches prefixes by
    #: itself, so it is taken and never kept (``exclude``: no digest or stored record changes).
    prompt_cache_breakpoint: dict[str, Any] | None = Field(None, exclude=True)


class RefusalPart(StrictModel):
    """An assistant's refusal, as a part of its content."""

    type: Literal["refusal"]
    refusal: str


class EarlierAudio(StrictModel):
    """An earlier spoken answer: OpenAI's request names it by its id (OpenAI keeps the audio; this
    server does not); the SDK's dump of an answer also holds its audio, expiry and transcript."""

    id: str
    transcript: str | None = None
    data: str | None = None
    expires_at: int | None = None


class ChatMessage(StrictModel):
    """A turn of the history placed before the streamed input, as chat completions take it.

    History is text (and function calls): a message's text parts are joined, and what
    an answer carries when a client sends it back as the openai SDK dumps it
    (``completion.choices[0].message.model_dump()``) is taken: all null, or a refusal or
    an audio transcript, which is what the assistant said.
    """

    #: ``developer`` is OpenAI's newer name for ``system``, kept as ``system`` (the role
    #: chat templates know), as chat completions do.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: ``None`` only for an assistant message that only calls functions (or refused).
    content: str | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    #: The assistant's function calls.
    tool_calls: list[ToolCall] | None = None
    #: A ``tool`` message: the call whose result it is.
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: EarlierAudio | None = None
    #: The legacy form of ``tool_calls``: null only.
    function_call: dict[str, Any] | None = None
    #: A reasoning model's thoughts on an earlier answer (vLLM's names, as its clients send them
    #: back): taken and left out of the history, as chat templates leave them out.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("role")
    @classmethod
    def _system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @field_validator("function_call")
    @classmethod
    def _legacy_call(cls, value: dict[str, Any] | None) -> None:
        if value is not None:
            raise ValueError("function_call is the legacy form of a call: send it in tool_calls")

    @property
    def said(self) -> Any:
        """What the message says: its content; an assistant's refusal, or its audio's transcript."""
        transcript = self.audio.transcript if self.audio is not None else None
        return next((words for words in (self.content, self.refusal, transcript) if words is not None), None)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        said = self.said
        if self.role != "assistant" and (self.refusal is not None or self.audio is not None or (
                isinstance(self.content, list) and any(isinstance(p, RefusalPart) for p in self.content))):
            raise ValueError("only assistant messages have a refusal or audio")
        if said is None and self.audio is not None and not self.tool_calls:
            raise ValueError("an earlier spoken answer is not kept here by its audio id: send its transcript "
                             "as the message's content")
        check_message_fields(self.role, said, self.tool_calls, self.tool_call_id)
        return self

    @model_serializer(mode="wrap")
    def _without_what_was_not_sent(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The SDK dump's fields only when they say something: a plain message dumps as it did
        before they were taken (a create's idempotency digest is of the dump, and replicas of
        the earlier release compute it too)."""
        data: dict[str, Any] = dump(self)
        for name in ("refusal", "annotations", "audio", "function_call", "reasoning_content", "reasoning"):
            if data.get(name, "") is None:
                del data[name]
        return data

    def as_history(self) -> dict[str, Any]:
        """The message as the engine's chat template takes it: its text, joined from its parts."""
        said = self.said
        if isinstance(said, list):
            said = "\n".join(part.text if isinstance(part, TextPart) else part.refusal for part in said)
        fields = self.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
        return {"role": self.role, **({} if said is None else {"content": said}), **fields}


def check_message_fields(role: str, content: object, tool_calls: list[ToolCall] | None,
                         tool_call_id: str | None) -> None:
    """What a message's role allows: content, function calls, the call a result answers."""
    if content is None and not (role == "assistant" and tool_calls):
        raise ValueError("content is required, except for an assistant message with tool_calls")
    if tool_calls and role != "assistant":
        raise ValueError("only assistant messages have tool_calls")
    if (role == "tool") != (tool_call_id is not None):
        raise ValueError("a tool message, and only a tool message, has a tool_call_id")


class FunctionDefinition(StrictModel):
    #: The tool's own ``type`` repeated inside its function, as LiveKit's ``raw_schema`` tools send it
    #: (vLLM takes it): taken, never kept.
    type: Literal["function"] | None = Field(None, exclude=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    #: A JSON Schema object for the arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class Tool(StrictModel):
    """A function the model may call (OpenAI's chat ``tools`` item)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    #: The JSON Schema the answer must match (``schema`` in JSON).
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``, as ``vllm serve`` takes it: the answer held to one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (or its text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, description="the answer is one of these")
    grammar: str | None = Field(None, description="an EBNF grammar (vLLM's xgrammar backend)")
    json_object: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) + bool(self.json_object) != 1:
            raise ValueError("structured_outputs holds the answer to one of json, regex, choice, grammar or "
                             "json_object")
        if isinstance(self.json_, str):
            try:
                self.json_ = json.loads(self.json_)
            except ValueError as exc:
                raise ValueError("structured_outputs.json is a JSON schema, or its text") from exc
            if not isinstance(self.json_, dict):
                raise ValueError("structured_outputs.json is a JSON schema (an object)")
        return self

    def constraint(self) -> dict[str, Any]:
        """As ``SamplingOptions.response_format`` says it: OpenAI's two kinds, or vLLM's own."""
        if self.json_ is not None:
            return {"type": "json_schema", "json_schema": {"name": "structured_outputs", "schema": self.json_}}
        if self.json_object:
            return {"type": "json_object"}
        if self.regex is not None:
            return {"type": "regex", "regex": self.regex}
        if self.choice is not None:
            return {"type": "choice", "choice": self.choice}
        return {"type": "grammar", "grammar": self.grammar}


#: The formats a whole answer's audio comes in (OpenAI's); streamed audio is pcm16 at 24 kHz.
FILE_AUDIO_FORMATS = ("mp3", "flac", "opus", "aac")


class AudioOptions(StrictModel):
    #: Accepted for OpenAI compatibility; the CPU Talker has one voice.
    voice: str | None = None
    #: Streamed audio is always pcm16 (24 kHz); a whole answer's audio is wav, bare pcm16 with
    #: "pcm16", or a file of the others (chat completions only: a session's result keeps wav).
    format: Literal["pcm16", "wav", "mp3", "flac", "opus", "aac"] | None = None


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, strict=True)
    #: Accepted (the openai SDK sends it): no obfuscation field is added (it pads events
    #: against a side channel on shared networks; this server's events go to its own client).
    include_obfuscation: bool | None = Field(None, strict=True)
    #: vLLM's usage in every chunk: not given here (the usage comes once, at the end).
    continuous_usage_stats: bool | None = Field(None, strict=True)

    @field_validator("continuous_usage_stats")
    @classmethod
    def _usage_once(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("continuous_usage_stats is not supported: the usage comes once, in the "
                             "last chunk, with include_usage")
        return value


#: vLLM's request fields this server cannot honour: the value each takes by default (taken: generated
#: clients send every field) and why another is refused (``{value}``: the one sent).
_UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported: one sampled answer per request"),
    "length_penalty": ((1.0,), "length_penalty weighs beam search's answers, and beam search is not supported: "
                               "one sampled answer per request"),
    "truncate_prompt_tokens": ((), "the prompt is not truncated here: the input streams into the engine as it "
                                   "arrives, so its start cannot be cut afterwards (a prompt past the model's "
                                   "context is refused as context_length_exceeded): shorten it yourself"),
    "return_tokens_as_token_ids": ((False,), "log probabilities name their tokens by their text here, not as "
                                             "token_id:<id>"),
    "priority": ((0,), "got priority {value}, but priority scheduling is not enabled: sessions are scheduled by "
                       "the gateway's own policy; send 0 or leave it out"),
    "chat_template": ((), "a chat template from the request is not served: the model's own renders the messages "
                          "(chat_template_kwargs sets its variables)"),
    "mm_processor_kwargs": (({},), "the engine's input processors take no options from a request"),
    **{f"guided_{kind}": ((), f"vLLM's guided_{kind} is gone (vLLM 0.10.2 on): send structured_outputs "
                              f"with {kind}") for kind in ("json", "regex", "choice", "grammar")},
}


#: vLLM's defaults of the fields a session keeps only when they differ.
_VLLM_DEFAULTS: dict[str, Any] = {"include_stop_str_in_output": False, "skip_special_tokens": True,
                                  "spaces_between_special_tokens": True, "stop_token_ids": [], "bad_words": []}


class VllmRequestOptions(StrictModel):
    """vLLM's own request fields, as ``vllm serve`` takes them on chat completions and completions.

    ``None`` is vLLM's default, and so is the default sent (``"skip_special_tokens": true``); the
    fields of ``_UNSERVED`` are taken at their defaults and refused otherwise, with why.
    """

    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="vLLM's: the answer ends at any of these token ids (their text left out)")
    include_stop_str_in_output: bool | None = Field(
        None, strict=True, description="vLLM's: the stop string (or stop token) that ended the answer stays in it")
    skip_special_tokens: bool | None = Field(
        None, strict=True, description="vLLM's: false keeps the model's special tokens in the answer's text")
    spaces_between_special_tokens: bool | None = Field(
        None, strict=True, description="vLLM's: false joins kept special tokens to the text without spaces")
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="vLLM's: words the answer never says")
    priority: int | None = Field(None, description="vLLM's: 0 only (no priority scheduling here)")
    request_id: str | None = Field(
        None, description="vLLM's: taken, not used: the answer's id is the session's (also in X-Session-Id)")
    use_beam_search: bool | None = Field(None, strict=True, description="vLLM's: false only")
    length_penalty: float | None = Field(None, description="vLLM's (beam search): 1.0 only")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's: null only")
    return_tokens_as_token_ids: bool | None = Field(None, strict=True, description="vLLM's: false only")
    #: vLLM's names before structured_outputs, refused with the name to use (vLLM drops them unread).
    guided_json: Any = Field(None, description="vLLM's old name: send structured_outputs.json")
    guided_regex: Any = Field(None, description="vLLM's old name: send structured_outputs.regex")
    guided_choice: Any = Field(None, description="vLLM's old name: send structured_outputs.choice")
    guided_grammar: Any = Field(None, description="vLLM's old name: send structured_outputs.grammar")

    @field_validator(*_UNSERVED, check_fields=False)  # (chat's own are GenerationOptions')
    @classmethod
    def _unserved(cls, value: Any, info: ValidationInfo) -> None:
        defaults, why = _UNSERVED[info.field_name or ""]
        if value is not None and value not in defaults:
            raise ValueError(why.format(value=value))
        return None

    @field_validator("request_id")
    @classmethod
    def _request_id_is_not_kept(cls, value: str | None) -> None:
        """Dropped once read: it names nothing here, and kept it would make a retry under the same
        Idempotency-Key with a new ``request_id`` (a client's per-attempt id) look like another request."""
        return None

    @field_validator("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "stop_token_ids", "bad_words")
    @classmethod
    def _default_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        return None if value == _VLLM_DEFAULTS[info.field_name or ""] else value


class GenerationOptions(VllmRequestOptions):
    """What to generate and how: the OpenAI fields shared by sessions and chat completions."""

    model: str | None = None
    modalities: list[OutputModality] = Field(
        default_factory=lambda: list[OutputModality](["text"]),
        description='output; ["text", "audio"] also speaks the answer; [] only hears the audio input (the '
        "transcript, no answer: live transcription)")
    audio: AudioOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias from -100 to 100, added to its logit")
    response_format: ResponseFormat | None = Field(
        None, description="text (the default), json_object (any JSON object) or json_schema (JSON matching "
        "json_schema.schema): the answer is held to it as the engine decodes")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: the answer held to a JSON schema, a regex, a choice or a grammar")
    min_tokens: int | None = Field(None, ge=0, description="vLLM's: the answer does not end before this many tokens")
    ignore_eos: bool | None = Field(None, strict=True, description="vLLM's: the answer runs to max_tokens "
                                                                   "(benchmarks)")
    logprobs: bool | None = Field(None, strict=True, description="each answer token's log probability, in "
                                                                 "choices[].logprobs.content")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: this many of the likeliest "
                                                                     "tokens at each place too")
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = Field(
        None, description="auto (the default with tools), none, required, or a named function")
    parallel_tool_calls: bool | None = Field(
        None, strict=True, description="false: at most one function call per answer (the default allows several)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='vLLM\'s: variables for the chat template, e.g. {"enable_thinking": false}; '
        "those the model's template does not read are left out")
    add_generation_prompt: bool | None = Field(
        None, strict=True, description="vLLM's: false renders no generation prompt after the input (the "
        "template's flag); true unless continue_final_message")
    continue_final_message: bool | None = Field(
        None, strict=True, description="vLLM's: the last message (the streamed input) is left open and the answer "
        "continues it: a prefilled start of the assistant's answer; not with add_generation_prompt true")
    chat_template: str | None = Field(None, description="vLLM's: null only (the model's own template)")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: null or {} only")

    @field_validator("continue_final_message")
    @classmethod
    def _open_or_new_turn(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the answer "
                             "either continues the last message or starts a new one")
        return value or None

    @property
    def generation_prompt(self) -> bool:
        """The template's ``add_generation_prompt``: as sent; true unless the last message is continued."""
        return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # As vLLM refuses them: the template is the model's, and the engine renders it to text.
        if set(value or ()) & {"chat_template", "tokenize"}:
            raise ValueError("chat_template_kwargs may not set chat_template or tokenize")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        tools = info.data.get("tools")
        named = {t.function.name for t in tools or ()}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in named:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if choice == "required" and not named:
            raise ValueError("tool_choice required needs tools")
        return choice

    @property
    def forces_a_call(self) -> bool:
        """``tool_choice`` required or a named function (with tools): the answer is a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def logprobs_asked(self) -> int | None:
        """``SamplingOptions.logprobs``: how many of the likeliest tokens with each, or ``None``."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("top_logprobs")
    @classmethod
    def _top_of_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):  # "²" is a digit to isdigit, not to int
                raise ValueError(f"logit_bias keys are token ids, as strings of digits; got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are from -100 to 100; got {bias} for token {token}")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_grammar(cls, value: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        response_format = info.data.get("response_format")
        if value is not None and response_format is not None and response_format.type != "text":
            raise ValueError("response_format and structured_outputs both hold the answer: send one")
        return value

    def format_constraint(self) -> dict[str, Any] | None:
        """``response_format`` (or ``structured_outputs``) as the engine takes it: ``None`` for free text.

        A forced call's schema holds the answer instead, as vLLM's server does it (its tool parser
        overrides the format): agent frameworks force a tool, then ask again for the typed answer."""
        if self.forces_a_call:
            return None
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.response_format is None or self.response_format.type == "text":
            return None
        return self.response_format.model_dump(by_alias=True, exclude_none=True)


#: A raw prompt's ``max_tokens`` unless set: OpenAI's and vLLM's completions default.
RAW_PROMPT_MAX_TOKENS = 16


#: Fields added after idempotency digests were first taken: left out of a request's digest when
#: unset, so a retry that lands on a replica of the release before (a rolling deploy) matches.
_ADDED_SINCE_DIGESTS = ("logprobs", "top_logprobs", "structured_outputs", *VllmRequestOptions.model_fields,
                        "add_generation_prompt", "continue_final_message", "chat_template", "mm_processor_kwargs",
                        "speed")


class CreateSessionRequest(GenerationOptions):
    messages: Annotated[list[ChatMessage], BoundedConversation] = Field(
        default_factory=list, description="system prompt / history placed before the streamed input")
    input_role: Literal["user", "tool", "system", "assistant"] = Field(
        "user", description="whose words the streamed input is: the user's, a function's result (tool), a "
        "system note (a turn the assistant takes without the user: a greeting, a nudge), or the assistant's "
        "own message, after which it takes a new turn (as vLLM renders a conversation that ends with it)")
    input_tool_call_id: str | None = Field(None, description="with input_role tool: the call it answers")
    start_policy: StartPolicy | None = None
    min_length: dict[MinLengthKind, int] | None = None
    first_chunk: ChunkIn | None = None
    speak_input: bool = Field(
        False, strict=True, description='text to speech: the answer is the text input itself, spoken as it '
        'streams in (each phrase once it is complete); with modalities ["text", "audio"]')
    raw_prompt: bool = Field(
        False, strict=True, description="the text input is the whole prompt, as vLLM's /v1/completions takes it: "
        "no chat template, the model's special tokens in it are its own; no messages, tools or "
        "chat_template_kwargs; max_tokens 16 unless set, as vLLM's completions")
    speed: float | None = Field(
        None, ge=0.25, le=4.0, description="how fast the audio answer is spoken, as a multiple of the voice's own "
        "pace (OpenAI's speech speed); with audio output; the voice keeps it within what it says well (README)")

    @property
    def unset_since_digests(self) -> set[str]:
        """The fields to leave out of this request's idempotency digest (``_ADDED_SINCE_DIGESTS``)."""
        return {name for name in _ADDED_SINCE_DIGESTS if getattr(self, name) is None}

    @model_validator(mode="after")
    def _tool_input(self) -> CreateSessionRequest:
        if (self.input_role == "tool") != (self.input_tool_call_id is not None):
            raise ValueError("input_role tool goes with input_tool_call_id (and only it)")
        return self

    @model_validator(mode="after")
    def _audio_as_sessions_give_it(self) -> CreateSessionRequest:
        if self.audio is not None and self.audio.format in FILE_AUDIO_FORMATS:
            raise ValueError(f"a session's audio streams as pcm16 and its result keeps wav, not {self.audio.format} "
                             "(chat completions give a whole answer's audio in it)")
        return self

    @model_validator(mode="after")
    def _said_as_is(self) -> CreateSessionRequest:
        if self.speak_input and (set(self.modalities) != {"text", "audio"} or self.tools or self.messages
                                 or self.format_constraint() is not None):
            raise ValueError('speak_input says the input as it is: modalities ["text", "audio"], and no '
                             "messages, tools or response_format")
        return self

    @model_validator(mode="after")
    def _spoken_speed(self) -> CreateSessionRequest:
        if self.speed is not None and "audio" not in self.modalities:
            raise ValueError('speed is how fast the answer is spoken: it goes with modalities ["text", "audio"]')
        return self

    @field_validator("raw_prompt")
    @classmethod
    def _raw_alone(cls, raw: bool, info: ValidationInfo) -> bool:
        given = info.data
        if raw and (given.get("messages") or given.get("tools") or given.get("chat_template_kwargs")
                    or given.get("speak_input") or given.get("input_role", "user") != "user"
                    or given.get("add_generation_prompt") is not None or given.get("continue_final_message")):
            raise ValueError("raw_prompt is the whole prompt: no messages, tools, chat_template_kwargs, chat "
                             "template flags, input_role or speak_input")
        return raw

    @model_validator(mode="after")
    def _raw(self) -> CreateSessionRequest:
        if self.raw_prompt and self.max_tokens is None and self.max_completion_tokens is None:
            self.max_tokens = RAW_PROMPT_MAX_TOKENS  # vLLM's completions default, whichever engine serves it
        return self

    @field_validator("min_length")
    @classmethod
    def _one_threshold(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        if value is not None and (len(value) != 1 or min(value.values()) < 1):
            raise ValueError("min_length takes exactly one of bytes, chunks, audio_ms, a positive integer")
        return value


class FinishRequest(StrictModel):
    final_sequence_id: int | None = Field(None, ge=0, strict=True)


class SessionView(BaseModel):
    session_id: str
    state: SessionState
    start_policy: StartPolicy
    model: str
    created_at: float
    #: A live session's idle deadline (it expires unless input comes); an ended one's end plus the
    #: result's time to live (its result and events are readable until then).
    expires_at: float
    expires_in: float
    next_sequence_id: int
    received_chunks: int
    buffered_bytes: int
    missing_sequence_ids: list[int]
    #: The replica running the session's engine work; none before it starts and once it has ended.
    owner: str | None
    #: What the speech recognizer heard in audio input, once the input is complete.
    input_transcript: str | None = None
    #: The engine request of this idle streaming session was aborted to free
    #: its KV cache; the next chunk (or finish) resumes it from its stored input.
    parked: bool = False
    #: How often it was parked and resumed, and how many chunks were replaced.
    parks: int = 0
    resumes: int = 0
    replaced_chunks: int = 0


class CreatedSession(SessionView):
    started: bool


class ChunkAccepted(BaseModel):
    session_id: str
    sequence_id: int
    state: SessionState
    duplicate: bool
    #: True when this chunk opened the engine session.
    started: bool
    next_sequence_id: int


class ChunkReplaced(BaseModel):
    session_id: str
    sequence_id: int
    state: SessionState
    #: False when the new content equals what was stored (nothing changed).
    replaced: bool
    #: Tokens at the start of the streamed input that the replacement leaves
    #: unchanged: the engine keeps their work (its prefix cache, in whole
    #: blocks) and recomputes only the rest. ``null`` when the engine cannot
    #: count tokens here (a remote sidecar) or the input is not all text.
    kept_tokens: int | None
    #: Tokens of the streamed input after the replacement (``null``: as above).
    input_tokens: int | None
    next_sequence_id: int


class FinishAccepted(BaseModel):
    session_id: str
    state: SessionState
    next_sequence_id: int
    missing_sequence_ids: list[int]


class SessionResult(BaseModel):
    session_id: str
    state: SessionState
    completion: dict[str, Any] | None = None
    error: ErrorDetail | None = None
    #: What the speech recognizer heard in audio input.
    input_transcript: str | None = None
