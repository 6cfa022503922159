"""The engine port: what the gateway needs from an inference engine.

The gateway drives every engine through these types and never imports an
engine library itself; each adapter (``vllm``, ``omni``, ``openai-http``)
translates them at its own boundary, like vLLM's ``EngineClient`` protocol.
This module holds types only: no logic, no engine imports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol, runtime_checkable

Modality = Literal["text", "audio", "image", "video"]
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine accepts and produces; drives 422s at create/append time."""

    input_modalities: frozenset[str]
    output_modalities: frozenset[str]
    #: True when the engine prefills input before it is complete.
    incremental: bool
    model_names: tuple[str, ...]
    #: True when the engine calls functions (``tools`` / ``tool_choice``).
    tools: bool = False
    #: True when the engine can hold its answer to JSON (``response_format``) or vLLM's grammars.
    structured_outputs: bool = False
    #: True when a session may ask for no answer (no output modalities): the engine hears its
    #: audio input and tells the transcript (a Listener stage's ``InputTranscript``), then ends.
    transcription: bool = False
    #: True when a session's answer may be its input, spoken (``EngineRequest.speak_input``).
    speech: bool = False
    #: True when the voice speaks faster or slower when asked (``EngineRequest.speech_speed``);
    #: an engine whose Talker has one pace (vLLM-Omni's) refuses another speed than 1.
    speech_speed: bool = False
    #: True when a session's input may be the whole prompt, as vLLM's ``/v1/completions`` takes it
    #: (``EngineRequest.raw_prompt``).
    raw_prompt: bool = False
    #: True when the answer's tokens come with their log probabilities (``SamplingOptions.logprobs``).
    logprobs: bool = False


