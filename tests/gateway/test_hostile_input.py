"""Hostile input never freezes the event loop (issue 29, item 3), nor is it a server error.

Every way input comes in (an NDJSON upload, Realtime frames, chunk bodies,
SSE resume headers) gets the worst a client can send inside the limits,
while a watchdog on the server's loop measures how late a 10 ms timer
fires: the loop must stay within 50 ms. The server runs on this test's
loop (uvicorn on loopback, real sockets); the hostile client runs in a
thread of its own, so its own work is not counted against the server. As
the CLI's server does at start, what was loaded is put out of the garbage
collector's reach (``gc.freeze``), so a full collection of the test
process's heap is not measured either.

A lone surrogate (JSON's ``\\ud800``, a text UTF-8 cannot hold) anywhere in a
request is the client's error, named by its place, before any engine work;
an error that is the server's names the request's id, as its answer says.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
from asgi_lifespan import LifespanManager
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.api.upload.lines import MAX_BLANK_LINES
from gateway.runtime.app import create_app
from gateway.settings import Settings
from gateway.web.middleware.request_id import RequestIdLogFilter
from omni_adapter.port import Engine, EngineRejectedError, EngineRequest, SamplingOptions
from omni_adapter.scripted import ScriptedEngine
from omni_adapter.vllm_engine import VllmEngine
from tests.gateway.client import BASE, app_client, live_app, make_settings
from tests.gateway.test_api import assert_error
from tests.loop_lag import assert_loop_keeps_up

UPLOAD = "/v1/streaming_input/upload"
NDJSON = {"Content-Type": "application/x-ndjson"}
KiB = 1024
#: The issue's bound on the loop's lateness under hostile input.
MAX_LAG_SEC = 0.05


@pytest.fixture
async def served(redis_url: str) -> AsyncIterator[str]:
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url:
        gc.collect()
        gc.freeze()
        try:
            yield url
        finally:
            gc.unfreeze()


async def server_keeps_up(hostile_client: Callable[[], object]) -> None:
    """Run the client (blocking code) in a thread while the server's loop is watched."""
    await assert_loop_keeps_up(lambda: asyncio.to_thread(hostile_client), bound_sec=MAX_LAG_SEC)


async def new_session(url: str, body: dict[str, object]) -> str:
    async with httpx.AsyncClient(base_url=url) as client:
        sid: str = (await client.post(BASE, json=body)).json()["session_id"]
    return sid


def upload(url: str, body: bytes) -> httpx.Response:
    def pieces() -> Iterator[bytes]:
        yield json.dumps({"start_policy": "on_end_only"}).encode() + b"\n"
        for i in range(0, len(body), 64 * KiB):
            yield body[i:i + 64 * KiB]

    return httpx.post(url + UPLOAD, content=pieces(), headers=NDJSON, timeout=30)


async def test_blank_lines_in_an_upload(served: str) -> None:
    def blank_flood() -> None:  # 256 KiB of blank lines (1.2 s of a frozen loop once)
        assert "blank lines in a row" in upload(served, b"\n" * (256 * KiB)).text

    def records_between_blank_runs() -> None:  # as many blank lines as allowed before each record
        body = b"".join(b"\n" * MAX_BLANK_LINES + json.dumps(
            {"sequence_id": i, "text": "x ", "end_of_input": i == 39}).encode() + b"\n" for i in range(40))
        response = upload(served, body)
        assert response.status_code == 200 and "[DONE]" in response.text, response.text

    await server_keeps_up(blank_flood)
    await server_keeps_up(records_between_blank_runs)


async def test_chunk_bodies(served: str) -> None:
    sid = await new_session(served, {"start_policy": "on_end_only"})

    # Made before the watch: the client's own work holds the interpreter too.
    payload = b"word " * (16 * KiB * KiB // 5)
    as_json = json.dumps({"sequence_id": 0, "payload": base64.b64encode(payload).decode()}).encode()

    def big_chunks() -> None:  # a 16 MiB chunk (the cap): base64 in JSON, and raw
        sid = httpx.post(served + BASE, json={"start_policy": "on_end_only"}).json()["session_id"]
        chunks = f"{served}{BASE}/{sid}/chunks"
        json_chunk = httpx.post(chunks, content=as_json, timeout=60, headers={"Content-Type": "application/json"})
        assert json_chunk.status_code == 202, json_chunk.text
        raw = httpx.post(chunks, content=payload, timeout=60, headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "1"})
        assert raw.status_code == 202, raw.text

    def deeply_nested() -> None:
        deep = b"[" * 100_000 + b"]" * 100_000
        response = httpx.post(f"{served}{BASE}/{sid}/chunks", content=b'{"sequence_id": 0, "text": ' + deep + b"}",
                              headers={"Content-Type": "application/json"})
        assert response.status_code in (400, 422), response.text

    await server_keeps_up(big_chunks)
    await server_keeps_up(deeply_nested)


