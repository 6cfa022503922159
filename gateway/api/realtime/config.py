"""A Realtime connection's session configuration: OpenAI's defaults, ``session.update``.

A session is of one of OpenAI's two types: ``realtime`` (a conversation, answered) or
``transcription`` (``?intent=transcription``: the audio is only heard, and each committed
stretch of it gets its transcript; voice-agent frameworks use it for streaming STT). A
transcription session takes only the input audio's settings.

A field OpenAI's GA protocol does not have is refused as its server refuses it
(``unknown_parameter``, naming it): a typo or a beta name (``turn_detection`` at the
top) would otherwise be a setting silently lost. Of the fields it has, those this
service does not implement are checked and take no effect (tracing, noise reduction,
reasoning, ``include``), a stored ``prompt`` is refused, and the ``session.updated`` reply
shows what is in effect. ``audio.output.speed`` (OpenAI's 0.25 to 1.5) is the Talker's (its own
pace, then FFmpeg's ``atempo`` beyond what it says right), and ``session.updated`` shows it; an engine whose voice has one pace (vLLM-Omni's) refuses any but 1. As in
OpenAI's protocol a response cannot set its own speed, and a change applies from the next answer. Tools are Realtime's flat
function shape here and the chat shape (``{"type", "function": {...}}``) on
the way to the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from gateway import errors
from gateway.api.languages import check_heard
from gateway.api.realtime.audio_formats import (
    BETA_NAMES,
    FORMATS,
    G711_RATE,
    PCM,
    PCM_RATE,
    format_object,
)
from gateway.service.models import NamedToolChoice, Tool, lone_surrogate_at, not_unicode

#: History room kept for the new input and for an answer with no ``max_output_tokens``.
INPUT_RESERVE_TOKENS = 512
ANSWER_RESERVE_TOKENS = 512
#: The most an answer's ``max_output_tokens`` may name (OpenAI's bound; ``"inf"`` for no limit).
MAX_OUTPUT_TOKENS = 4096
#: ``truncation: auto`` drops down to this share of the budget at once, so the
#: history's start stays put (and in the prefix cache) for many turns after.
AUTO_RETENTION_RATIO = 0.75
_TOOLS: TypeAdapter[list[Tool]] = TypeAdapter(list[Tool])
#: OpenAI's session types.
REALTIME, TRANSCRIPTION = "realtime", "transcription"
#: ``audio.output.speed``'s range in OpenAI's Realtime (its speech endpoint's goes to 4).
SPEEDS = (0.25, 1.5)
#: OpenAI's streaming recognizers that find no turn ends: a session naming one has no server VAD
#: unless it asks (the client commits each stretch, as LiveKit does for them).
UNENDPOINTED_MODELS = ("gpt-realtime-whisper", "gpt-live-transcribe")


#: The fields of OpenAI's GA session objects (the SDK's ``RealtimeSessionCreateRequestParam``,
#: ``...TranscriptionSessionCreateRequestParam``), the beta names still taken, and what
#: ``session.updated`` shows (a client may send back the object it was given).
_SHOWN = {"id", "object", "expires_at"}
REALTIME_FIELDS = frozenset({"type", "model", "audio", "include", "instructions", "max_output_tokens",
                             "output_modalities", "parallel_tool_calls", "prompt", "reasoning", "tool_choice",
                             "tools", "tracing", "truncation", "temperature", "input_audio_format",
                             "output_audio_format", *_SHOWN})
TRANSCRIPTION_FIELDS = frozenset({"type", "audio", "include", "input_audio_format", *_SHOWN})
_AUDIO_FIELDS = {"audio": frozenset({"input", "output"}),
                 "audio.input": frozenset({"format", "noise_reduction", "transcription", "turn_detection"}),
                 "audio.output": frozenset({"format", "speed", "voice"}),
                 "audio.input.transcription": frozenset({"delay", "keywords", "language", "languages", "model",
                                                         "prompt"}),
                 "audio.input.turn_detection": frozenset({"type", "threshold", "prefix_padding_ms",
                                                          "silence_duration_ms", "create_response",
                                                          "interrupt_response", "idle_timeout_ms", "eagerness"})}
#: ``response.create``'s (``RealtimeResponseCreateParamsParam``).
RESPONSE_FIELDS = frozenset({"audio", "conversation", "input", "instructions", "max_output_tokens", "metadata",
                             "output_modalities", "parallel_tool_calls", "prompt", "reasoning", "tool_choice",
                             "tools"})


def known_fields(given: dict[str, Any], known: frozenset[str], where: str) -> None:
    """As OpenAI's GA server: a field it does not have is an error naming it."""
    for name in given:
        if name not in known:
            raise errors.UnknownParameter(f"Unknown parameter: '{where}.{name}'.", param=f"{where}.{name}")


