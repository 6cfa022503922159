"""The ``openai-http`` adapter: a co-located ``vllm serve`` reached over HTTP.

The engine is a separate process (``vllm serve``, or ``vllm serve --omni`` for
vLLM-Omni models) speaking the OpenAI API. One ``httpx.AsyncClient`` is shared
by every session; each session ends in one streaming ``/v1/chat/completions``
request carrying the whole input, sent after ``end_input`` (``/v1/completions`` for a raw
prompt).

The HTTP API has no streaming input, so this engine is not incremental. What an
early start policy still buys is the **prefix-cache warm-up**: while input is
arriving, the session sends ``max_tokens=1`` requests with the input so far
(input only grows, so all of it is a stable prefix of the final prompt). The
engine (with ``--enable-prefix-caching``) keeps the KV blocks of that prefix,
and the final request only prefills what came after the last warm-up. Bounded:
at most one warm-up in flight per session; the next one starts when it ends
and enough new input arrived. The final request waits for a warm-up already on
the wire (its blocks are cached only once computed) and cancels one not sent
yet, so a session whose input arrives all at once (``on_end_only``) never warms.

Function calling is the sidecar's own (``tools``, ``tool_choice``, ``parallel_tool_calls``
sent as they are; its ``delta.tool_calls`` relayed): ``auto`` needs it started with
``--enable-auto-tool-choice --tool-call-parser <parser>``, ``required`` and a named function
do not. As in process, a template that ignores ``tools`` (SmolLM2's) has them told in the
system prompt (``ToolTemplate`` asks the sidecar's ``/tokenize`` once), and its answer goes
through the in-process ``CallRelay``: the start of a call that vLLM's streaming parser tells
as content is held back, calls to undeclared functions are left out.

The sidecar counts prompts for the gateway too (``SidecarCounter``: its ``/tokenize``
and its ``max_model_len``), so a Realtime history is trimmed to what it will take; a
server without them (not vLLM) is run as before, uncounted.

Errors are translated here, like httpx's own ``map_httpcore_exceptions``:
timeouts, refused or dropped connections and 5xx become ``engine_unavailable``
(or ``engine_overloaded`` for 429), a prompt past the context ``context_length_exceeded``,
other upstream 4xx become ``invalid_request`` with
the engine's message. Nothing from ``httpx`` leaves this module.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import httpx

from omni_adapter.audio import OPENAI_PCM16_RATE, pcm16_of, wav_of
from omni_adapter.port import (
    AudioDelta,
    Capabilities,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineUnavailableError,
    FinishReason,
    InputChunk,
    OutputEvent,
    SamplingOptions,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from omni_adapter.session_events import SessionEvents, check_servable
from omni_adapter.tool_calls import CallRelay, calls_tools, conversation

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: vLLM's own: a text's tokens, as the served model counts them.
TOKENIZE_PATH = "/tokenize"
#: A new warm-up only after this much new input (bytes): one KV block is 16
#: tokens, a few dozen bytes of text; fewer would cache nothing new.
WARMUP_MIN_NEW_BYTES = 48
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "abort"}


@dataclass(frozen=True)
class HttpEngineConfig:
    base_url: str
    #: Longest wait for the next byte of an answer (the first token included).
    timeout_sec: float = 120.0
    connect_timeout_sec: float = 5.0
    #: How long ``open_http_engine`` waits for the engine to come up.
    start_timeout_sec: float = 900.0
    #: The engine takes and produces audio (an omni model behind ``--omni``).
    audio: bool = False
    #: Warm the engine's prefix cache while input streams (early start policies).
    warmup: bool = True
    #: Sampling for what a request leaves unset, over the served model's defaults
    #: (which the engine applies to whatever is still unset).
    sampling_overrides: SamplingOptions = field(default_factory=SamplingOptions)
    #: Further names requests may use for the engine's first model (it gets that one's name).
    aliases: tuple[str, ...] = ()


async def open_http_engine(
    config: HttpEngineConfig, client: httpx.AsyncClient | None = None
) -> HttpEngine:
    """Connect to the engine, waiting up to ``start_timeout_sec`` for it to serve.

    Pass ``client`` to share one (tests pass a transport); it is then not closed here.
    """
    own_client = client is None
    if client is None:
        client = _new_client(config)
    try:
        names = tuple(card["id"] for card in await _wait_for_models(client, config.start_timeout_sec))
    except BaseException:
        if own_client:
            await client.aclose()
        raise
    logger.info("openai-http engine at %s serves %s", config.base_url, ", ".join(names))
    return HttpEngine(client, config, names, own_client=own_client)


def _new_client(config: HttpEngineConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=config.base_url,
                             timeout=httpx.Timeout(config.timeout_sec, connect=config.connect_timeout_sec))


async def _wait_for_models(client: httpx.AsyncClient, timeout_sec: float) -> list[dict[str, Any]]:
    """The model cards of ``/v1/models`` (at least one, each with its ``id``), once the engine answers."""
    deadline = time.monotonic() + timeout_sec
    while True:
        try:
            response = await client.get("/v1/models")
            if response.status_code < 500:
                response.raise_for_status()
                cards: list[dict[str, Any]] = list(response.json()["data"])
                if [card["id"] for card in cards]:  # (a card without one: unusable)
                    return cards
            problem = f"HTTP {response.status_code}"
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as exc:
            raise EngineUnavailableError(f"the engine's /v1/models is unusable: {exc}") from exc
        if time.monotonic() >= deadline:
            raise EngineUnavailableError(f"the engine at {client.base_url} is not serving ({problem})")
        await asyncio.sleep(1.0)


class HttpEngine:
    """The sidecar as seen by the gateway: one client, many sessions."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: HttpEngineConfig,
        model_names: Sequence[str],
        *,
        own_client: bool = False,
    ) -> None:
        self._client = client
        self._config = config
        self._own_client = own_client
        self._sessions: weakref.WeakSet[HttpSession] = weakref.WeakSet()
        self._closed = False
        #: The engine's own names: an alias is sent as the first of them.
        self._served = tuple(model_names)
        modalities = frozenset({"text", "audio"} if config.audio else {"text"})
        self.capabilities = Capabilities(
            input_modalities=modalities,
            output_modalities=modalities,
            incremental=False,
            model_names=tuple(dict.fromkeys([*model_names, *config.aliases])),
            structured_outputs=True,  # vLLM's server takes response_format
            raw_prompt=True,  # and serves /v1/completions
            logprobs=True,
            tools=True,  # vLLM's server calls functions (auto: with its tool-call parser)
        )
        self._template = ToolTemplate(client, self._served[0])

    def open_session(self, request: EngineRequest) -> HttpSession:
        if self._closed:
            raise EngineUnavailableError("the engine is closed")
        check_servable(self.capabilities, request)
        request = replace(request, model=request.model if request.model in self._served else self._served[0],
                          sampling=request.sampling.or_defaults(self._config.sampling_overrides))
        session = HttpSession(self._client, request, self.capabilities.input_modalities,
                              warmup=self._config.warmup, template=self._template)
        self._sessions.add(session)
        return session

    async def check_health(self) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine is closed")
        try:
            response = await self._client.get("/health", timeout=5.0)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"the engine is unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineUnavailableError(f"the engine is not healthy (HTTP {response.status_code})")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for session in list(self._sessions):
            await session.abort()
        if self._own_client:
            await self._client.aclose()


