"""The ``openai-http`` adapter against a real ``vllm serve`` (and its pure parts).

Real sidecar: answers, the prefix-cache warm-up, upstream 4xx, abort. Real
sockets: a refused connection and a server that never answers. Scripted
responses (``httpx.MockTransport``) only for what SmolLM2 cannot produce:
audio output in both wire formats, and the request bodies for audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.settings import Settings
from omni_adapter.audio import wav_of
from omni_adapter.factory import EngineChoice, open_engine
from omni_adapter.http_engine import (
    HttpEngine,
    HttpEngineConfig,
    HttpSession,
    UserContent,
    open_http_engine,
    open_sidecar_counter,
)
from omni_adapter.port import (
    AudioDelta,
    EngineError,
    EngineRejectedError,
    EngineRequest,
    EngineUnavailableError,
    Finished,
    InputChunk,
    SamplingOptions,
    TextDelta,
    ToolCallDelta,
)
from tests.omni_adapter.sessions import MODEL, collect, one_shot, request, text_chunks
from tests.redis_server import free_port
from tests.vllm_sidecar import VllmSidecar

QUESTION = ("Here is a list of fruits: apples, pears, plums, cherries, bananas, kiwis, "
            "mangos, lemons and figs. Which of them is usually red? Answer in one word.")


class WarmupCounter(httpx.AsyncBaseTransport):
    """The real transport, counting warm-up requests (``max_tokens=1``, not streamed) in flight."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.in_flight = self.most_in_flight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.method == "POST" else {}
        warm = body.get("max_tokens") == 1 and not body.get("stream")
        self.in_flight += warm
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._inner.handle_async_request(request)
        finally:
            self.in_flight -= warm

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.fixture
async def counted(vllm_sidecar: VllmSidecar) -> AsyncIterator[tuple[HttpEngine, WarmupCounter]]:
    vllm_sidecar.ensure_running()
    transport = WarmupCounter()
    async with httpx.AsyncClient(base_url=vllm_sidecar.url, transport=transport, timeout=60) as client:
        engine = await open_http_engine(HttpEngineConfig(base_url=vllm_sidecar.url), client)
        yield engine, transport
        await engine.aclose()


def unique_history() -> tuple[dict[str, str], ...]:
    """A system prompt no earlier request shared, so only this test can have cached it."""
    return ({"role": "system", "content": f"Session {uuid.uuid4().hex}. You answer in one word."},)


@pytest.mark.engine
async def test_warmup_makes_the_final_request_hit_the_cache(
    counted: tuple[HttpEngine, WarmupCounter],
) -> None:
    engine, transport = counted
    history = unique_history()
    session = engine.open_session(request(history=history))
    assert isinstance(session, HttpSession)
    for chunk in text_chunks(QUESTION.encode(), 40):
        await session.feed([chunk])
        await asyncio.sleep(0.3)
    await session.end_input()
    text, end = await collect(session.events())
    expected, expected_end = await one_shot(engine, request(history=history), QUESTION)

    assert text == expected and text
    assert isinstance(end, Finished) and isinstance(expected_end, Finished)
    assert end.usage.prompt_tokens == expected_end.usage.prompt_tokens
    assert session.warmups_sent >= 1
    assert transport.most_in_flight == 1
    # The warm-ups cached the prompt's leading KV blocks (32 tokens each).
    assert session.cached_prompt_tokens >= 32


@pytest.mark.engine
async def test_input_all_at_once_sends_no_warmup(counted: tuple[HttpEngine, WarmupCounter]) -> None:
    engine, transport = counted
    session = engine.open_session(request(history=unique_history()))
    assert isinstance(session, HttpSession)
    await session.feed(text_chunks(QUESTION.encode(), 30))
    await session.end_input()
    text, end = await collect(session.events())
    assert text and isinstance(end, Finished)
    assert session.warmups_sent == 0 and transport.most_in_flight == 0
    assert session.cached_prompt_tokens == 0


@pytest.mark.engine
async def test_upstream_4xx_becomes_invalid_request(http_engine: HttpEngine) -> None:
    _, end = await one_shot(http_engine, request(top_p=7.0), "Hi")
    assert isinstance(end, EngineError)
    assert end.code == "invalid_request" and "top_p" in end.message
    assert end.details == {"upstream_status": 400}
    _, end = await one_shot(http_engine, request(), "word " * 3000)  # over the 2048-token context
    assert isinstance(end, EngineError) and end.code == "context_length_exceeded", end  # as chat doors say it