async def test_sse_resume_headers(served: str) -> None:
    sid = await new_session(served, {})

    def hostile_ids() -> None:
        with httpx.Client(base_url=served) as client:
            for _ in range(20):
                for value in ("9" * 15_000, "1-" * 7_000, "0-" + "0" * 15_000):
                    response = client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": value})
                    assert response.status_code == 400, response.text

    await server_keeps_up(hostile_ids)


async def test_realtime_frames(served: str) -> None:
    cap = Settings().realtime_max_event_bytes
    frames = (
        "[" * 100_000 + "]" * 100_000,  # nesting deeper than any parser's recursion
        json.dumps({"type": "input_audio_buffer.append",  # half a minute of silence in one event
                    "audio": base64.b64encode(bytes(cap * 3 // 4 - 4 * KiB)).decode()}),
        json.dumps({"type": "no.such.event", "event_id": "x" * (cap - KiB)}),
    )
    ws_url = served.replace("http", "ws") + "/v1/realtime"

    def oversized_frame() -> None:  # refused before it is read: the socket closes
        with connect(ws_url, max_size=None) as ws:
            assert json.loads(ws.recv())["type"] == "session.created"
            ws.send("x" * (8 * cap))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

    def hostile_frames() -> None:
        with connect(ws_url, max_size=None) as ws:
            assert json.loads(ws.recv())["type"] == "session.created"
            for n, frame in enumerate(frames):
                ws.send(frame)
                # Audio gets no answer of its own: a probe after each frame says it was dealt with.
                ws.send(json.dumps({"type": "no.such.event", "event_id": f"probe-{n}"}))
                while (reply := json.loads(ws.recv()))["type"] != "error" or \
                        reply["error"].get("event_id") != f"probe-{n}":
                    assert reply["type"] != "error" or reply["error"]["code"] != "internal_error", reply

    await server_keeps_up(hostile_frames)
    await server_keeps_up(oversized_frame)


@pytest.mark.engine
async def test_a_history_of_many_short_messages(redis_url: str, vllm_engine: Engine) -> None:
    """5,000 one-letter messages are refused as longer than the context, and the loop stays free
    meanwhile: the template's rendering was split back into messages with one alternation of every
    message's key, quadratic, which held the interpreter for 4 s at 5,000 (a replica's /health went
    unanswered for minutes at 200,000). More than 10,000 are refused before they are read."""
    def many(count: int) -> dict[str, object]:
        return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "a"}] * count}

    async with live_app(make_settings(redis_url=redis_url), vllm_engine) as url:
        answers: list[httpx.Response] = []

        def ask() -> None:
            answers.append(httpx.post(url + "/v1/chat/completions", json=many(5_000), timeout=60))

        await server_keeps_up(ask)
        assert answers[-1].status_code == 400 and answers[-1].json()["error"]["code"] == "context_length_exceeded"
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for path, body in (("/v1/chat/completions", many(10_001)), (BASE, many(10_001)),
                               ("/v1/responses", {"input": many(10_001)["messages"]})):
                refused = (await client.post(path, json=body)).json()["error"]
                assert "at most 10,000" in refused["message"], (path, refused)


#: A lone surrogate: ``json.dumps`` writes it as JSON's ``\\ud800`` escape, which parses back into it.
LONE = "a\ud800b"
USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
#: (path, body, where the lone surrogate is): each text a request carries.
SURROGATES: list[tuple[str, dict[str, object], str]] = [
    (BASE, {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    (BASE, {"messages": [{"role": "system", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    (BASE, {"messages": [USER, {"role": "assistant", "refusal": LONE}]}, "messages.1.refusal"),
    (BASE, {"messages": [USER, {"role": "assistant", "audio": {"id": "a", "transcript": LONE}}]},
     "messages.1.audio.transcript"),
    (BASE, {"messages": [USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '{"a": "' + LONE + '"}'}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    (BASE, {"messages": [{**USER, "name": LONE}]}, "messages.0.name"),
    (BASE, {"tools": [{"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools.0.function.description"),
    (BASE, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": LONE}}}}}]},
     "tools.0.function.parameters.properties.x.description"),
    (BASE, {"stop": [LONE]}, "stop.0"),
    (BASE, {"first_chunk": {"sequence_id": 0, "text": LONE}}, "first_chunk.text"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": LONE}, USER]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": LONE}, USER]},
     "messages.1.content"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "c1", "content": LONE}, USER]},
     "messages.2.content"),
    ("/v1/chat/completions", {"messages": [USER], "structured_outputs": {"choice": ["yes", LONE]}},
     "structured_outputs.choice.1"),
    ("/v1/responses", {"instructions": LONE, "input": "hi"}, "instructions"),
    ("/v1/responses", {"input": [USER, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": LONE}]}, USER]}, "input.1.message.content.0.output_text.text"),
    ("/v1/responses", {"input": [USER, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": LONE},
                                 {"type": "function_call_output", "call_id": "c1", "output": "1"}]},
     "input.1.function_call.arguments"),
    ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": LONE}, "input"),
    ("/v1/realtime/client_secrets", {"session": {"type": "realtime", "instructions": LONE}}, "session.instructions"),
]


async def test_a_lone_surrogate_anywhere_is_the_clients_error_named_by_its_place(redis_url: str) -> None:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        for path, body, where in SURROGATES:
            sent = {"max_tokens": 2, **body} if path in (BASE, "/v1/chat/completions") else body
            response = await client.post(path, content=json.dumps(sent), headers={"Content-Type": "application/json"})
            error = assert_error(response, 422 if path == BASE else 400, "invalid_payload", where)
            assert error["message"] == f"{where} is not valid Unicode (a lone surrogate)", (path, body)
        call = await client.post("/v1/realtime/calls", files={  # a WebRTC call's form, as the SDK sends it
            "sdp": (None, "v=0\r\nm=audio 9"), "session": (None, json.dumps({"instructions": LONE}))})
        assert_error(call, 400, "invalid_payload", "session.instructions")
    assert engine.sessions == [], "refused before any engine work"


async def test_a_server_error_names_its_request_id(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Starlette answers an error no handler took outside every middleware: the 500 still carries
    the request's id, in its header and its log line, as its message says."""
    app = create_app(make_settings(redis_url=redis_url), engine=ScriptedEngine())

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    caplog.handler.addFilter(RequestIdLogFilter())  # (as the CLI's log handler has it)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            named = await client.get("/broken", headers={"X-Request-Id": "req-42"})
            unnamed = await client.get("/broken")
    for response in (named, unnamed):
        assert_error(response, 500, "internal_error")
        assert "request id is in the logs" in response.json()["error"]["message"]
    assert named.headers["x-request-id"] == "req-42" and len(unnamed.headers["x-request-id"]) == 32
    logged = [r for r in caplog.records if r.name == "gateway.web.error_handlers"]
    assert [getattr(r, "request_id", None) for r in logged] == ["req-42", unnamed.headers["x-request-id"]]
    assert all(r.exc_info for r in logged), "with its traceback"


@pytest.mark.engine
async def test_a_lone_surrogate_in_the_history_on_the_real_engine(redis_url: str, vllm_engine: VllmEngine) -> None:
    """Refused at validation (a 400, not the tokenizer's TypeError as a 500); and the engine's own
    checks, should such a text reach them, refuse it as the client's."""
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as client:
        response = await client.post("/v1/chat/completions", content=json.dumps({
            "max_tokens": 2, "messages": [{"role": "system", "content": LONE}, USER]}),
            headers={"Content-Type": "application/json"})
        assert_error(response, 400, "invalid_payload", "messages.0.content")
        fine = await client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "system", "content": "Be brief ☃."}, USER]})
        assert fine.status_code == 200, fine.text
    request = EngineRequest(request_id="r", model=vllm_engine.capabilities.model_names[0],
                            messages=({"role": "system", "content": LONE},), sampling=SamplingOptions())
    with pytest.raises(EngineRejectedError, match="not valid Unicode"):
        vllm_engine.check_request(request)
    for encode in (vllm_engine._streaming.encode_plain, vllm_engine._streaming.encode):  # client's, trusted
        with pytest.raises(EngineRejectedError, match="not valid Unicode"):
            encode(LONE)