#: The options only a request sets, never a model's generation defaults.
_REQUEST_ONLY = frozenset({"stop", "logit_bias", "response_format", "min_tokens", "ignore_eos", "logprobs",
                           "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                           "spaces_between_special_tokens", "bad_words"})


@dataclass(frozen=True)
class SamplingOptions:
    """The OpenAI sampling fields a session was created with, and the answer's format."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    #: Token id (as a string, as OpenAI sends it) -> bias, -100 to 100.
    logit_bias: dict[str, float] | None = None
    #: OpenAI's ``response_format`` when it constrains the answer (``json_object`` or
    #: ``json_schema``, as sent), or vLLM's ``structured_outputs`` said as one (``{"type":
    #: "regex" | "choice" | "grammar", <that>: ...}``); ``None`` for free text.
    response_format: dict[str, Any] | None = None
    #: vLLM's: no end (EOS or stop) before this many tokens; the end of sequence ignored (benchmarks).
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    #: vLLM's, ``None`` for its default: the answer ends at any of these tokens (their text left
    #: out); a stop string's or stop token's text kept in the answer (``include_stop_str_in_output``);
    #: special tokens left out of the text (``skip_special_tokens``, true) and spaced apart when kept;
    #: words the answer never says (``bad_words``).
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: tuple[str, ...] | None = None
    #: Each answer token's log probability, with this many of the likeliest beside it (0: the
    #: token's own only); ``None``: none (OpenAI's ``logprobs`` / ``top_logprobs``).
    logprobs: int | None = None

    @classmethod
    def known(cls, values: dict[str, Any]) -> SamplingOptions:
        """The options among ``values`` (a model's generation defaults), the rest left out."""
        names = {f.name for f in fields(cls)} - _REQUEST_ONLY
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})

    def or_defaults(self, defaults: SamplingOptions) -> SamplingOptions:
        """These options, with the default for each one not given (a request names no
        ``temperature``: the served model's own, not 1.0)."""
        unset = {f.name: getattr(defaults, f.name) for f in fields(self)
                 if getattr(self, f.name) in (None, ()) and getattr(defaults, f.name) not in (None, ())}
        return replace(self, **unset) if unset else self


@dataclass(frozen=True)
class HeardInput:
    """What a Listener settled from a session's audio, so that a new holder (a
    resume after parking, a takeover) goes on from there instead of hearing
    all the audio again."""

    #: Each piece of recognized text as it was fed: (the sequence id of the
    #: chunk it was fed at, the text).
    pieces: tuple[tuple[int, str], ...] = ()
    #: Every audio chunk up to this sequence id is heard and in ``pieces``.
    through: int = -1


@dataclass(frozen=True)
class EngineRequest:
    """Everything an engine session needs except the streamed input itself."""

    request_id: str
    model: str
    #: Chat history placed before the streamed input (system prompt, turns).
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingOptions
    #: Empty: no answer, only the transcript of the audio input (``Capabilities.transcription``).
    output_modalities: tuple[str, ...] = ("text",)
    #: Text the assistant has already emitted (replayed after a hand-off);
    #: generation continues after it.
    assistant_prefix: str = ""
    #: Functions the model may call, in OpenAI's chat format
    #: (``{"type": "function", "function": {"name", "description", "parameters"}}``).
    tools: tuple[dict[str, Any], ...] = ()
    #: ``auto`` (the default with tools), ``none``, ``required``, or
    #: ``{"type": "function", "function": {"name": ...}}``.
    tool_choice: str | dict[str, Any] | None = None
    #: ``False``: at most one call per answer (OpenAI's ``parallel_tool_calls``).
    parallel_tool_calls: bool = True
    #: Whose words the streamed input is: the user's, a function's result
    #: (``tool``, answering ``input_tool_call_id``) fed back to the model, or a
    #: system note (the assistant speaks without the user: a greeting, a nudge).
    input_role: Literal["user", "tool", "system", "assistant"] = "user"
    input_tool_call_id: str | None = None
    #: The end of ``assistant_prefix`` that no audio has spoken yet: a Talker
    #: speaks it first, so the answer's audio is complete after a hand-off.
    unspoken_prefix: str = ""
    #: How many characters at the start of the answer were spoken already: the answer is
    #: made again from its start after a hand-off (gateway/work/said_again.py), and a Talker
    #: speaks only what comes after them.
    spoken_chars: int = 0
    #: What earlier holders heard of the audio input (a Listener goes on from it).
    heard: HeardInput = HeardInput()
    #: Text to speech: the answer is the streamed text input itself, spoken as it arrives (a
    #: Talker stage's, with no Thinker; ``Capabilities.speech``).
    speak_input: bool = False
    #: vLLM's ``chat_template_kwargs``: variables for the chat template (``{"enable_thinking":
    #: false}``); an engine passes those its template reads.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The streamed input is the whole prompt, as vLLM's ``/v1/completions`` takes it: no chat
    #: template (``messages`` and ``tools`` are empty), the tokenizer's own start (a BOS) before
    #: it, and the model's special tokens in it are its own.
    raw_prompt: bool = False
    #: vLLM's chat template flags: ``False``: no generation prompt after the input (the template's
    #: ``add_generation_prompt``); ``continue_final_message``: the input (the last message) is
    #: left open and the answer continues it (a prefilled start of the assistant's answer).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: How fast the answer's audio is spoken, as a multiple of the voice's own pace (OpenAI's
    #: ``speed``, 0.25 to 4); a Talker keeps it within what it says well
    #: (``Capabilities.speech_speed``).
    speech_speed: float = 1.0


@dataclass(frozen=True)
class InputChunk:
    """One contiguous piece of the streamed user input, already decoded."""

    sequence_id: int
    modality: Modality
    data: bytes
    #: ``pcm16`` / ``wav`` for audio, ``png`` / ``jpeg`` for images, ...
    format: str | None = None
    mime_type: str | None = None
    sample_rate: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """An answer token (its text, as the tokenizer decodes it alone) and its log probability,
    with the likeliest tokens at its place, likeliest first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    #: Empty once at most, first: the answer's first token decoded to nothing yet (a special
    #: token, text held back), and the answer began (its role frame goes out, as vLLM's does).
    #: Empty also when only ``logprobs`` are new (tokens whose text is not out yet).
    text: str
    #: The tokens this delta comes from, when the request asked for ``logprobs``.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class AudioDelta:
    #: Raw pcm16 little-endian mono samples.
    pcm16: bytes
    sample_rate: int
    transcript: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a function call in the answer (OpenAI's ``tool_calls`` delta).

    The first delta of a call has its ``id`` and ``name``; the following
    ones add to its ``arguments`` (a JSON object, as text).
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True)
class EngineError:
    message: str
    #: Stable code for the error envelope, e.g. ``engine_error``.
    code: str = "engine_error"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InputTranscript:
    """What a speech recognizer heard in the session's audio input (before the answer)."""

    text: str
    #: The pieces settled since the last event, and how far the audio is heard.
    heard: HeardInput = HeardInput()


OutputEvent = TextDelta | AudioDelta | ToolCallDelta | InputTranscript | Finished | EngineError


class EngineSession(Protocol):
    """One streamed request inside the engine.

    ``feed`` receives contiguous chunks in order; ``end_input`` says no more
    will come; ``events`` yields only the answer to the complete input (never
    the throwaway tokens of intermediate prefill steps) and ends after one
    ``Finished`` or ``EngineError``. ``abort`` is safe to call at any time,
    more than once.
    """

    async def feed(self, chunks: Sequence[InputChunk]) -> None: ...

    async def end_input(self) -> None: ...

    def events(self) -> AsyncIterator[OutputEvent]: ...

    async def abort(self) -> None: ...


class Engine(Protocol):
    """One per process, opened and closed by the app lifespan."""

    capabilities: Capabilities

    def open_session(self, request: EngineRequest) -> EngineSession: ...

    async def check_health(self) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class RequestChecks(Protocol):
    """What an engine can check before anything is stored (optional).

    The gateway calls these on the API path (``check_request`` at create,
    ``input_tokens_at_least`` per text chunk, in a worker thread), so a
    request the engine would refuse is a 4xx at once, not a failed session
    later. An engine that cannot tell (a remote sidecar) does not implement it.
    """

    @property
    def max_input_tokens(self) -> int:
        """The most prompt tokens a request may take (room left for one token)."""
        ...

    def check_request(self, request: EngineRequest) -> int:
        """Raise EngineRejectedError if the engine would refuse it; else the
        prompt tokens it takes before any streamed input (template, history)."""
        ...

    def input_tokens_at_least(self, text: str) -> int:
        """The fewest tokens ``text`` adds to a prompt, whatever comes around it."""
        ...

    def common_prefix_tokens(self, old: str, new: str) -> tuple[int, int]:
        """How many tokens at the start of the streamed input ``old`` and ``new``
        share (the work an update keeps), and how many tokens ``new`` has."""
        ...

    def settled_tokens(self, text: str) -> tuple[int, int]:
        """Of ``text`` (streamed input from a point no earlier text can change
        the tokens after), the longest prefix whose tokens no later text can
        change: its length in characters and its tokens. ``(0, 0)`` when the
        tokenizer has no such points (then nothing is ever settled early)."""
        ...


@runtime_checkable
class PromptCounter(Protocol):
    """How big a prompt is, as the engine counts it (optional): what a Realtime history is
    trimmed by, and the context ``/v1/models`` reports.

    Async, unlike ``RequestChecks``: the engine's checks count in a worker thread
    (``factory.CheckedCounter``), a ``vllm serve`` sidecar counts with its own ``/tokenize``,
    from any process of a replica. An engine that can do neither has none.
    """

    @property
    def max_input_tokens(self) -> int:
        """The most prompt tokens a request may take (room left for one token)."""
        ...

    async def prompt_tokens(self, request: EngineRequest) -> int:
        """The prompt tokens ``request`` takes before any streamed input (template, history).
        EngineRejectedError for a request the engine would refuse; EngineUnavailableError when
        the engine cannot be asked now."""
        ...

    async def aclose(self) -> None: ...


class EngineUnavailableError(Exception):
    """The engine cannot take work right now (dead, starting, unreachable)."""


class EngineDeadError(EngineUnavailableError):
    """The engine stopped for good (its core process died): only starting the
    process again brings it back. ``check_health`` raises it; the replica then
    hands its sessions to other replicas and exits (gateway/work/engine_death.py)."""


class EngineRejectedError(Exception):
    """The engine refused a request as invalid (the client's fault); ``param``: the request
    field at fault, when the engine's reason names one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