@pytest.mark.engine
async def test_capabilities_and_health(http_engine: HttpEngine) -> None:
    caps = http_engine.capabilities
    assert caps.model_names == (MODEL,) and not caps.incremental
    assert caps.input_modalities == caps.output_modalities == frozenset({"text"})
    await http_engine.check_health()


@pytest.mark.engine
async def test_factory_opens_the_sidecar_from_settings(vllm_sidecar: VllmSidecar) -> None:
    vllm_sidecar.ensure_running()
    settings = Settings(engine="openai-http", engine_url=vllm_sidecar.url, served_model_name="gpt-4o-mini")
    engine = await open_engine(EngineChoice(kind=settings.engine, engine_url=settings.engine_url,
                                            served_model_name=settings.served_model_name,
                                            engine_start_timeout_sec=0))
    try:
        # The sidecar's own name, then the gateway's alias, which reaches the sidecar under its name.
        assert engine.capabilities.model_names == (MODEL, "gpt-4o-mini")
        text, done = await one_shot(engine, replace(request(max_tokens=4), model="gpt-4o-mini"), "Say hi.")
        assert text and isinstance(done, Finished)
        # A text model: the CPU Listener and Talker give it voice, as the in-process engine has.
        assert engine.capabilities.input_modalities == engine.capabilities.output_modalities == {"text", "audio"}
        assert isinstance(engine._thinker._thinker, HttpEngine)  # type: ignore[attr-defined]
    finally:
        await engine.aclose()


def test_the_gpu_sidecar_chart_selects_this_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Helm chart's GPU+sidecar values name the settings this adapter reads."""
    from tests.deploy import k8s

    config_map = k8s.one(k8s.render_values_file("ci/gpu-sidecar-values.yaml"), "ConfigMap", "omni-gateway")
    for key, value in config_map["data"].items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.engine == "openai-http" and settings.engine_url == "http://127.0.0.1:8091"


def test_openai_http_needs_an_engine_url() -> None:
    with pytest.raises(ValidationError, match="ENGINE_URL"):
        Settings(engine="openai-http")


async def test_unreachable_engine_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(EngineUnavailableError):
        await open_http_engine(HttpEngineConfig(base_url=url, start_timeout_sec=0))
    async with httpx.AsyncClient(base_url=url) as client:
        engine = HttpEngine(client, HttpEngineConfig(base_url=url), [MODEL])
        with pytest.raises(EngineUnavailableError):
            await engine.check_health()
        _, end = await one_shot(engine, request(), "Hi")
    assert isinstance(end, EngineError) and end.code == "engine_unavailable"


async def test_engine_that_never_answers_times_out() -> None:
    async def accept_and_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        await asyncio.sleep(30)

    server = await asyncio.start_server(accept_and_stall, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=0.5) as client:
            engine = HttpEngine(client, HttpEngineConfig(base_url=client.base_url), [MODEL])
            async with asyncio.timeout(10):
                _, end = await one_shot(engine, request(), "Hi")
    finally:
        server.close()
    assert isinstance(end, EngineError) and end.code == "engine_unavailable"
    assert "in time" in end.message


# -- scripted responses: what SmolLM2 cannot produce -------------------------------------


def sse(*chunks: object) -> bytes:
    return b"".join(f"data: {json.dumps(c) if not isinstance(c, str) else c}\n\n".encode()
                    for c in chunks)


def scripted_engine(handler: Callable[[httpx.Request], httpx.Response]) -> HttpEngine:
    client = httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(handler))
    return HttpEngine(client, HttpEngineConfig(base_url="http://engine", audio=True), [MODEL],
                      own_client=True)


