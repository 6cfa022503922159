"""The session's meta hash in Redis: every field, its type, and who writes it.

``NewSession`` is what ``create`` writes, whole; the Lua scripts then change
single fields (each named below with the script that writes it) and read them
by these same names. ``SessionRecord`` is the hash read back, typed: the only
way the rest of the gateway reads a session.

    field                written by                 read as
    state                create, every transition   SessionRecord.state
    policy, model,       create                     .policy, .model, .identity,
    identity, request                               .request
    created_at           create (this replica's clock, ms)       .created_at_ms
    expires_at           every input call (Redis clock, ms)      .expires_at_ms
    updated_at           every input call and transition
    next_seq, max_seq,   append: the contiguous prefix, the      .next_seq, .received,
    received, bytes      highest id, chunk count, payload bytes  .bytes
    contig_*             append: contiguous input, for the start policy
    start_*              create: the start policy's thresholds
    max_ooo, max_bytes,  create: per-session caps
    max_chunks
    max_input_tokens,    create (when the engine can count), append
    input_tokens
    final_seq            append with end_of_input, finish        .final_seq
    input_done_at        the call that completed the input (ms)  .input_done_at_ms
    started_at           the call that started the engine work (ms)
    owner, lease_until,  the lease: claims (append, finish,      .owner, .lease_until_ms,
    lease_epoch          tend), renew, release; cleared on end   .lease_epoch
    lease_ttl_ms, timeout_ms, result_ttl_ms, generation_ttl_ms: create
    parked               park (1), resumed by the next input (0)  .parked
    parks, resumes       park; append/finish/replace on resume    .parks, .resumes
    computed_tokens      park (input taken in), replace (kept)    the tender's mcps rank
    replaced             replace: chunks replaced so far; the     .replaced
                         value of the input's restart marks
    out_frames           publish: frames written so far
    input_transcript     publish: what the listener heard        .input_transcript
    result               publish, on completion                  .result
    error                fail, cancel, tend, append (too large)  .error

The session's other keys (``keys.SessionKeys``): its chunks, their digests
(with update mode's token marks), its input and output streams.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from gateway import errors
from gateway.domain.policies import StartPolicy, StartThresholds
from gateway.domain.states import SessionState
from omni_adapter.port import EngineRequest, SamplingOptions

#: vLLM's sampling fields a release before ignores (it reads past unknown sampling fields): a
#: session using one needs it (``KNOWN_NEEDS``).
_NEEDED_SAMPLING = ("stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                    "spaces_between_special_tokens", "bad_words")
#: Sampling fields newer than the stored form's first release (see ``StoredRequest.to_json``).
_ADDED_SAMPLING = ("min_p", "logit_bias", "response_format", "min_tokens", "ignore_eos", *_NEEDED_SAMPLING)
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingOptions))
#: Sampling fields stored as JSON lists, read back as tuples.
_LISTS = frozenset({"stop", "stop_token_ids", "bad_words"})


#: What a session may need that a release without it would silently ignore (answering the
#: wrong question: a chat template around a raw prompt, the model asked for a transcription).
#: A stored request lists those it needs; a release refuses to run one that needs what it does
#: not know, so a rolling deploy (or a rollback) fails such a session loudly, never answers
#: it wrongly. A later release that adds such a feature adds its name here.
KNOWN_NEEDS = frozenset({"hearing", "speak_input", "chat_template_kwargs", "raw_prompt", "logprobs",
                         "structured_outputs", *_NEEDED_SAMPLING, "add_generation_prompt",
                         "continue_final_message", "speech_speed"})
#: The grammars of vLLM's ``structured_outputs`` beyond OpenAI's JSON (``response_format``'s kinds).
VLLM_GRAMMARS = frozenset({"regex", "choice", "grammar"})


@dataclass(frozen=True)
class StoredRequest:
    """What the client asked for at create, kept for whoever runs the engine work."""

    messages: tuple[dict[str, Any], ...]
    modalities: tuple[str, ...]
    sampling: SamplingOptions
    include_usage: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    input_role: Literal["user", "tool", "system", "assistant"] = "user"
    input_tool_call_id: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    speak_input: bool = False
    raw_prompt: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: How fast the audio answer is spoken (``EngineRequest.speech_speed``).
    speech_speed: float = 1.0
    #: The ``needs`` it was stored with (a newer release's may hold names this one does not know).
    stored_needs: tuple[str, ...] = field(default=(), compare=False)

    @property
    def needs(self) -> tuple[str, ...]:
        """The features of ``KNOWN_NEEDS`` this request uses."""
        used = {"hearing": not self.modalities, "speak_input": self.speak_input,
                "chat_template_kwargs": bool(self.chat_template_kwargs), "raw_prompt": self.raw_prompt,
                "logprobs": self.sampling.logprobs is not None,
                "structured_outputs": (self.sampling.response_format or {}).get("type") in VLLM_GRAMMARS,
                **{name: getattr(self.sampling, name) is not None for name in _NEEDED_SAMPLING},
                "add_generation_prompt": not self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "speech_speed": self.speech_speed != 1.0}
        return tuple(name for name, on in used.items() if on)

    def to_json(self) -> str:
        sampling = {**asdict(self.sampling), "stop": list(self.sampling.stop)}
        # Beside the sampling fields, not among them: a release before read each key of those.
        logprobs = sampling.pop("logprobs")
        # Fields added since, only when set: a replica of the release before (a rolling
        # deploy) still reads every session that does not use them.
        for added in _ADDED_SAMPLING:
            if sampling[added] is None:
                del sampling[added]
        stored = {"messages": list(self.messages), "modalities": list(self.modalities),
                  "sampling": sampling, "include_usage": self.include_usage,
                  "metadata": self.metadata, "tools": list(self.tools), "tool_choice": self.tool_choice,
                  "parallel_tool_calls": self.parallel_tool_calls, "input_role": self.input_role,
                  "input_tool_call_id": self.input_tool_call_id}
        if self.chat_template_kwargs:  # (fields added since, as above)
            stored["chat_template_kwargs"] = self.chat_template_kwargs
        if self.speak_input:
            stored["speak_input"] = True
        if self.raw_prompt:
            stored["raw_prompt"] = True
        if not self.add_generation_prompt:
            stored["add_generation_prompt"] = False
        if self.continue_final_message:
            stored["continue_final_message"] = True
        if logprobs is not None:
            stored["logprobs"] = logprobs
        if self.speech_speed != 1.0:
            stored["speech_speed"] = self.speech_speed
        if self.needs:
            stored["needs"] = list(self.needs)
        return json.dumps(stored)

    @classmethod
    def from_json(cls, text: str) -> StoredRequest:
        stored = json.loads(text)
        # A newer release's sampling fields are left out: its ``needs`` say whether this one may run it.
        sampling = {k: tuple(v) if k in _LISTS else v for k, v in stored["sampling"].items() if k in _SAMPLING_FIELDS}
        return cls(messages=tuple(stored["messages"]), modalities=tuple(stored["modalities"]),
                   sampling=SamplingOptions(**{**sampling, "logprobs": stored.get("logprobs")}),
                   include_usage=stored.get("include_usage", False), metadata=stored.get("metadata") or {},
                   tools=tuple(stored.get("tools") or ()), tool_choice=stored.get("tool_choice"),
                   parallel_tool_calls=stored.get("parallel_tool_calls", True),
                   input_role=stored.get("input_role", "user"), input_tool_call_id=stored.get("input_tool_call_id"),
                   chat_template_kwargs=stored.get("chat_template_kwargs") or {},
                   speak_input=stored.get("speak_input", False), raw_prompt=stored.get("raw_prompt", False),
                   add_generation_prompt=stored.get("add_generation_prompt", True),
                   continue_final_message=stored.get("continue_final_message", False),
                   speech_speed=stored.get("speech_speed", 1.0),
                   stored_needs=tuple(stored.get("needs") or ()))

    def engine_request(self, request_id: str, model: str, assistant_prefix: str = "") -> EngineRequest:
        unknown = sorted(set(self.stored_needs) - KNOWN_NEEDS)
        if unknown:  # made by a newer release (a rolling deploy, a rollback): run, it would be answered wrongly
            raise errors.EngineUnavailable(f"this replica runs an older release, which cannot serve a session "
                                           f"that needs {', '.join(unknown)}; ask again (a newer replica serves it)")
        return EngineRequest(request_id=request_id, model=model, messages=self.messages,
                             sampling=self.sampling, output_modalities=self.modalities,
                             assistant_prefix=assistant_prefix, tools=self.tools, tool_choice=self.tool_choice,
                             parallel_tool_calls=self.parallel_tool_calls, input_role=self.input_role,
                             input_tool_call_id=self.input_tool_call_id,
                             chat_template_kwargs=self.chat_template_kwargs, speak_input=self.speak_input,
                             raw_prompt=self.raw_prompt, add_generation_prompt=self.add_generation_prompt,
                             continue_final_message=self.continue_final_message, speech_speed=self.speech_speed)


@dataclass(frozen=True)
class NewSession:
    """The meta hash as ``create`` writes it."""

    policy: StartPolicy
    model: str
    identity: str
    request: StoredRequest
    created_at_ms: int
    #: ``None`` for ``on_end_only``: the engine work waits for the whole input.
    start: StartThresholds | None
    max_out_of_order: int
    max_bytes: int
    max_chunks: int
    timeout_ms: int
    result_ttl_ms: int
    generation_ttl_ms: int
    lease_ttl_ms: int
    #: The model's room for input, and what the messages take of it (0: the engine cannot count).
    max_input_tokens: int = 0
    input_tokens: int = 0

    def to_hash(self) -> dict[str, str | int]:
        start = self.start or StartThresholds()
        return {
            "state": SessionState.OPEN.value, "policy": self.policy.value, "model": self.model,
            "identity": self.identity, "request": self.request.to_json(), "created_at": self.created_at_ms,
            "next_seq": 0, "max_seq": -1, "received": 0, "bytes": 0,
            "contig_chunks": 0, "contig_bytes": 0, "contig_audio_ms": 0,
            "start_early": 0 if self.start is None else 1, "start_chunks": start.chunks,
            "start_bytes": start.bytes, "start_audio_ms": start.audio_ms,
            "max_ooo": self.max_out_of_order, "max_bytes": self.max_bytes, "max_chunks": self.max_chunks,
            "timeout_ms": self.timeout_ms, "result_ttl_ms": self.result_ttl_ms,
            "generation_ttl_ms": self.generation_ttl_ms,
            "owner": "", "lease_until": 0, "lease_epoch": 0, "lease_ttl_ms": self.lease_ttl_ms,
            **({"max_input_tokens": self.max_input_tokens, "input_tokens": self.input_tokens}
               if self.max_input_tokens else {}),
        }


#: The fields ``SessionRecord`` reads, but the result (``SessionStore.view`` reads
#: it only when asked: a voice answer's WAV makes it megabytes).
RECORD_FIELDS = ("state", "policy", "model", "identity", "request", "created_at", "expires_at", "next_seq",
                 "received", "bytes", "final_seq", "input_done_at", "owner", "lease_until", "lease_epoch",
                 "result_ttl_ms", "input_transcript", "error", "parked", "parks", "resumes", "replaced",
                 "updated_at")


@dataclass(frozen=True)
class SessionRecord:
    """The meta hash of a session, read back and typed."""

    session_id: str
    state: SessionState
    policy: StartPolicy
    model: str
    identity: str
    request: StoredRequest
    created_at_ms: int
    expires_at_ms: int
    next_seq: int
    received: int
    bytes: int
    final_seq: int | None
    input_done_at_ms: int | None
    #: The replica running the engine work; ``None`` before it starts and once the session ended.
    owner: str | None
    lease_until_ms: int
    lease_epoch: int
    result_ttl_ms: int
    input_transcript: str | None
    #: The ``chat.completion`` once completed (when the view asked for it).
    result: dict[str, Any] | None
    #: The error envelope once failed, cancelled or expired.
    error: dict[str, Any] | None
    missing_sequence_ids: list[int]
    #: Idle streaming work whose engine request was aborted; its next input resumes it.
    parked: bool = False
    parks: int = 0
    resumes: int = 0
    #: Chunks replaced (update mode) so far.
    replaced: int = 0
    #: The last input call or transition (an ended session's: its end).
    updated_at_ms: int = 0

    @property
    def expires_at_or_gone_ms(self) -> int:
        """When a live session expires unless input comes (its idle deadline); when an ended one
        is gone (its end plus ``result_ttl``: its result and events stay readable until then)."""
        return self.updated_at_ms + self.result_ttl_ms if self.state.is_terminal else self.expires_at_ms

    @classmethod
    def from_hash(cls, session_id: str, fields: dict[str, str], missing: list[int]) -> SessionRecord:
        def number(name: str) -> int:
            value = fields.get(name)
            return int(value) if value else 0

        def optional_number(name: str) -> int | None:
            value = fields.get(name)
            return int(value) if value else None

        def document(name: str) -> Any:
            value = fields.get(name)
            return json.loads(value) if value else None

        transcript = document("input_transcript")
        return cls(
            session_id=session_id, state=SessionState(fields["state"]), policy=StartPolicy(fields["policy"]),
            model=fields["model"], identity=fields.get("identity", ""),
            request=StoredRequest.from_json(fields["request"]), created_at_ms=number("created_at"),
            expires_at_ms=number("expires_at"), next_seq=number("next_seq"), received=number("received"),
            bytes=number("bytes"), final_seq=optional_number("final_seq"),
            input_done_at_ms=optional_number("input_done_at") or None,
            owner=fields.get("owner") or None, lease_until_ms=number("lease_until"),
            lease_epoch=number("lease_epoch"), result_ttl_ms=number("result_ttl_ms"),
            input_transcript=transcript["input_transcript"] if transcript else None,
            result=document("result"), error=document("error"), missing_sequence_ids=missing,
            parked=fields.get("parked") == "1", parks=number("parks"), resumes=number("resumes"),
            replaced=number("replaced"), updated_at_ms=number("updated_at"),
        )
