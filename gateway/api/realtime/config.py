"""A Realtime connection's session configuration: OpenAI's defaults, ``session.update``.

Only what this service can honour is taken from ``session.update``; fields
it does not implement (tools, tracing, noise reduction...) are ignored, as
OpenAI's own server ignores what a model does not use, and the
``session.updated`` reply shows what is in effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway import errors


@dataclass
class ServerVad:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response}


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

    def __post_init__(self) -> None:
        if not self.can_speak:
            self.output_modalities = ["text"]

    @classmethod
    def restored(cls, saved: dict[str, Any]) -> RealtimeConfig:
        """The settings as ``dataclasses.asdict`` saved them (for a reconnect)."""
        vad = saved.pop("server_vad", None)
        return cls(**saved, server_vad=ServerVad(**vad) if vad else None)

    @property
    def session_modalities(self) -> list[str]:
        """The turn session's ``modalities``: audio output comes with its text."""
        return ["text", "audio"] if "audio" in self.output_modalities else ["text"]

    def session_object(self, session_id: str) -> dict[str, Any]:
        pcm = {"type": "audio/pcm", "rate": 24_000}
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "instructions": self.instructions, "output_modalities": self.output_modalities,
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "audio": {
                "input": {"format": pcm, "transcription": None,
                          "turn_detection": self.server_vad.as_dict() if self.server_vad else None},
                "output": {"format": pcm, "voice": self.voice},
            },
        }

    def update(self, session: dict[str, Any]) -> None:
        """Apply a ``session.update``; 422-style errors name the field."""
        if session.get("type", "realtime") != "realtime":
            raise errors.ValidationFailed("only realtime sessions are served here", param="session.type")
        if "instructions" in session:
            self.instructions = _typed(session, "instructions", str)
        if "output_modalities" in session:
            modalities = session["output_modalities"]
            if modalities not in (["text"], ["audio"]):
                raise errors.ValidationFailed('output_modalities is ["text"] or ["audio"]',
                                              param="session.output_modalities")
            if modalities == ["audio"] and not self.can_speak:
                raise errors.UnsupportedModality("this engine does not speak", param="session.output_modalities")
            self.output_modalities = list(modalities)
        if "max_output_tokens" in session:
            limit = session["max_output_tokens"]
            if limit == "inf" or limit is None:
                self.max_output_tokens = None
            elif isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
                self.max_output_tokens = limit
            else:
                raise errors.ValidationFailed("max_output_tokens is a positive integer or \"inf\"",
                                              param="session.max_output_tokens")
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

    def _update_audio(self, audio: dict[str, Any]) -> None:
        for side in ("input", "output"):
            fmt = (audio.get(side) or {}).get("format")
            if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm"
                                    or fmt.get("rate", 24_000) != 24_000):
                raise errors.ValidationFailed("audio is pcm16 at 24 kHz (audio/pcm, rate 24000)",
                                              param=f"session.audio.{side}.format")
        output = audio.get("output") or {}
        if "voice" in output:
            self.voice = _typed(output, "voice", str)
        inputs = audio.get("input") or {}
        if "turn_detection" in inputs:
            detection = inputs["turn_detection"]
            if detection is None:
                self.server_vad = None
            elif isinstance(detection, dict) and detection.get("type") in ("server_vad", "semantic_vad"):
                # semantic_vad needs a model of turn ends; loudness is the nearest we have.
                self.server_vad = _server_vad(detection)
            else:
                raise errors.ValidationFailed("turn_detection is null or {type: server_vad, ...}",
                                              param="session.audio.input.turn_detection")


def _typed(source: dict[str, Any], name: str, kind: type) -> Any:
    value = source[name]
    if not isinstance(value, kind):
        raise errors.ValidationFailed(f"{name} must be a {kind.__name__}", param=name)
    return value


def _server_vad(detection: dict[str, Any]) -> ServerVad:
    vad = ServerVad()
    where = "session.audio.input.turn_detection"
    for name, kind in (("threshold", float), ("prefix_padding_ms", int), ("silence_duration_ms", int),
                       ("create_response", bool), ("interrupt_response", bool)):
        if name not in detection:
            continue
        value = detection[name]
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is bool and not isinstance(value, bool) or kind is not bool and not numeric \
                or kind is not bool and not 0 <= value <= (1 if kind is float else 10_000):
            raise errors.ValidationFailed(f"{name} is out of range or of the wrong type", param=f"{where}.{name}")
        setattr(vad, name, kind(value))
    return vad