async def test_audio_deltas_in_both_wire_formats_and_audio_input() -> None:
    pcm_a, pcm_b = b"\x01\x00\x02\x00", b"\x03\x00\x04\x00\x05\x00"
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
            # OpenAI: delta.audio, pcm16 at 24 kHz.
            {"choices": [{"index": 0, "delta": {"audio": {
                "data": base64.b64encode(pcm_a).decode(), "transcript": "Hi"}}}]},
            # vLLM-Omni: an audio chunk with base64 content and its sample rate beside.
            {"modality": "audio", "choices": [{"index": 0, "delta": {
                "content": base64.b64encode(pcm_b).decode()},
                "audio_metadata": {"format": "pcm", "sample_rate_hz": 22050, "frame_count": 3,
                                   "channels": 1}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
            "[DONE]"), headers={"content-type": "text/event-stream"})

    engine = scripted_engine(handler)
    req = EngineRequest("a1", MODEL, (), SamplingOptions(temperature=0.0),
                        output_modalities=("text", "audio"))
    session = engine.open_session(req)
    await session.feed([InputChunk(0, "text", b"Listen: "),
                        InputChunk(1, "audio", b"\x10\x00" * 4, format="pcm16"),
                        InputChunk(2, "audio", b"\x20\x00" * 2, format="pcm16")])
    await session.end_input()
    events = [event async for event in session.events()]
    await engine.aclose()

    assert events == [
        TextDelta("Hi"),
        AudioDelta(pcm_a, 24_000, transcript="Hi"),
        AudioDelta(pcm_b, 22_050),
        Finished("stop", events[-1].usage),  # type: ignore[union-attr]
    ]
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (9, 2)  # type: ignore[union-attr]
    final = bodies[-1]
    assert final["stream"] and final["modalities"] == ["text", "audio"]
    assert final["audio"] == {"format": "pcm16"}
    text_part, audio_part = final["messages"][-1]["content"]
    assert text_part == {"type": "text", "text": "Listen: "}
    # Both audio chunks in one WAV at the default input rate.
    assert audio_part["input_audio"] == {
        "data": base64.b64encode(wav_of(b"\x10\x00" * 4 + b"\x20\x00" * 2, 16_000)).decode(),
        "format": "wav"}


async def test_error_in_the_stream_and_early_close() -> None:
    replies = iter([
        sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
            {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}),
        sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),  # no [DONE]
    ])
    engine = scripted_engine(lambda _: httpx.Response(200, content=next(replies)))
    _, first = await one_shot(engine, request(), "x")
    _, second = await one_shot(engine, request(), "x")
    await engine.aclose()
    assert first == EngineError("boom", code="engine_error", details={"upstream_status": 500})
    assert isinstance(second, EngineError) and second.code == "engine_unavailable"