def unimplemented_fields(given: dict[str, Any], where: str) -> None:
    """The GA fields this service takes without effect, checked as OpenAI checks them; a stored
    prompt (OpenAI's dashboard's) is refused: what it says would be lost."""
    if given.get("prompt") is not None:
        raise errors.ValidationFailed("stored prompts are OpenAI's; this server has none: send the text as "
                                      "instructions", param=f"{where}.prompt")
    include = given.get("include")
    if include is not None and (not isinstance(include, list)
                                or any(x != "item.input_audio_transcription.logprobs" for x in include)):
        raise errors.ValidationFailed('include lists "item.input_audio_transcription.logprobs"',
                                      param=f"{where}.include")
    tracing = given.get("tracing")
    if tracing not in (None, "auto") and not (
            isinstance(tracing, dict) and set(tracing) <= {"group_id", "metadata", "workflow_name"}):
        raise errors.ValidationFailed('tracing is null, "auto" or {workflow_name, group_id, metadata}',
                                      param=f"{where}.tracing")
    if given.get("reasoning") is not None and not isinstance(given["reasoning"], dict):
        raise errors.ValidationFailed("reasoning is an object", param=f"{where}.reasoning")


def check_response_fields(body: dict[str, Any], output_format: str) -> None:
    """``response.create``'s fields that ``_params`` does not read: known, and its ``audio`` the
    session's (the answer's format is set with ``session.update``; any voice is taken)."""
    known_fields(body, RESPONSE_FIELDS, "response")
    unimplemented_fields(body, "response")
    audio = body.get("audio")
    if audio is None:
        return
    if not isinstance(audio, dict) or not isinstance(audio.get("output") or {}, dict):
        raise errors.ValidationFailed("audio is {output: {format, voice}}", param="response.audio")
    known_fields(audio, frozenset({"output"}), "response.audio")
    output = audio.get("output") or {}
    known_fields(output, frozenset({"format", "voice"}), "response.audio.output")
    if "voice" in output:
        voice_name(output, "response.audio.output")
    fmt = output.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != output_format):
        raise errors.ValidationFailed("a response's audio format is the session's (set it with session.update)",
                                      param="response.audio.output.format")


def voice_name(output: dict[str, Any], where: str) -> str:
    """``voice``: a name, or a custom voice's ``{"id"}`` (taken; the Talker has one voice)."""
    voice = output["voice"]
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):
        return str(voice["id"])
    if not isinstance(voice, str):
        raise errors.ValidationFailed("voice is a name or {id}", param=f"{where}.voice")
    return voice


@dataclass
class ServerVad:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    #: With no speech this long after an answer, the turn ends by itself (OpenAI's ``idle_timeout_ms``).
    idle_timeout_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}


