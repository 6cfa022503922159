"""Service settings, read from ``OMNI_GATEWAY_*`` environment variables.

The names mirror the RFC's suggested configuration (section 7.5:
``enabled``, ``session_timeout_sec``, ``max_payload_per_session``,
``start_policy``) plus limits, the Redis URL and the engine choice. With no
variables at all the service runs the embedded default: the in-process vLLM
engine with SmolLM2-135M on the CPU and an in-process store.
"""

from __future__ import annotations

import json
import math
import os
import socket
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.domain.policies import StartPolicy
from gateway.domain.scheduling import SchedulePolicy

MiB = 1024 * 1024
#: Room for the fields around a base64 payload in a JSON chunk or create body.
JSON_OVERHEAD_BYTES = 64 * 1024


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class IceServer(BaseModel):
    """A STUN or TURN server for WebRTC calls' ICE, as a browser's ``RTCIceServer`` names it.

    A TURN server relays media for peers that cannot reach each other and so
    allots a ``username`` and ``credential``; STUN needs neither. aiortc uses the
    first STUN and the first TURN server it is given (``turn:`` over udp or tcp,
    ``turns:`` over tcp).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(min_length=1)
    username: str | None = None
    credential: str | None = None

    @field_validator("urls", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _usable(self) -> IceServer:
        for url in self.urls:
            scheme = url.partition(":")[0]
            if scheme not in ("stun", "turn", "turns"):
                raise ValueError(f"{url!r}: an ICE server URL starts with stun:, turn: or turns:")
            if scheme != "stun" and not (self.username and self.credential):
                raise ValueError(f"{url!r}: a TURN server needs a username and a credential")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMNI_GATEWAY_", extra="ignore")

    # RFC 7.5
    enabled: bool = True
    session_timeout_sec: float = Field(300.0, gt=0)
    max_payload_per_session: int = Field(64 * MiB, gt=0)
    start_policy: StartPolicy = StartPolicy.ON_FIRST_CHUNK
    #: Used by ``on_min_length`` when a session gives no ``min_length``.
    min_length_bytes: int = Field(256, ge=1)

    # Limits
    max_chunk_bytes: int = Field(16 * MiB, gt=0)
    max_out_of_order: int = Field(64, ge=1)
    max_chunks_per_session: int = Field(100_000, ge=1)
    result_ttl_sec: float = Field(3600.0, gt=0)

    # Identity and limits (see gateway/web/identity.py, gateway/store/limits.lua)
    #: Comma-separated API keys; an entry ``sha256:<hex>`` is a stored digest.
    api_keys: str | None = None
    #: A header set by the API gateway in front (e.g. ``X-Consumer-ID``); trusted
    #: as the caller's identity only when set here.
    identity_header: str | None = None
    #: Open mode: comma-separated addresses or CIDRs of proxies (the API
    #: gateway) whose ``X-Forwarded-For`` names the client the limits apply to.
    trusted_proxies: str | None = None
    #: Open sessions one identity may hold at once (0: no limit).
    max_sessions_per_identity: int = Field(100, ge=0)
    #: Requests per second per identity, token bucket (0: no limit).
    rate_limit_rps: float = Field(100.0, ge=0)
    #: Requests one identity may send at once; unset: two seconds' worth of the
    #: rate, so lowering the rate lowers the burst too.
    rate_limit_burst: int | None = Field(None, ge=1)
    #: A Realtime connection's own budget of events a second (0: none): audio frames of
    #: 20 ms are 50 a second; the identity's rate above is charged per connection and turn.
    realtime_events_per_sec: float = Field(100.0, ge=0)
    #: The most audio one ``input_audio_buffer.append`` may carry (clients send 20-100 ms).
    realtime_max_append_ms: int = Field(5_000, ge=20)
    #: The largest Realtime event (an item with a whole utterance's audio is the largest):
    #: 2 MiB holds ~30 s of 24 kHz audio; a bigger one is refused with an ``error`` event.
    #: uvicorn reads up to ``ws_max_size`` (twice this) and closes the socket (1009) past
    #: it; its own default was 16 MiB, whose reading alone held the event loop ~0.1 s.
    realtime_max_event_bytes: int = Field(2 * MiB, ge=64 * 1024)
    #: WebRTC calls (``/v1/realtime/calls``): STUN/TURN servers a call's ICE may use, as a
    #: JSON list of RTCIceServer objects (``[{"urls": "turn:host:3478", "username": "u",
    #: "credential": "p"}]``; TURN needs both) or comma-separated STUN URLs
    #: (``stun:host:3478``); empty: host candidates only (the media reaches the replica directly).
    webrtc_ice_servers: Annotated[list[IceServer], NoDecode] = Field(default_factory=list)

    @field_validator("webrtc_ice_servers", mode="before")
    @classmethod
    def _ice_servers_from_text(cls, value: object) -> object:
        """The variable's text: a JSON list (it starts with ``[``), else comma-separated URLs."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            try:
                return json.loads(value)
            except ValueError as exc:  # pydantic reports it with the setting's name
                raise ValueError(f"not a JSON list of RTCIceServer objects: {exc}") from exc
        return [{"urls": url.strip()} for url in value.split(",") if url.strip()]

    #: Calls one process holds at once (each decodes and encodes Opus on this CPU);
    #: past it a new call is 503 ``capacity_exhausted``.
    webrtc_max_calls: int = Field(16, ge=0)
    #: Open sessions across all identities and replicas (0: no limit).
    max_open_sessions: int = Field(10_000, ge=0)

    # Load shedding, per process (gateway/web/middleware/admission.py): past either bound new
    # calls get 503 ``overloaded`` + Retry-After before any work.
    #: Session API calls one process works on at once (0: no cap); at about
    #: 0.5 ms of CPU each, 64 queued calls are ~30 ms of waiting.
    max_in_flight_requests: int = Field(64, ge=0)
    #: Refuse new calls while the event loop runs this late (0: never).
    max_loop_lag_sec: float = Field(0.25, ge=0)

    #: A non-streaming chat completion whose answer no replica took up for this
    #: long (every engine slot busy) is dropped: 503 ``capacity_exhausted``.
    chat_queue_timeout_sec: float = Field(60.0, gt=0)

    #: Stop waiting for a request body that stalls this long (slow clients).
    body_idle_timeout_sec: float = Field(30.0, gt=0)
    #: Every request body may take this long to arrive, counted from its
    #: headers; a longer one must keep up ``body_min_bytes_per_sec`` on top
    #: (a 21 MiB chunk at that rate: about 11 minutes). A body that trickles
    #: slower gets 408: it would hold a socket for ever. A Mode A upload is
    #: a session's whole input and has no deadline.
    body_timeout_sec: float = Field(10.0, gt=0)
    body_min_bytes_per_sec: int = Field(32 * 1024, ge=1)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    #: Origins whose browser pages may call the API (CORS), comma-separated, ``*`` for any,
    #: as vLLM's ``--allowed-origins``; empty (vLLM's default too): cross-origin calls from a
    #: browser are refused by the browser. WebSockets are not subject to CORS.
    allowed_origins: Annotated[tuple[str, ...], NoDecode] = ()

    @property
    def realtime_max_append_chars(self) -> int:
        """``realtime_max_append_ms`` of 24 kHz pcm16 as base64 characters."""
        return -(-self.realtime_max_append_ms * 48 * 4 // 3)

    @property
    def ws_max_size(self) -> int:
        """uvicorn's WebSocket message cap: above the event cap, so an oversized event is
        refused with an ``error`` event (the socket stays) rather than closed with 1009."""
        return 2 * self.realtime_max_event_bytes

    @property
    def token_burst(self) -> int:
        """The token bucket's size: ``rate_limit_burst``, else two seconds' worth of the rate."""
        return self.rate_limit_burst or max(1, math.ceil(2 * self.rate_limit_rps))

    @property
    def listening_cap(self) -> int:
        """Engine sessions that may still be listening: the setting, else 3/4 of the engine sessions."""
        cap = self.max_listening_sessions or max(1, self.max_engine_sessions * 3 // 4)
        return min(cap, self.max_engine_sessions)

    @property
    def max_request_bytes(self) -> int:
        """The largest request body: a JSON chunk is base64 (4/3) plus its fields."""
        return -(-self.max_chunk_bytes * 4 // 3) + JSON_OVERHEAD_BYTES

    # Store
    #: Real Redis when set (required for more than one replica);
    #: an in-process fakeredis otherwise.
    redis_url: str | None = None
    redis_timeout_sec: float = Field(2.0, gt=0)
    #: Redis Cluster (keys of one session share a hash tag) instead of one server.
    redis_cluster: bool = False
    #: What a 2xx on input (create, append, finish, replace, cancel) survives
    #: (gateway/store/durability.py; bench/README.md, the durability table):
    #: ``everysec``: Redis's AOF, fsynced every second: a crash of Redis can
    #: take up to ~2 s of acknowledged input; ``always``: every write fsynced
    #: before Redis answers (slower appends); ``replica``: a replica holds it
    #: too before the 2xx (``WAIT 1``), with Sentinel promoting the replica
    #: when the primary dies. The first two are Redis's own settings, which
    #: the deployment sets (chart, deploy/local/cluster.sh) and the gateway
    #: checks at start; the third is the gateway's doing.
    redis_durability: Literal["everysec", "always", "replica"] = "everysec"
    #: ``replica``: how long a write waits for the replica's acknowledgement (then 503).
    redis_replica_wait_ms: int = Field(1000, ge=1)
    #: Find the primary through Sentinel: comma-separated ``host:port`` of the
    #: sentinels (the URL's host is then ignored, its password and db kept).
    redis_sentinels: str | None = None
    redis_sentinel_master: str = "omni-gateway"

    # Processes of a replica (gateway/runtime/processes.py)
    #: API worker processes beside the engine process; unset: one per core but
    #: one (at least one) with a real Redis; 0: one process does everything.
    #: The in-process store is always one process.
    api_workers: int | None = Field(None, ge=0)

    # Replicas (DESIGN section 5): who runs a session's engine work
    #: The lease a replica holds on each session it runs; renewed every third.
    #: A replica that dies loses its sessions to others after at most this.
    lease_ttl_sec: float = Field(10.0, gt=0)
    #: Engine sessions this replica runs at once; more wait in Redis for room.
    #: Keep it at or below the engine's ``max_num_seqs``.
    max_engine_sessions: int = Field(64, ge=1)
    #: Of those, how many may still be listening (input not complete); the
    #: rest is kept for answers. Unset: three quarters of ``max_engine_sessions``.
    max_listening_sessions: int | None = Field(None, ge=1)
    #: The order in which waiting listening sessions get room, after every
    #: waiting answer (gateway/domain/scheduling.py): ``fcfs`` (by arrival),
    #: ``lcas`` (last chunk arrival), ``mcps`` (most computed prefix).
    schedule_policy: SchedulePolicy = SchedulePolicy.FCFS
    #: A streaming session with no new input for this long is parked: its
    #: engine request is aborted (KV cache freed) and its next input resumes
    #: it from Redis. 0: never park for idleness (room for answers still parks).
    idle_park_sec: float = Field(10.0, ge=0)
    #: Output deltas of a session are published together over this window
    #: (one Redis call for all of them, gateway/work/batcher.py); it adds at
    #: most this to the relay. 0: each delta is published at once (bench/README.md
    #: section 2: at 100 tokens/s a session's deltas are 10 ms apart, so a few ms
    #: adds latency and saves calls only once the replica is busy).
    output_coalesce_ms: float = Field(0.0, ge=0, le=1000)
    #: How often the tender expires idle sessions and claims ownerless work.
    tend_interval_sec: float = Field(0.25, gt=0)
    #: On SIGTERM: how long /readyz reports 503 while still serving, so load
    #: balancers stop routing here before the listener closes.
    drain_sec: float = Field(1.0, ge=0)
    #: Then how long owned sessions get to finish before they are released.
    shutdown_grace_sec: float = Field(10.0, ge=0)
    #: Once input is complete, the longest the engine may go without producing
    #: anything (first token included) before the session fails with
    #: ``engine_timeout``; a stuck engine request must not leave a session
    #: ``generating`` forever.
    engine_progress_timeout_sec: float = Field(120.0, gt=0)

    # Engine
    #: ``vllm``: in-process vLLM; ``omni``: in-process vLLM-Omni (``AsyncOmni``);
    #: ``openai-http``: a co-located ``vllm serve`` / ``vllm serve --omni`` at ``engine_url``.
    engine: Literal["vllm", "omni", "openai-http"] = "vllm"
    #: Base URL of the ``openai-http`` engine, e.g. ``http://127.0.0.1:8091``.
    engine_url: str | None = None
    #: ``openai-http``: longest wait for the engine's next byte (first token included).
    engine_timeout_sec: float = Field(120.0, gt=0)
    #: ``openai-http``: how long the gateway waits at start for the engine to answer.
    engine_start_timeout_sec: float = Field(900.0, ge=0)
    #: ``openai-http``: the engine takes and produces audio (an omni model behind
    #: ``vllm serve --omni``); the plain OpenAI API does not say so itself.
    engine_audio: bool = False
    #: A local model folder; empty means the embedded default (SmolLM2-135M).
    model: str | None = None
    #: The names the in-process model is served under, comma-separated, as vLLM's
    #: ``--served-model-name`` takes several: requests may name any (a framework that
    #: asks for ``gpt-realtime`` by default, say), ``/v1/models`` lists them all, and the
    #: first is the engine's own. Unset: the model folder's name (the embedded default:
    #: ``SmolLM2-135M-Instruct``). ``openai-http``: the sidecar's own names, then these
    #: (a request naming one of these reaches the sidecar under its first name).
    served_model_name: Annotated[tuple[str, ...], NoDecode] = ()

    @field_validator("served_model_name", "allowed_origins", mode="before")
    @classmethod
    def _names_from_text(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        return tuple(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    dtype: str = "float32"
    max_model_len: int = Field(4096, ge=16)
    kv_cache_space_gib: int = Field(2, ge=1)
    #: The engine's ``max_num_seqs`` (requests it runs at once); unset: vLLM's
    #: default. Keep ``max_engine_sessions`` at or below it.
    engine_max_num_seqs: int | None = Field(None, ge=1)
    #: vLLM's parser of the model's tool-call format (its ``--tool-call-parser``), for
    #: ``tool_choice: auto``; ``xlam`` reads SmolLM2's. ``required`` and named calls need none.
    tool_call_parser: str = "xlam"
    #: Sampling for a request that names none, on every front door; unset: the
    #: served model's defaults (the embedded model's card: temperature 0.2, top-p 0.9).
    default_temperature: float | None = Field(None, ge=0, le=2)
    default_top_p: float | None = Field(None, gt=0, le=1)
    #: How a text model hears audio input: ``moonshine`` (accurate; ~350 MB) or
    #: ``pocketsphinx`` (~30 MB, misses more words, holds the GIL while it decodes).
    recognizer: Literal["moonshine", "pocketsphinx"] = "moonshine"
    #: torch.compile the in-process vLLM model: true always, false never. Unset: auto
    #: on the CPU (omni_adapter/compile_warmup.py): eager (ready in ~20 s) and, once
    #: ready, the same engine compiled in a niced background process to fill vLLM's
    #: compile cache; every later start of the same configuration is compiled (~25 s,
    #: decode ~1.25x; bench/README.md, "Engine start"). vLLM's default (compiled) on a GPU.
    engine_compile: bool | None = None

    @model_validator(mode="after")
    def _engine_url_for_http(self) -> Settings:
        if self.engine == "openai-http" and not self.engine_url:
            raise ValueError("OMNI_GATEWAY_ENGINE=openai-http needs OMNI_GATEWAY_ENGINE_URL")
        return self

    # Output
    sse_ping_sec: int = Field(15, ge=1)
    #: The voice page at /demo; off unless asked for (scripts/serve.sh asks, the Helm chart does not).
    demo: bool = False
    replica_id: str = Field(default_factory=_default_replica_id)