def recording_engine() -> tuple[HttpEngine, list[dict[str, Any]]]:
    """An engine whose sidecar answers "ok" to each request, and the bodies it was sent."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse({"choices": [{"index": 0, "delta": {"content": "ok"},
                                                             "finish_reason": "stop"}]}, "[DONE]"),
                              headers={"content-type": "text/event-stream"})

    return scripted_engine(handler), bodies


async def test_the_input_goes_to_the_engine_as_whose_it_is() -> None:
    """A function's result, or a system note (a Realtime greeting), is not the user's words."""
    engine, bodies = recording_engine()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for role, call_id, history in (("tool", "c1", ({"role": "assistant", "tool_calls": [call]},)),
                                   ("system", None, ())):
        session = engine.open_session(replace(request(history=history), input_role=role, input_tool_call_id=call_id))
        await session.feed(text_chunks(b"sunny", 5))
        await session.end_input()
        await collect(session.events())
        assert bodies[-1]["messages"][-1] == {"role": role, "content": "sunny",
                                              **({"tool_call_id": call_id} if call_id else {})}
    await engine.aclose()


async def test_the_requests_template_variables_go_to_the_sidecar() -> None:
    engine, bodies = recording_engine()
    for kwargs in ({"enable_thinking": False}, {}):
        session = engine.open_session(replace(request(), chat_template_kwargs=kwargs))
        await session.feed(text_chunks(b"hi", 2))
        await session.end_input()
        await collect(session.events())
        assert bodies[-1].get("chat_template_kwargs") == (kwargs or None)
    await engine.aclose()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def calling_sidecar(stream: bytes, *, renders_tools: bool) -> tuple[HttpEngine, list[dict[str, Any]]]:
    """A sidecar whose chat answers ``stream``, whose template renders tools or not (its
    ``/tokenize`` counts them or not), and the chat bodies it was sent."""
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 9 + (7 if renders_tools and "tools" in body else 0)})
        bodies.append(body)
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    return scripted_engine(handler), bodies


def delta(content: str | None = None, calls: list[dict[str, Any]] | None = None,
          finish: str | None = None) -> dict[str, Any]:
    said = {"content": content} if content is not None else {"tool_calls": calls}
    return {"choices": [{"index": 0, "delta": said, "finish_reason": finish}]}


async def test_tools_go_to_the_sidecar_and_its_calls_come_back_without_the_tags_start() -> None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as vLLM's server takes them; its
    ``delta.tool_calls`` as the port's; the tag's start its streaming parser told as content
    (as ``vllm serve`` does, seen on the real one) held back; a template that ignores tools (SmolLM2's)
    has them told in the system prompt and earlier calls as text, as in process."""
    stream = sse(delta(""), delta("<"), delta("tool"), delta("_"), delta("call"),
                 delta(calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}]),
                 delta(calls=[{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]),
                 delta(calls=[], finish="tool_calls"), "[DONE]")
    earlier = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    history = ({"role": "user", "content": "And in Rome?"}, {"role": "assistant", "content": None, "tool_calls": [earlier]},
               {"role": "tool", "tool_call_id": "c0", "content": "sunny"})
    for renders_tools in (False, True):
        engine, bodies = calling_sidecar(stream, renders_tools=renders_tools)
        asked = replace(request(history=history), tools=(WEATHER,), tool_choice="required", parallel_tool_calls=False)
        _, end = await one_shot(engine, asked, "Weather in Oslo?")
        assert isinstance(end, Finished) and end.finish_reason == "tool_calls"
        body = bodies[-1]
        assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"]) == ([WEATHER], "required", False)
        if renders_tools:
            assert body["messages"][:3] == list(history), "the template renders the tools and the calls"
        else:
            assert body["messages"][0]["role"] == "system" and "get_weather" in body["messages"][0]["content"]
            assert body["messages"][2] == {"role": "assistant", "content":
                                           '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>'}
        await engine.aclose()

    engine, bodies = calling_sidecar(stream, renders_tools=False)
    session = engine.open_session(replace(request(), tools=(WEATHER,)))
    await session.feed(text_chunks(b"Weather in Oslo?", 64))
    await session.end_input()
    events = [e async for e in session.events()]
    assert [e for e in events if not isinstance(e, Finished)] == [
        TextDelta(""), ToolCallDelta(0, "call_1", "get_weather", ""), ToolCallDelta(0, None, None, '{"city": "Oslo"}')]
    assert bodies[-1]["tool_choice"] == "auto"
    await engine.aclose()

    # Text that only looked like a call's start is told once the answer ends; none: no tools sent.
    words = sse(delta("If a"), delta(" <"), delta(" b then <"), delta("tool", finish="stop"), "[DONE]")
    engine, bodies = calling_sidecar(words, renders_tools=False)
    text, end = await one_shot(engine, replace(request(), tools=(WEATHER,)), "x")
    assert text == "If a < b then <tool" and isinstance(end, Finished) and end.finish_reason == "stop"
    await one_shot(engine, replace(request(), tools=(WEATHER,), tool_choice="none"), "x")
    assert "tools" not in bodies[-1] and "tool_choice" not in bodies[-1]
    await engine.aclose()


def refusing_sidecar(refusal: str) -> HttpEngine:
    """A sidecar that refuses every chat request with vLLM's 400 and ``refusal``."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 9})
        return httpx.Response(400, json={"error": {"message": refusal, "type": "BadRequestError", "param": None,
                                                   "code": 400}})

    return scripted_engine(handler)


#: vLLM's refusal of ``auto`` by a sidecar started without its tool flags.
NO_AUTO_TOOLS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


async def test_a_sidecars_call_to_an_undeclared_function_is_left_out_as_in_process() -> None:
    made_up = sse(delta(""), delta(calls=[{"index": 0, "id": "call_1", "type": "function", "function": {
        "name": "capital", "arguments": '{"country": "France"}'}}]), delta(calls=[], finish="tool_calls"), "[DONE]")
    engine, _ = calling_sidecar(made_up, renders_tools=True)
    session = engine.open_session(replace(request(), tools=(WEATHER,)))
    await session.feed(text_chunks(b"Capital of France?", 64))
    await session.end_input()
    events = [e async for e in session.events()]
    await engine.aclose()
    assert not [e for e in events if isinstance(e, ToolCallDelta)]
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop", "no call: OpenAI's stop"


async def test_a_sidecars_refusal_of_tools_is_an_invalid_request_in_its_words() -> None:
    engine = refusing_sidecar(NO_AUTO_TOOLS)
    _, end = await one_shot(engine, replace(request(), tools=(WEATHER,)), "x")
    await engine.aclose()
    assert end == EngineError(NO_AUTO_TOOLS, code="invalid_request", details={"upstream_status": 400})


def counting_sidecar(cards: list[dict[str, Any]], tokenize: Callable[[dict[str, Any]], httpx.Response],
                     ) -> httpx.AsyncClient:
    """A client of a sidecar with these model cards, whose ``/tokenize`` answers as ``tokenize`` says."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": cards})
        return tokenize(json.loads(request.content))

    return httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(handler))