@dataclass
class RealtimeConfig:
    model: str
    #: What the engine can produce: audio output needs a Talker.
    can_speak: bool
    instructions: str = "You are a helpful assistant."
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    max_output_tokens: int | None = None
    temperature: float | None = None
    voice: str = "alloy"
    server_vad: ServerVad | None = field(default_factory=ServerVad)
    #: Functions the model may call, in the chat shape (``{"type": "function", "function": {...}}``).
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: ``auto``, ``none``, ``required`` or the chat shape of a named function.
    tool_choice: str | dict[str, Any] = "auto"
    #: ``False``: at most one function call per answer; ``None``: not set (several allowed).
    parallel_tool_calls: bool | None = None
    #: ``auto`` / ``retention_ratio`` drop the oldest items when the history outgrows the
    #: context; ``disabled`` keeps them (and a turn that no longer fits fails).
    truncation: str = "auto"
    retention_ratio: float = AUTO_RETENTION_RATIO
    #: ``token_limits.post_instructions``: the history's budget, when the client sets one.
    history_token_limit: int | None = None
    #: ``audio.input.transcription`` as the client set it; transcription events only with it.
    transcription: dict[str, Any] | None = None
    #: The WebSocket's audio formats (``audio_formats.py``): pcm16 at 24 kHz, or G.711.
    input_audio_format: str = PCM
    output_audio_format: str = PCM
    #: ``realtime`` or ``transcription`` (see the module docstring).
    session_type: str = REALTIME
    #: Whether the engine hears without answering (a Listener stage): this replica's, never saved.
    can_transcribe: bool = False
    #: How fast answers are spoken (``audio.output.speed``), and whether the engine's voice can
    #: change its pace (``Capabilities.speech_speed``: this replica's, never saved).
    speed: float = 1.0
    can_change_speed: bool = False

    def __post_init__(self) -> None:
        if not self.can_speak:
            self.output_modalities = ["text"]

    @property
    def transcribing(self) -> bool:
        return self.session_type == TRANSCRIPTION

    def saved(self) -> dict[str, Any]:
        """What ``restored`` takes. What later releases added only when not its default: a replica
        of the release before (a rolling deploy) still restores every session that does not set it."""
        saved = asdict(self)
        del saved["can_transcribe"], saved["can_change_speed"]
        for added, default in (("input_audio_format", PCM), ("output_audio_format", PCM),
                               ("session_type", REALTIME), ("speed", 1.0)):
            if saved[added] == default:
                del saved[added]
        return saved

    @classmethod
    def restored(cls, saved: dict[str, Any], can_transcribe: bool, can_change_speed: bool = False) -> RealtimeConfig:
        """The settings as ``saved`` kept them (for a reconnect), on a replica that can or cannot
        transcribe, or change the voice's speed."""
        vad = saved.pop("server_vad", None)
        return cls(**saved, server_vad=ServerVad(**vad) if vad else None, can_transcribe=can_transcribe,
                   can_change_speed=can_change_speed)

    @property
    def session_modalities(self) -> list[str]:
        """The turn session's ``modalities``: audio output comes with its text."""
        return ["text", "audio"] if "audio" in self.output_modalities else ["text"]

    def history_budget(self, max_input_tokens: int, max_output_tokens: int | None) -> int:
        """The tokens the history may take: the client's limit, else the context less room for
        the new input and the answer."""
        if self.history_token_limit is not None:
            return self.history_token_limit
        answer = max_output_tokens or self.max_output_tokens or ANSWER_RESERVE_TOKENS
        return max(0, max_input_tokens - INPUT_RESERVE_TOKENS - answer)

    def _truncation_object(self) -> str | dict[str, Any]:
        if self.truncation != "retention_ratio":
            return self.truncation
        body: dict[str, Any] = {"type": "retention_ratio", "retention_ratio": self.retention_ratio}
        if self.history_token_limit is not None:
            body["token_limits"] = {"post_instructions": self.history_token_limit}
        return body

    def session_object(self, session_id: str) -> dict[str, Any]:
        turn_detection = self.server_vad.as_dict() if self.server_vad else None
        if self.transcribing:
            return {"type": TRANSCRIPTION, "object": "realtime.transcription_session", "id": session_id,
                    "audio": {"input": {"format": format_object(self.input_audio_format),
                                        "transcription": self.transcription or {}, "noise_reduction": None,
                                        "turn_detection": turn_detection}},
                    "include": []}
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "instructions": self.instructions, "output_modalities": self.output_modalities,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "tools": [realtime_tool(t) for t in self.tools], "tool_choice": realtime_tool_choice(self.tool_choice),
            "truncation": self._truncation_object(),
            **({} if self.parallel_tool_calls is None else {"parallel_tool_calls": self.parallel_tool_calls}),
            "audio": {
                "input": {"format": format_object(self.input_audio_format), "transcription": self.transcription,
                          "noise_reduction": None, "turn_detection": turn_detection},
                "output": {"format": format_object(self.output_audio_format), "voice": self.voice,
                           "speed": self.speed},
            },
        }

    def update(self, session: dict[str, Any]) -> None:
        """Apply a ``session.update``; 422-style errors name the field."""
        within = lone_surrogate_at(session)  # (a call's form, a client secret's: not only events)
        if within is not None:
            raise not_unicode(".".join(map(str, ["session", *within])))
        kind = session.get("type", self.session_type)
        if kind not in (REALTIME, TRANSCRIPTION):
            raise errors.ValidationFailed('type is "realtime" or "transcription"', param="session.type")
        if kind == TRANSCRIPTION and not self.can_transcribe:
            raise errors.UnsupportedModality("this engine cannot transcribe without answering (it has no "
                                             "Listener stage)", param="session.type")
        if kind != self.session_type and self.transcription == {}:
            self.transcription = None  # the transcription session's own default, not the client's choice
        self.session_type = kind
        known_fields(session, TRANSCRIPTION_FIELDS if kind == TRANSCRIPTION else REALTIME_FIELDS, "session")
        unimplemented_fields(session, "session")
        self._update_beta_formats(session)
        if kind == TRANSCRIPTION:
            audio = session.get("audio")
            if audio is not None:  # its only settings: the input audio's
                if not isinstance(audio, dict):
                    raise errors.ValidationFailed("audio is an object", param="session.audio")
                known_fields(audio, frozenset({"input"}), "session.audio")
                self._update_audio({"input": audio.get("input")})
                inputs = audio.get("input") or {}
                model = (inputs.get("transcription") or {}).get("model")
                if "turn_detection" not in inputs and isinstance(model, str) and model.startswith(UNENDPOINTED_MODELS):
                    self.server_vad = None
            if self.transcription is None:  # a transcription session always tells its transcripts
                self.transcription = {}
            return
        if "instructions" in session:
            self.instructions = _typed(session, "instructions", str, "session")
        if "output_modalities" in session:
            modalities = session["output_modalities"]
            if modalities not in (["text"], ["audio"]):
                raise errors.ValidationFailed('output_modalities is ["text"] or ["audio"]',
                                              param="session.output_modalities")
            if modalities == ["audio"] and not self.can_speak:
                raise errors.UnsupportedModality("this engine does not speak", param="session.output_modalities")
            self.output_modalities = list(modalities)
        if "max_output_tokens" in session:
            self.max_output_tokens = output_token_limit(session["max_output_tokens"], "session.max_output_tokens")
        if "tools" in session:
            self.tools = chat_tools(session["tools"], "session.tools")
        if "tool_choice" in session:
            self.tool_choice = chat_tool_choice(session["tool_choice"], "session.tool_choice")
        if self.tool_choice not in ("auto", "none") and not tool_choice_fits(self.tool_choice, self.tools):
            raise errors.ValidationFailed(choice_without_tool(self.tool_choice), param="session.tool_choice")
        if "parallel_tool_calls" in session:
            self.parallel_tool_calls = parallel_tool_calls(session["parallel_tool_calls"],
                                                           "session.parallel_tool_calls")
        if "truncation" in session:
            self._update_truncation(session["truncation"])
        if "temperature" in session:  # the beta field; GA leaves sampling to the model
            value = session["temperature"]
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 2:
                raise errors.ValidationFailed("temperature is a number from 0 to 2", param="session.temperature")
            self.temperature = float(value)
        audio = session.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise errors.ValidationFailed("audio is an object", param="session.audio")
            self._update_audio(audio)

    def _checked_speed(self, speed: Any) -> float:
        where = "session.audio.output.speed"
        low, high = SPEEDS
        if not isinstance(speed, int | float) or isinstance(speed, bool) or not low <= speed <= high:
            raise errors.ValidationFailed(f"speed is a number from {low} to {high}", param=where)
        if speed != 1 and not self.can_change_speed:
            raise errors.ValidationFailed("this engine's voice speaks at one speed (its Talker takes none): speed "
                                          "is 1 here", param=where)
        return float(speed)

    def _update_beta_formats(self, session: dict[str, Any]) -> None:
        for side in ("input", "output"):  # the beta protocol's names: "pcm16", "g711_ulaw", "g711_alaw"
            beta = f"{side}_audio_format"
            if beta in session:
                if session[beta] not in BETA_NAMES:
                    raise errors.ValidationFailed(f"{beta} is one of {', '.join(BETA_NAMES)}",
                                                  param=f"session.{beta}")
                setattr(self, beta, BETA_NAMES[session[beta]])

    def _update_truncation(self, truncation: Any) -> None:
        where = "session.truncation"
        if truncation in ("auto", "disabled"):
            self.truncation, self.retention_ratio, self.history_token_limit = truncation, AUTO_RETENTION_RATIO, None
            return
        if not isinstance(truncation, dict) or truncation.get("type") != "retention_ratio":
            raise errors.ValidationFailed('truncation is "auto", "disabled" or {type: retention_ratio, ...}',
                                          param=where)
        ratio = truncation.get("retention_ratio")
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
            raise errors.ValidationFailed("retention_ratio is a number from 0 to 1", param=f"{where}.retention_ratio")
        limit = (truncation.get("token_limits") or {}).get("post_instructions")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise errors.ValidationFailed("post_instructions is a positive integer",
                                          param=f"{where}.token_limits.post_instructions")
        self.truncation, self.retention_ratio, self.history_token_limit = "retention_ratio", float(ratio), limit

    def _update_audio(self, audio: dict[str, Any]) -> None:
        known_fields(audio, _AUDIO_FIELDS["audio"], "session.audio")
        for side in ("input", "output"):
            if not isinstance(audio.get(side) or {}, dict):
                raise errors.ValidationFailed(f"audio.{side} is an object", param=f"session.audio.{side}")
            known_fields(audio.get(side) or {}, _AUDIO_FIELDS[f"audio.{side}"], f"session.audio.{side}")
        for name in ("transcription", "turn_detection"):
            given = (audio.get("input") or {}).get(name)
            if isinstance(given, dict):
                known_fields(given, _AUDIO_FIELDS[f"audio.input.{name}"], f"session.audio.input.{name}")
        _check_noise_reduction((audio.get("input") or {}).get("noise_reduction"))
        if (audio.get("output") or {}).get("speed") is not None:
            self.speed = self._checked_speed(audio["output"]["speed"])
        for side in ("input", "output"):
            fmt = (audio.get(side) or {}).get("format")
            if fmt is None:
                continue
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            rate = fmt.get("rate", PCM_RATE if kind == PCM else G711_RATE) if isinstance(fmt, dict) else None
            if kind not in FORMATS or rate != (PCM_RATE if kind == PCM else G711_RATE):
                raise errors.ValidationFailed("audio is audio/pcm (pcm16 at 24 kHz), or audio/pcmu or audio/pcma "
                                              "(G.711 at 8 kHz)", param=f"session.audio.{side}.format")
            setattr(self, f"{side}_audio_format", kind)
        output = audio.get("output") or {}
        if "voice" in output:
            self.voice = voice_name(output, "session.audio.output")
        inputs = audio.get("input") or {}
        if "transcription" in inputs:
            transcription = inputs["transcription"]
            if transcription is not None and not isinstance(transcription, dict):
                raise errors.ValidationFailed("transcription is null or an object",
                                              param="session.audio.input.transcription")
            # The model named is not loaded: the engine's own recognizer hears the audio, in its languages.
            if transcription is not None:
                if not isinstance(transcription.get("model", ""), str):
                    raise errors.ValidationFailed("a transcription model is named by a string",
                                                  param="session.audio.input.transcription.model")
                _check_languages(transcription)
            self.transcription = transcription
        if "turn_detection" in inputs:
            detection = inputs["turn_detection"]
            if detection is None:
                self.server_vad = None
            elif isinstance(detection, dict) and detection.get("type") in ("server_vad", "semantic_vad"):
                # semantic_vad needs a model of turn ends; loudness is the nearest we have.
                if detection.get("eagerness") not in (None, "low", "medium", "high", "auto"):
                    raise errors.ValidationFailed('eagerness is "low", "medium", "high" or "auto"',
                                                  param="session.audio.input.turn_detection.eagerness")
                self.server_vad = _server_vad(detection)
            else:
                raise errors.ValidationFailed("turn_detection is null or {type: server_vad, ...}",
                                              param="session.audio.input.turn_detection")