class HttpSession:
    """One session: input collected (and warmed), then one streamed answer."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        request: EngineRequest,
        accepted: frozenset[str],
        *,
        warmup: bool,
        template: ToolTemplate | None = None,
    ) -> None:
        self._client = client
        self._request = request
        self._template = template or ToolTemplate(client, request.model)
        #: The answer's content and calls, as in process (only when it may call).
        self._calls = CallRelay(request.tools, parallel=request.parallel_tool_calls) \
            if calls_tools(request.tools, request.tool_choice) else None
        self._accepted = accepted
        self._warmup_enabled = warmup
        self._content = UserContent()
        self._events = SessionEvents()
        self._input_ended = False
        self._warmup: asyncio.Task[None] | None = None
        self._warmup_on_wire = False
        #: Input size (bytes) the latest warm-up covered.
        self._warmed_bytes = 0
        #: Warm-up requests sent so far (observability and tests).
        self.warmups_sent = 0
        self._answer: asyncio.Task[None] | None = None
        #: Prompt tokens the engine took from its prefix cache for the answer,
        #: when it reports them (``--enable-prompt-tokens-details``).
        self.cached_prompt_tokens = 0
        self._prompt_tokens = 0
        self._completion_tokens = 0
        #: The tokens of ``assistant_prefix`` (the answer so far, after a hand-off): they count
        #: against ``max_tokens`` and in the usage as completion tokens, as in-process vLLM does.
        self._emitted = 0
        self._answer_started = False

    async def feed(self, chunks: Sequence[InputChunk]) -> None:
        for chunk in chunks:
            if chunk.modality not in self._accepted:
                accepted = ", ".join(sorted(self._accepted))
                raise EngineRejectedError(f"this engine accepts {accepted}, not {chunk.modality}")
            if (self._request.raw_prompt or self._request.continue_final_message) and chunk.modality != "text":
                raise EngineRejectedError("a raw prompt, or a message the answer continues, is text")
        if self._events.ended:
            return
        if self._input_ended:
            raise EngineRejectedError("the input has already ended")
        for chunk in chunks:
            self._content.add(chunk)
        self._maybe_warm()

    async def end_input(self) -> None:
        if self._events.ended or self._input_ended:
            return
        self._input_ended = True
        self._content.finish()
        if self._warmup is not None and not self._warmup_on_wire:
            # Input arrived all at once: the final request is the only one needed.
            self._warmup.cancel()
        self._answer = asyncio.get_running_loop().create_task(
            self._run_answer(), name=f"http-answer-{self._request.request_id}")

    def events(self) -> AsyncIterator[OutputEvent]:
        return self._events.stream()

    async def abort(self) -> None:
        self._finish("abort")
        tasks = [t for t in (self._warmup, self._answer) if t is not None and not t.done()]
        for task in tasks:
            if task is not asyncio.current_task():
                # Closing the response makes vLLM abort the request.
                task.cancel()
        await asyncio.gather(*(t for t in tasks if t is not asyncio.current_task()),
                             return_exceptions=True)

    # -- warm-up ------------------------------------------------------------

    def _maybe_warm(self, _: object = None) -> None:
        if not self._warmup_enabled or self._input_ended or self._events.ended:
            return
        if self._warmup is not None and not self._warmup.done():
            return  # one in flight at most; its end looks again
        size = self._content.size
        if self.warmups_sent and size - self._warmed_bytes < WARMUP_MIN_NEW_BYTES:
            return
        self._warmed_bytes = size
        self._warmup_on_wire = False
        content = self._content.render()
        self._warmup = asyncio.get_running_loop().create_task(
            self._send_warmup(content), name=f"http-warmup-{self._request.request_id}")
        self._warmup.add_done_callback(self._maybe_warm)

    async def _send_warmup(self, content: str | list[dict[str, Any]]) -> None:
        """Best effort: a failed warm-up only costs the cache hit."""
        try:
            body = await self._body(content, warm=True)
        except httpx.HTTPError as exc:
            logger.debug("session %s: warm-up failed: %r", self._request.request_id, exc)
            return
        self._warmup_on_wire = True
        self.warmups_sent += 1
        try:
            response = await self._client.post(self._path, json=body)
        except httpx.HTTPError as exc:
            logger.debug("session %s: warm-up failed: %r", self._request.request_id, exc)
            return
        if response.status_code != 200:
            logger.debug("session %s: warm-up got HTTP %s", self._request.request_id,
                         response.status_code)

    # -- the answer -----------------------------------------------------------

    async def _run_answer(self) -> None:
        if self._warmup is not None:
            await asyncio.wait([self._warmup])
        try:
            with _engine_errors():
                body = await self._body(self._content.render(), warm=False)
                if self._request.assistant_prefix:
                    self._emitted = await self._tokens_of(self._request.assistant_prefix)
                    if "max_tokens" in body:
                        if body["max_tokens"] <= self._emitted:
                            self._finish("length")  # the answer so far already reached it
                            return
                        body["max_tokens"] -= self._emitted
                async with self._client.stream("POST", self._path, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        self._fail(_error_from_response(response))
                        return
                    await self._relay(response)
        except _EngineFailure as failure:
            self._fail(failure.error)

    async def _relay(self, response: httpx.Response) -> None:
        reason: str | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                finish = _FINISH_REASONS.get(reason or "")
                if self._calls is not None:
                    for event in self._calls.events("", (), finished=True):
                        self._events.emit(event)  # what was held was not a call after all
                    if finish == "tool_calls" and not self._calls.called:
                        finish = "stop"  # its only calls were left out
                if finish is None:
                    self._fail(EngineError(f"generation failed ({reason or 'no finish reason'})"))
                else:
                    self._finish(finish)
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                self._fail(EngineError("the engine sent a malformed stream"))
                return
            if "error" in chunk:
                self._fail(_error_from_body(chunk, status=None))
                return
            reason = self._on_chunk(chunk) or reason
        self._fail(EngineError("the engine closed the stream before the end of the answer",
                               code="engine_unavailable"))

    async def _tokens_of(self, text: str) -> int:
        """How many tokens ``text`` is, as the sidecar counts them (vLLM's ``/tokenize``); 0 from a
        server without it (the answer so far then goes uncounted, as before)."""
        response = await self._client.post(TOKENIZE_PATH, json={"model": self._request.model, "prompt": text,
                                                                "add_special_tokens": False})
        if response.status_code != 200:
            logger.warning("session %s: the engine did not count the answer so far (HTTP %s): it is not "
                           "counted against max_tokens", self._request.request_id, response.status_code)
            return 0
        return int(response.json().get("count") or 0)

    def _on_chunk(self, chunk: dict[str, Any]) -> str | None:
        """Emit the chunk's deltas; return its finish reason, if any."""
        if usage := chunk.get("usage"):
            # The answer so far was sent as the prompt's end: it is the answer's (completion) tokens.
            self._prompt_tokens = max(0, (usage.get("prompt_tokens") or 0) - self._emitted) or self._prompt_tokens
            # vLLM-Omni repeats usage with 0 completion tokens on audio chunks.
            self._completion_tokens = max(self._completion_tokens, usage.get("completion_tokens") or 0)
            if details := usage.get("prompt_tokens_details"):
                self.cached_prompt_tokens = details.get("cached_tokens") or 0
        reason = None
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content = choice.get("text") if self._request.raw_prompt else delta.get("content")
            if chunk.get("modality") == "audio":
                # vLLM-Omni: base64 audio in ``content``, its format beside.
                if content:
                    rate = (choice.get("audio_metadata") or {}).get("sample_rate_hz")
                    self._events.emit(AudioDelta(base64.b64decode(content), rate or OPENAI_PCM16_RATE))
            else:
                self._on_text(content or "", choice.get("logprobs"), delta.get("tool_calls") or ())
            self._answer_started = True
            if (audio := delta.get("audio")) and audio.get("data"):
                self._events.emit(AudioDelta(base64.b64decode(audio["data"]), OPENAI_PCM16_RATE,
                                    transcript=audio.get("transcript") or ""))
            reason = choice.get("finish_reason") or reason
        return reason

    def _on_text(self, content: str, logprobs: dict[str, Any] | None, calls: Sequence[dict[str, Any]]) -> None:
        """The content and the pieces of calls, through the ``CallRelay`` when it may call."""
        pieces: list[TextDelta | ToolCallDelta] = []
        if self._calls is not None:
            pieces = self._calls.events(content, [ToolCallDelta(
                call.get("index") or 0, call.get("id"), (call.get("function") or {}).get("name"),
                (call.get("function") or {}).get("arguments") or "") for call in calls], finished=False)
            content = "".join(piece.text for piece in pieces if isinstance(piece, TextDelta))
        if content or not self._answer_started or logprobs:
            # The first chunk (vLLM's role chunk: no content) says the answer began.
            self._events.emit(TextDelta(content, self._logprobs_of(logprobs)))
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                self._events.emit(piece)

    def _logprobs_of(self, given: dict[str, Any] | None) -> tuple[TokenLogprob, ...]:
        """A chunk's log probabilities (chat's ``content`` list, or the completions' columns)."""
        top = self._request.sampling.logprobs
        if not given or top is None:
            return ()
        if not self._request.raw_prompt:
            return tuple(TokenLogprob(t["token"], t["logprob"], _likeliest(
                ((o["token"], o["logprob"]) for o in t.get("top_logprobs") or ()), top)) for t in given["content"] or ())
        return tuple(TokenLogprob(token, logprob, _likeliest((alternatives or {}).items(), top))
                     for token, logprob, alternatives in zip(given["tokens"], given["token_logprobs"],
                                                             given.get("top_logprobs") or repeat(None), strict=False))

    @property
    def _path(self) -> str:
        return COMPLETIONS_PATH if self._request.raw_prompt else CHAT_PATH

    async def _body(self, content: str | list[dict[str, Any]], *, warm: bool) -> dict[str, Any]:
        request = self._request
        if request.raw_prompt:
            assert isinstance(content, str)  # feed takes only text for it
            return self._sampled({"model": request.model, "prompt": content + request.assistant_prefix}, warm=warm)
        takes_tools = await self._template.takes_tools() if request.tools else True
        return self._sampled(chat_request(request, content, takes_tools=takes_tools), warm=warm)

    def _sampled(self, body: dict[str, Any], *, warm: bool) -> dict[str, Any]:
        """``body`` as a warm-up (prefill only) or as the answer's request."""
        request = self._request
        if warm:
            # Prefill only; text only, so an omni engine's later stages stay idle.
            body.update(max_tokens=1, temperature=0.0, stream=False)
            if "audio" in self._accepted:
                body["modalities"] = ["text"]
            return body
        body.update(openai_sampling(request.sampling))
        if (top := request.sampling.logprobs) is not None:
            body.update({"logprobs": top} if request.raw_prompt else {"logprobs": True, "top_logprobs": top})
        body.update(stream=True, stream_options={"include_usage": True})
        if "audio" in request.output_modalities:
            body.update(modalities=list(request.output_modalities), audio={"format": "pcm16"})
        return body

    def _finish(self, reason: FinishReason) -> None:
        self._events.finish(reason, Usage(self._prompt_tokens, self._emitted + self._completion_tokens))

    def _fail(self, error: EngineError) -> None:
        self._events.fail(error)


def chat_request(request: EngineRequest, content: str | list[dict[str, Any]], *,
                 takes_tools: bool = True) -> dict[str, Any]:
    """The chat request's prompt (no sampling): the history, the streamed input as whose it is,
    the answer so far left open, the functions it may call. What a session sends, and what the
    counter has the sidecar count. ``takes_tools``: the sidecar's template renders ``tools``
    (else they are told in the system prompt, as in process: ``conversation``)."""
    # The input is whose it is: the user's words, a function's result, or a system note.
    streamed: dict[str, Any] = {"role": request.input_role, "content": content}
    if request.input_tool_call_id is not None:
        streamed["tool_call_id"] = request.input_tool_call_id
    history = [dict(m) for m in request.messages]
    if request.tools:
        history, _ = conversation(request.messages, request.tools, request.tool_choice, takes_tools)
    messages = [*history, streamed]
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if calls_tools(request.tools, request.tool_choice):
        # vLLM's server: the template's tools, the parser of the answer, the structured output
        # of required / a named function, at most one call without parallel_tool_calls.
        body.update(tools=list(request.tools), tool_choice=request.tool_choice or "auto",
                    parallel_tool_calls=request.parallel_tool_calls)
    if request.chat_template_kwargs:  # the sidecar passes those its template reads
        body["chat_template_kwargs"] = request.chat_template_kwargs
    if not request.add_generation_prompt:
        body["add_generation_prompt"] = False
    if request.continue_final_message:
        # The input is left open; an answer so far (a hand-off) goes on from it.
        assert isinstance(content, str)  # feed takes only text for it
        streamed["content"] = content + request.assistant_prefix
        body.update(add_generation_prompt=False, continue_final_message=True)
    elif request.assistant_prefix:
        messages.append({"role": "assistant", "content": request.assistant_prefix})
        # vLLM's extension: render the last message open, so the answer continues it.
        body.update(add_generation_prompt=False, continue_final_message=True)
    return body


class SidecarCounter:
    """A prompt's tokens as the sidecar counts them: vLLM's ``/tokenize`` of the chat request a
    session would send with no input yet (the sidecar's own template, its generation prompt), so
    a Realtime history is trimmed to what the sidecar will take. Its context is ``/v1/models``'
    ``max_model_len``. Any process of a replica opens one (an API worker has no engine)."""

    def __init__(self, client: httpx.AsyncClient, served: Sequence[str], max_model_len: int, *,
                 own_client: bool = False) -> None:
        self._client = client
        self._served = tuple(served)
        self._max_model_len = max_model_len
        self._own_client = own_client
        self._template = ToolTemplate(client, self._served[0])

    @property
    def max_input_tokens(self) -> int:
        return self._max_model_len - 1

    async def prompt_tokens(self, request: EngineRequest) -> int:
        model = request.model if request.model in self._served else self._served[0]
        # The prompt before the input, as ``RequestChecks.check_request`` counts it: no answer so far.
        try:
            takes_tools = await self._template.takes_tools() if request.tools else True
            body = chat_request(replace(request, model=model, assistant_prefix=""), "", takes_tools=takes_tools)
            response = await self._client.post(TOKENIZE_PATH, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"the engine did not count the prompt ({type(exc).__name__})") from exc
        if response.status_code == 200:
            try:
                return int(response.json()["count"])
            except (ValueError, KeyError, TypeError) as exc:
                raise EngineUnavailableError(f"the engine's /tokenize answer is unusable: {exc}") from exc
        error = _error_from_response(response)
        if error.code in ("invalid_request", "context_length_exceeded"):
            raise EngineRejectedError(error.message)
        raise EngineUnavailableError(f"the engine did not count the prompt: {error.message}")

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


async def open_sidecar_counter(config: HttpEngineConfig,
                               client: httpx.AsyncClient | None = None) -> SidecarCounter | None:
    """The sidecar's counter, once it serves (up to ``start_timeout_sec``); ``None``, with one
    warning, from a server that cannot count (no ``max_model_len`` in its model cards, no
    ``/tokenize``: not vLLM): then nothing is counted before it runs a request, as before.

    Pass ``client`` to share one (tests pass a transport); it is then not closed here.
    """
    own_client = client is None
    if client is None:
        client = _new_client(config)
    counter = None
    try:
        counter = await _probed_counter(client, config.start_timeout_sec, own_client)
    finally:
        if counter is None and own_client:
            await client.aclose()
    return counter


async def _probed_counter(client: httpx.AsyncClient, timeout_sec: float, own_client: bool) -> SidecarCounter | None:
    cannot = "prompts are not counted before it runs them (a Realtime history is not trimmed)"
    try:
        cards = await _wait_for_models(client, timeout_sec)
    except EngineUnavailableError as exc:
        logger.warning("openai-http engine: %s; %s", exc, cannot)
        return None
    context = cards[0].get("max_model_len")
    if not isinstance(context, int) or context < 2:
        logger.warning("openai-http engine: its /v1/models names no max_model_len; %s", cannot)
        return None
    counter = SidecarCounter(client, [card["id"] for card in cards], context, own_client=own_client)
    try:
        await counter.prompt_tokens(EngineRequest("probe", cards[0]["id"], (), SamplingOptions()))
    except (EngineRejectedError, EngineUnavailableError) as exc:
        logger.warning("openai-http engine: it does not count a prompt (%s: %s); %s", TOKENIZE_PATH, exc, cannot)
        return None
    return counter


class ToolTemplate:
    """Whether the sidecar's chat template renders ``tools`` (SmolLM2's ignores them), as the
    in-process engine's ``takes_tools`` tells it: the sidecar's ``/tokenize`` of one message with
    and without a tool, asked once, at the first request with tools. A server that cannot count
    (not vLLM) is taken to render them: the request goes as it is."""

    _PROBE = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self._client = client
        self._model = model
        self._known: bool | None = None
        self._lock = asyncio.Lock()

    async def takes_tools(self) -> bool:
        """The answer (``httpx.HTTPError`` when the sidecar is unreachable: asked again later)."""
        async with self._lock:
            if self._known is None:
                plain = {"model": self._model, "messages": [{"role": "user", "content": "hi"}]}
                counts = []
                for body in (plain, {**plain, "tools": [self._PROBE]}):
                    response = await self._client.post(TOKENIZE_PATH, json=body)
                    counts.append(_count_in(response))
                self._known = None in counts or counts[0] != counts[1]
                logger.info("openai-http engine: its chat template %s tools", "renders" if self._known else
                            "ignores (they are told in the system prompt)")
            return self._known


def _count_in(response: httpx.Response) -> int | None:
    try:
        count = response.json().get("count") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        return None
    return count if isinstance(count, int) else None


class UserContent:
    """The user turn as it grows: text and audio parts in input order.

    Renders as a plain string while there is only text (so the engine renders
    the same prompt as for a one-shot request), else as OpenAI content parts;
    consecutive audio chunks become one ``input_audio`` part.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        #: ``str`` for text, ``(bytearray pcm16, sample rate)`` for audio.
        self._parts: list[str | tuple[bytearray, int]] = []
        #: Input bytes received, the measure for re-warming.
        self.size = 0

    def add(self, chunk: InputChunk) -> None:
        self.size += len(chunk.data)
        if chunk.modality == "text":
            self._add_text(self._decoder.decode(chunk.data))
            return
        pcm16, rate = pcm16_of(chunk)
        self._add_text(self._decoder.decode(b"", final=True))
        last = self._parts[-1] if self._parts else None
        if isinstance(last, tuple) and last[1] == rate:
            last[0].extend(pcm16)
        else:
            self._parts.append((bytearray(pcm16), rate))

    def finish(self) -> None:
        self._add_text(self._decoder.decode(b"", final=True))

    def _add_text(self, text: str) -> None:
        if not text:
            return
        if self._parts and isinstance(self._parts[-1], str):
            self._parts[-1] += text
        else:
            self._parts.append(text)

    def render(self) -> str | list[dict[str, Any]]:
        texts = [part for part in self._parts if isinstance(part, str)]
        if len(texts) == len(self._parts):
            return "".join(texts)
        rendered: list[dict[str, Any]] = []
        for part in self._parts:
            if isinstance(part, str):
                rendered.append({"type": "text", "text": part})
            else:
                wav = base64.b64encode(wav_of(bytes(part[0]), part[1])).decode()
                rendered.append({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}})
        return rendered


def _likeliest(tokens: Iterable[tuple[str, float]], top: int) -> tuple[tuple[str, float], ...]:
    """The ``top`` likeliest, likeliest first (vLLM lists the sampled token first)."""
    return tuple(sorted(tokens, key=lambda token: token[1], reverse=True)[:top])


def openai_sampling(options: SamplingOptions) -> dict[str, Any]:
    """The session's sampling fields as an OpenAI request (vLLM reads top_k, repetition_penalty, min_p)."""
    fields: dict[str, Any] = {
        "max_tokens": options.max_tokens,
        # Unset: vLLM applies the served model's defaults (its generation config).
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "seed": options.seed,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repetition_penalty,
        "min_p": options.min_p,
        "logit_bias": options.logit_bias,
        **_held_to(options.response_format),
        "stop": list(options.stop) or None,
        "min_tokens": options.min_tokens,
        "ignore_eos": options.ignore_eos,
        "stop_token_ids": options.stop_token_ids,
        "include_stop_str_in_output": options.include_stop_str_in_output,
        "skip_special_tokens": options.skip_special_tokens,
        "spaces_between_special_tokens": options.spaces_between_special_tokens,
        "bad_words": options.bad_words,
    }
    return {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()
            if value is not None}


def _held_to(constraint: dict[str, Any] | None) -> dict[str, Any]:
    """The answer's grammar as vLLM's server takes it: OpenAI's ``response_format``, or its own
    ``structured_outputs`` for a regex, a choice or a grammar."""
    if constraint is None:
        return {}
    kind = constraint["type"]
    if kind in ("regex", "choice", "grammar"):
        return {"structured_outputs": {kind: constraint[kind]}}
    return {"response_format": constraint}


class _EngineFailure(Exception):
    def __init__(self, error: EngineError) -> None:
        super().__init__(error.message)
        self.error = error


@contextmanager
def _engine_errors() -> Iterator[None]:
    """Translate httpx's transport errors into the port's error events."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise _EngineFailure(EngineError(
            f"the engine did not answer in time ({type(exc).__name__})", code="engine_unavailable",
        )) from exc
    except httpx.TransportError as exc:
        raise _EngineFailure(EngineError(
            f"the engine is unreachable ({type(exc).__name__})", code="engine_unavailable",
        )) from exc


def _error_from_response(response: httpx.Response) -> EngineError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    return _error_from_body(body if isinstance(body, dict) else {}, status=response.status_code)


def _past_the_context(error: dict[str, Any], message: str) -> bool:
    """vLLM's refusal of a prompt past the model's context (its ``param`` names the input's
    tokens or text), told apart from other 400s: the chat doors answer it as OpenAI does."""
    return error.get("param") in ("input_tokens", "input_text") or "maximum context length" in message


def _error_from_body(body: dict[str, Any], *, status: int | None) -> EngineError:
    """The engine's error envelope (vLLM's is OpenAI's) as the port's error event."""
    error = body.get("error")
    if isinstance(error, dict):
        message = str(error.get("message") or "the engine refused the request")
        status = status or (error.get("code") if isinstance(error.get("code"), int) else None)
    else:
        message = str(error or body.get("detail") or f"the engine answered HTTP {status}")
    details = {"upstream_status": status} if status else {}
    if status == 400 and _past_the_context(error if isinstance(error, dict) else {}, message):
        return EngineError(message, code="context_length_exceeded", details=details)
    if status == 429:
        return EngineError(message, code="engine_overloaded", details=details)
    if status is not None and 400 <= status < 500:
        return EngineError(message, code="invalid_request", details=details)
    return EngineError(message, code="engine_unavailable" if status == 503 else "engine_error",
                       details=details)