async def test_a_sidecar_that_cannot_count_runs_uncounted_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """Not vLLM (no ``max_model_len`` in its cards, no ``/tokenize``): nothing is counted before it
    runs a request, as before the counter; one warning at start, none per request."""
    counted = httpx.Response(200, json={"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3]})
    for cards, tokenize in (([{"id": MODEL}], counted),
                            ([{"id": MODEL, "max_model_len": 2048}], httpx.Response(404, json={"detail": "Not Found"}))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="omni_adapter.http_engine"):
            async with counting_sidecar(cards, lambda _, reply=tokenize: reply) as client:
                assert await open_sidecar_counter(HttpEngineConfig(base_url="http://engine"), client) is None
        assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.text
        assert "prompts are not counted" in caplog.text


async def test_the_counter_has_the_sidecar_count_the_prompt_before_the_input() -> None:
    """The chat request a session sends, with its input still empty (and no answer so far), under
    the sidecar's own name; its refusals and failures in the port's terms."""
    bodies: list[dict[str, Any]] = []
    replies = iter([httpx.Response(200, json={"count": 5, "max_model_len": 2048, "tokens": [0] * 5}),
                    httpx.Response(200, json={"count": 42, "max_model_len": 2048, "tokens": [0] * 42}),
                    httpx.Response(400, json={"error": {"message": "bad template", "type": "BadRequestError",
                                                        "code": 400}}),
                    httpx.Response(503, json={"error": {"message": "busy", "code": 503}})])

    def tokenize(body: dict[str, Any]) -> httpx.Response:
        bodies.append(body)
        return next(replies)

    async with counting_sidecar([{"id": MODEL, "max_model_len": 2048}, {"id": "lora"}], tokenize) as client:
        counter = await open_sidecar_counter(HttpEngineConfig(base_url="http://engine"), client)
        assert counter is not None and counter.max_input_tokens == 2047
        asked = replace(request(), model="an-alias", input_role="system", assistant_prefix="Half an ans",
                        chat_template_kwargs={"enable_thinking": False})
        assert await counter.prompt_tokens(asked) == 42
        assert bodies[-1] == {"model": MODEL, "messages": [*asked.messages, {"role": "system", "content": ""}],
                              "chat_template_kwargs": {"enable_thinking": False}}
        with pytest.raises(EngineRejectedError, match="bad template"):
            await counter.prompt_tokens(request())
        with pytest.raises(EngineUnavailableError, match="busy"):
            await counter.prompt_tokens(request())
        await counter.aclose()  # a client it was given stays open
        assert not client.is_closed


def test_user_content_keeps_text_as_a_string_until_audio_arrives() -> None:
    content = UserContent()
    content.add(InputChunk(0, "text", "caf\u00e9 ".encode()[:4]))  # splits the é
    content.add(InputChunk(1, "text", "caf\u00e9 ".encode()[4:]))
    assert content.render() == "caf\u00e9 "
    content.add(InputChunk(2, "audio", wav_of(b"\x01\x00", 8000), format="wav"))
    content.add(InputChunk(3, "text", b"end"))
    content.finish()
    rendered = content.render()
    assert [part["type"] for part in rendered] == ["text", "input_audio", "text"]
    assert base64.b64decode(rendered[1]["input_audio"]["data"]) == wav_of(b"\x01\x00", 8000)
    with pytest.raises(EngineRejectedError):
        content.add(InputChunk(4, "audio", b"\x00" * 10, format="mp3"))
    with pytest.raises(EngineRejectedError):
        content.add(InputChunk(5, "audio", b"\x00" * 3, format="pcm16"))