def _check_noise_reduction(given: Any) -> None:
    """``noise_reduction``: null or ``{type: near_field | far_field}`` (taken; none is done)."""
    if given is not None and not (isinstance(given, dict) and given.get("type") in ("near_field", "far_field")
                                  and set(given) <= {"type", "strength"}):
        raise errors.ValidationFailed('noise_reduction is null or {type: "near_field" | "far_field"}',
                                      param="session.audio.input.noise_reduction")


def _check_languages(transcription: dict[str, Any]) -> None:
    """``language`` and ``languages`` (newer models take a list) name only languages the recognizer hears."""
    where = "session.audio.input.transcription"
    listed = transcription.get("languages") or []
    if not isinstance(listed, list):
        raise errors.ValidationFailed("languages is a list of ISO-639-1 codes", param=f"{where}.languages")
    for name, language in (("language", transcription.get("language")), *(("languages", x) for x in listed)):
        if language is not None and not isinstance(language, str):
            raise errors.ValidationFailed("a language is an ISO-639-1 code", param=f"{where}.{name}")
        if language:
            check_heard(language, f"{where}.{name}")


def _typed(source: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = source[name]
    if not isinstance(value, kind):
        raise errors.ValidationFailed(f"{name} must be a {kind.__name__}", param=f"{where}.{name}")
    return value


def _server_vad(detection: dict[str, Any]) -> ServerVad:
    vad = ServerVad()
    where = "session.audio.input.turn_detection"
    for name, kind in (("threshold", float), ("prefix_padding_ms", int), ("silence_duration_ms", int),
                       ("create_response", bool), ("interrupt_response", bool), ("idle_timeout_ms", int)):
        if detection.get(name) is None:
            continue
        value = detection[name]
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is bool and not isinstance(value, bool) or kind is not bool and not numeric \
                or kind is not bool and not 0 <= value <= (1 if kind is float else _MAX_MS.get(name, 10_000)):
            raise errors.ValidationFailed(f"{name} is out of range or of the wrong type", param=f"{where}.{name}")
        setattr(vad, name, kind(value))
    return vad


#: ``idle_timeout_ms`` may be long (OpenAI: up to 30 minutes); the other durations are short.
_MAX_MS = {"idle_timeout_ms": 1_800_000}


def output_token_limit(limit: Any, param: str) -> int | None:
    """``max_output_tokens``: an integer from 1 to OpenAI's 4096, or ``"inf"`` (``None``: no limit)."""
    if limit == "inf" or limit is None:
        return None
    if isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= MAX_OUTPUT_TOKENS:
        return limit
    raise errors.ValidationFailed(f'max_output_tokens is an integer from 1 to {MAX_OUTPUT_TOKENS}, or "inf"',
                                  param=param)


def chat_tools(tools: Any, param: str) -> list[dict[str, Any]]:
    """Realtime's function tools (``{"type": "function", "name", ...}``) in the chat shape."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise errors.ValidationFailed("tools is a list of function tools", param=param)
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise errors.ValidationFailed("only function tools are served here", param=f"{param}.{i}.type")
    shaped = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    try:
        return [t.model_dump(exclude_none=True) for t in _TOOLS.validate_python(shaped)]
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.errors()[0]["loc"] if p != "function")
        raise errors.ValidationFailed(f"invalid tool: {exc.errors()[0]['msg']}", param=f"{param}.{where}") from exc


def chat_tool_choice(choice: Any, param: str) -> str | dict[str, Any]:
    """Realtime's ``tool_choice`` (a mode, or ``{"type": "function", "name"}``) in the chat shape."""
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function={"name": choice["name"]}).model_dump()
    raise errors.ValidationFailed('tool_choice is "auto", "none", "required" or {type: function, name}',
                                  param=param)


def parallel_tool_calls(value: Any, param: str) -> bool | None:
    """``parallel_tool_calls``: a boolean, or null for not set."""
    if value is not None and not isinstance(value, bool):
        raise errors.ValidationFailed("parallel_tool_calls is a boolean", param=param)
    return value


def tool_choice_fits(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> bool:
    """``required`` needs tools; a named function must be one of them."""
    names = {t["function"]["name"] for t in tools}
    return bool(names) if choice == "required" else choice["function"]["name"] in names  # type: ignore[index]


def realtime_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **tool["function"]}


def realtime_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    return choice if isinstance(choice, str) else {"type": "function", "name": choice["function"]["name"]}


def choice_without_tool(choice: str | dict[str, Any]) -> str:
    """Why a ``tool_choice`` does not fit the tools (``tool_choice_fits``)."""
    if choice == "required":
        return "tool_choice required needs tools"
    return "tool_choice names a function that is not among the tools"
