"""The session API over HTTP, with real Redis and the scripted engine.

Every error case of DESIGN.md section 2: status, envelope code, and the
session's state afterwards. The real-engine runs are in tests/integration.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import redis.asyncio as redis

from gateway import errors
from gateway.service.models import ChatMessage
from gateway.settings import Settings
from gateway.store.keys import session_keys
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse

MiB = 1024 * 1024


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url=redis_url, max_chunk_bytes=16 * MiB, max_payload_per_session=24 * MiB,
                    tend_interval_sec=0.05, max_out_of_order=8)


@pytest.fixture
async def client(settings: Settings, engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(settings, engine) as c:
        yield c


async def create(client: httpx.AsyncClient, **body: object) -> str:
    response = await client.post(BASE, json=body)
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


async def append(client: httpx.AsyncClient, sid: str, seq: int, text: str, **extra: object) -> httpx.Response:
    return await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": text, **extra})


async def view(client: httpx.AsyncClient, sid: str) -> dict:
    response = await client.get(f"{BASE}/{sid}")
    assert response.status_code == 200, response.text
    return response.json()


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert set(error) >= {"message", "type", "code", "param"}
    if param is not None:
        assert error["param"] == param
    return error


# --- happy paths -------------------------------------------------------------


async def test_streamed_session_produces_openai_frames_and_result(client: httpx.AsyncClient) -> None:
    sid = await create(client, messages=[{"role": "system", "content": "be brief"}])
    assert (await append(client, sid, 1, "world")).status_code == 202
    first = await append(client, sid, 0, "hello ")
    assert first.status_code == 202 and first.json()["started"] is True
    assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202

    body = (await client.get(f"{BASE}/{sid}/events")).text
    events = parse_sse(body)
    assert all(e.id for e in events)
    assert events[0].json()["choices"][0]["delta"] == {"role": "assistant"}
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    assert {e.json()["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert {e.json()["id"] for e in events[:-1]} == {sid}
    assert content_of(events) == "echo: hello world"

    result = await client.get(f"{BASE}/{sid}/result")
    assert result.status_code == 200
    completion = result.json()["completion"]
    assert completion["choices"][0]["message"]["content"] == "echo: hello world"
    assert completion["usage"]["total_tokens"] == completion["usage"]["prompt_tokens"] + 3


async def test_last_event_id_replays_exactly_the_rest(client: httpx.AsyncClient) -> None:
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "a b c", "end_of_input": True})
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    middle = events[2].id
    resumed = parse_sse((await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": middle})).text)
    assert [e.id for e in resumed] == [e.id for e in events[3:]]
    bad = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": "nonsense"})
    assert_error(bad, 400, "invalid_request", "Last-Event-ID")


async def test_resuming_after_the_final_frame_ends_at_once(client: httpx.AsyncClient) -> None:
    # Browsers' EventSource reconnects with the id of [DONE] by itself; each
    # reconnect used to stay open until the result expired (an hour).
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "a b", "end_of_input": True})
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].data == "[DONE]"
    for last_seen in (events[-1].id, "99999999999999-0"):
        async with asyncio.timeout(2):
            resumed = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": last_seen})
        assert resumed.status_code == 204, resumed.text  # EventSource stops reconnecting on 204
        assert resumed.content == b""


async def test_a_terminal_stream_without_a_final_frame_ends(client: httpx.AsyncClient,
                                                            engine: ScriptedEngine) -> None:
    # Cancelled before any output: a subscriber gets the error frame and the end, never a hang.
    engine.script = Script(hang=True)
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "x", "end_of_input": True})
    await asyncio.sleep(0.1)
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204
    async with asyncio.timeout(2):
        events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].event == "error"
    async with asyncio.timeout(2):
        after_error = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": events[-1].id})
    assert after_error.status_code == 204


async def test_a_last_event_id_past_a_live_streams_last_frame_is_400(client: httpx.AsyncClient, redis_url: str,
                                                                      engine: ScriptedEngine) -> None:
    # Such a stream sent nothing, then ended with the session without its final frame: an SDK took
    # that for a complete, empty answer.
    engine.script = Script(hang=True)
    sid = await create(client, start_policy="on_end_only")
    async with asyncio.timeout(2):  # (it was a stream that waited for the session's end)
        before_any = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": "99999999999999-0"})
    assert_error(before_any, 400, "invalid_request", "Last-Event-ID")
    await append(client, sid, 0, "a b c", end_of_input=True)
    async with redis.from_url(redis_url) as store:
        for _ in range(50):
            if entries := await store.xrevrange(session_keys(sid).output, count=1):
                break
            await asyncio.sleep(0.05)
    ms, seq = entries[0][0].decode().split("-")
    async with asyncio.timeout(2):
        past = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": f"{int(ms) + 60_000}-{seq}"})
    assert_error(past, 400, "invalid_request", "Last-Event-ID")
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204


@pytest.mark.parametrize("last_event_id", ["99999999999999999999-0", "1-99999999999999999999",
                                           "18446744073709551616-0", "²-0".encode(), "٣-0".encode(), "1-0-0", "-1-0"])
async def test_last_event_id_outside_the_stream_id_range_is_400(client: httpx.AsyncClient,
                                                                last_event_id: str | bytes) -> None:
    # Redis refuses ids past 2**64-1: that used to cut the SSE body midway.
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "a", "end_of_input": True})
    response = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": last_event_id})
    assert_error(response, 400, "invalid_request", "Last-Event-ID")


async def test_largest_valid_last_event_id_is_accepted(client: httpx.AsyncClient) -> None:
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "a", "end_of_input": True})
    parse_sse((await client.get(f"{BASE}/{sid}/events")).text)  # completed
    response = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": f"{2**64 - 1}-{2**64 - 1}"})
    assert response.status_code == 204


async def test_two_subscribers_see_the_same_stream(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    readers = [asyncio.create_task(client.get(f"{BASE}/{sid}/events")) for _ in range(2)]
    await asyncio.sleep(0.05)
    await append(client, sid, 0, "together", end_of_input=True)
    bodies = [(await r).text for r in readers]
    assert bodies[0] == bodies[1] and content_of(parse_sse(bodies[0])) == "echo: together"


async def test_raw_octet_stream_chunk(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    response = await client.post(
        f"{BASE}/{sid}/chunks", content=b"raw text",
        headers={"Content-Type": "application/octet-stream", "X-Sequence-Id": "0", "X-End-Of-Input": "true"})
    assert response.status_code == 202, response.text
    result = await client.get(f"{BASE}/{sid}/result", params={"wait": 5})
    assert result.json()["completion"]["choices"][0]["message"]["content"] == "echo: raw text"
    bad = await client.post(f"{BASE}/{sid}/chunks", content=b"x",
                            headers={"Content-Type": "application/octet-stream", "X-Sequence-Id": "-1"})
    assert_error(bad, 422, "validation_error", "X-Sequence-Id")


async def test_result_polls_with_202_then_200(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    pending = await client.get(f"{BASE}/{sid}/result")
    assert pending.status_code == 202 and pending.headers["retry-after"] == "1"
    assert pending.json()["state"] == "open"
    waiter = asyncio.create_task(client.get(f"{BASE}/{sid}/result", params={"wait": 10}))
    await asyncio.sleep(0.1)
    await append(client, sid, 0, "late", end_of_input=True)
    done = await waiter
    assert done.status_code == 200 and done.json()["state"] == "completed"


async def test_start_policies(client: httpx.AsyncClient) -> None:
    end_only = await create(client, start_policy="on_end_only")
    assert (await append(client, end_only, 0, "x" * 100)).json()["state"] == "open"
    by_bytes = await create(client, start_policy="on_min_length", min_length={"bytes": 8})
    assert (await append(client, by_bytes, 0, "1234")).json()["state"] == "open"
    second = await append(client, by_bytes, 1, "5678")
    assert second.json()["state"] == "streaming" and second.json()["started"]
    by_chunks = await create(client, start_policy="on_min_length", min_length={"chunks": 2})
    assert (await append(client, by_chunks, 0, "a")).json()["state"] == "open"
    assert (await append(client, by_chunks, 1, "b")).json()["state"] == "streaming"
    view_ = await view(client, by_chunks)
    assert view_["start_policy"] == "on_min_length" and view_["owner"]


# --- ordering and dedupe -----------------------------------------------------


async def test_duplicate_conflict_and_window(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    assert (await append(client, sid, 0, "same")).status_code == 202
    dup = await append(client, sid, 0, "same")
    assert dup.status_code == 200 and dup.json()["duplicate"] is True
    assert_error(await append(client, sid, 0, "different"), 409, "sequence_conflict", "sequence_id")
    assert_error(await append(client, sid, 9, "far"), 409, "sequence_out_of_window", "sequence_id")
    state = await view(client, sid)
    assert state["received_chunks"] == 1 and state["buffered_bytes"] == 4 and state["state"] == "open"


async def test_finish_reports_missing_ids_and_is_idempotent(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    await append(client, sid, 0, "a")
    await append(client, sid, 2, "c")
    # An end before a chunk already received: the input is still open, and the field is named.
    early = assert_error(await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 1}), 409,
                         "sequence_conflict")
    assert early["param"] == "final_sequence_id" and "below" in early["message"], early
    finish = await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 3})
    assert finish.status_code == 202 and finish.json()["missing_sequence_ids"] == [1, 3]
    assert (await view(client, sid))["missing_sequence_ids"] == [1, 3]
    again = await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 3})
    assert again.status_code == 202 and again.json()["missing_sequence_ids"] == [1, 3]
    closed = assert_error(await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 5}), 409,
                          "input_closed")
    assert closed["param"] == "final_sequence_id", closed
    assert_error(await append(client, sid, 4, "beyond"), 409, "input_closed")
    await append(client, sid, 1, "b")
    await append(client, sid, 3, "d")
    result = await client.get(f"{BASE}/{sid}/result", params={"wait": 5})
    assert result.json()["completion"]["choices"][0]["message"]["content"] == "echo: abcd"
    assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202


async def test_append_after_end_of_input_is_refused(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    await append(client, sid, 0, "all", end_of_input=True)
    assert_error(await append(client, sid, 1, "more"), 409, "input_closed")


# --- malformed input ---------------------------------------------------------


async def test_malformed_bodies(client: httpx.AsyncClient) -> None:
    bad_json = await client.post(BASE, content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(bad_json, 400, "invalid_json")
    assert_error(await client.post(BASE, json={"surprise": 1}), 422, "validation_error", "surprise")
    sid = await create(client)
    url = f"{BASE}/{sid}/chunks"
    assert_error(await client.post(url, content=b"{", headers={"Content-Type": "application/json"}),
                 400, "invalid_json")
    assert_error(await client.post(url, json={"sequence_id": 0, "payload": "@@not base64@@"}),
                 422, "invalid_payload", "payload")
    assert_error(await client.post(url, json={"sequence_id": -1, "text": "x"}),
                 422, "validation_error", "sequence_id")
    assert_error(await client.post(url, json={"sequence_id": 1.5, "text": "x"}),
                 422, "validation_error", "sequence_id")
    assert_error(await client.post(url, json={"sequence_id": "1", "text": "x"}),
                 422, "validation_error", "sequence_id")
    assert_error(await client.post(url, json={"sequence_id": 0, "modality": "smell", "payload": "eA=="}),
                 422, "validation_error", "modality")
    assert_error(await client.post(url, json={"sequence_id": 0, "text": "x", "extra": 1}),
                 422, "validation_error", "extra")
    assert_error(await client.post(url, json={"sequence_id": 0, "text": "x", "end_of_input": "yes"}),
                 422, "validation_error", "end_of_input")
    assert_error(await client.post(url, content=b"x", headers={"Content-Type": "text/plain"}),
                 400, "invalid_request", "Content-Type")
    state = await view(client, sid)
    assert state["state"] == "open" and state["received_chunks"] == 0


def wav_header_with_rate(rate: int, frames: bytes = b"\x00\x00" * 8) -> bytes:
    """A WAV file as a buggy encoder writes it (``wave`` refuses to write a rate of 0)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(frames)) + frames
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(("headers", "param"), [
    ({"X-Sequence-Id": "²".encode("latin-1")}, "X-Sequence-Id"),  # str.isdigit() says yes, int() says no
    ({"X-Sequence-Id": "٣".encode()}, "X-Sequence-Id"),  # Arabic-Indic three
    ({"X-Sequence-Id": "١".encode()}, "X-Sequence-Id"),
    ({"X-Sequence-Id": "+1"}, "X-Sequence-Id"),
    ({"X-Sequence-Id": " 1"}, "X-Sequence-Id"),
    ({"X-Sequence-Id": "1" * 40}, "X-Sequence-Id"),
    ({"X-Sequence-Id": ""}, "X-Sequence-Id"),
    ({"X-Sequence-Id": "0", "X-Modality": "audio", "X-Sample-Rate": "0"}, "X-Sample-Rate"),
    ({"X-Sequence-Id": "0", "X-Modality": "audio", "X-Sample-Rate": "²".encode("latin-1")}, "X-Sample-Rate"),
    ({"X-Sequence-Id": "0", "X-Modality": "audio", "X-Sample-Rate": str(10**12)}, "X-Sample-Rate"),
    ({"X-Sequence-Id": "0", "X-End-Of-Input": "yes"}, "X-End-Of-Input"),
])
async def test_odd_raw_chunk_headers_are_422_not_500(client: httpx.AsyncClient, headers: dict,
                                                     param: str) -> None:
    sid = await create(client)
    raw = {"Content-Type": "application/octet-stream", **headers}
    assert_error(await client.post(f"{BASE}/{sid}/chunks", content=b"x", headers=raw), 422,
                 "validation_error", param)
    assert (await view(client, sid))["received_chunks"] == 0


@pytest.mark.parametrize("wav", [wav_header_with_rate(0), wav_header_with_rate(1), b"RIFF\x00\x00garbage labelled as wav"],
                         ids=["rate-0", "rate-1", "garbage"])
async def test_broken_wav_is_422_at_append(client: httpx.AsyncClient, wav: bytes) -> None:
    sid = await create(client)
    for response in (
        await client.post(f"{BASE}/{sid}/chunks", content=wav, headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "0", "X-Modality": "audio",
            "X-Format": "wav"}),
        await client.post(f"{BASE}/{sid}/chunks", json={
            "sequence_id": 0, "modality": "audio", "format": "wav", "payload": base64.b64encode(wav).decode()}),
    ):
        assert_error(response, 422, "invalid_payload", "payload")
    assert (await view(client, sid))["received_chunks"] == 0


@pytest.mark.parametrize("audio_format", ["mp3", "zzz"])
async def test_audio_in_a_format_no_engine_reads_is_422_at_append_and_loses_nothing(
        settings: Settings, audio_format: str) -> None:
    """It was taken (202), and failed the whole session once its input was complete."""
    hears = ScriptedEngine(capabilities=replace(text_capabilities(), input_modalities=frozenset({"text", "audio"})))
    async with app_client(settings, hears) as client:
        await audio_in_an_unread_format(client, audio_format)


async def audio_in_an_unread_format(client: httpx.AsyncClient, audio_format: str) -> None:
    sid = await create(client)
    pcm = b"\x00\x01" * 1600
    assert (await client.post(f"{BASE}/{sid}/chunks", json={
        "sequence_id": 0, "modality": "audio", "format": "pcm16", "payload": base64.b64encode(pcm).decode()}
    )).status_code == 202
    for response in (
        await client.post(f"{BASE}/{sid}/chunks", content=b"notmp3", headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "1", "X-Modality": "audio",
            "X-Format": audio_format}),
        await client.post(f"{BASE}/{sid}/chunks", json={
            "sequence_id": 1, "modality": "audio", "format": audio_format,
            "payload": base64.b64encode(b"notmp3").decode()}),
        await client.post(f"{BASE}/{sid}/chunks", json={
            "sequence_id": 1, "modality": "audio", "sample_rate": 10**12, "payload": base64.b64encode(pcm).decode()}),
    ):
        assert response.status_code == 422, response.text
    state = await view(client, sid)
    assert state["state"] == "streaming" and state["received_chunks"] == 1


async def test_a_wrong_method_is_405_with_allow(client: httpx.AsyncClient) -> None:
    response = await client.put(BASE)
    assert_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"


async def test_modality_the_engine_cannot_take_is_refused_at_append(client: httpx.AsyncClient) -> None:
    sid = await create(client)
    audio = base64.b64encode(b"\x00\x01" * 160).decode()
    response = await client.post(f"{BASE}/{sid}/chunks",
                                 json={"sequence_id": 0, "modality": "audio", "payload": audio})
    assert_error(response, 422, "unsupported_modality", "modality")
    assert (await view(client, sid))["received_chunks"] == 0
    assert_error(await client.post(BASE, json={"modalities": ["text", "audio"]}),
                 422, "unsupported_modality", "modalities")
    assert_error(await client.post(BASE, json={"model": "gpt-9"}), 404, "model_not_found", "model")


async def test_chunk_over_the_cap_is_refused_and_session_stays(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    big = base64.b64encode(b"x" * (20 * MiB)).decode()
    assert_error(await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "payload": big}),
                 413, "request_too_large")
    raw = await client.post(f"{BASE}/{sid}/chunks", content=b"x" * (20 * MiB),
                            headers={"Content-Type": "application/octet-stream", "X-Sequence-Id": "0"})
    assert_error(raw, 413, "chunk_too_large")
    assert (await view(client, sid))["state"] == "open"
    assert (await append(client, sid, 0, "fine")).status_code == 202


async def test_session_cap_closes_the_session(client: httpx.AsyncClient) -> None:
    sid = await create(client, start_policy="on_end_only")
    ten_mib = b"x" * (10 * MiB)
    raw = {"Content-Type": "application/octet-stream"}
    for seq in (0, 1):
        ok = await client.post(f"{BASE}/{sid}/chunks", content=ten_mib, headers={**raw, "X-Sequence-Id": str(seq)})
        assert ok.status_code == 202
    over = await client.post(f"{BASE}/{sid}/chunks", content=ten_mib, headers={**raw, "X-Sequence-Id": "2"})
    assert_error(over, 413, "payload_too_large")
    assert (await view(client, sid))["state"] == "failed"
    assert_error(await append(client, sid, 3, "more"), 409, "session_closed")
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert [(e.event, e.json()["error"]["code"]) for e in events] == [("error", "payload_too_large")]
    result = (await client.get(f"{BASE}/{sid}/result")).json()
    assert result["state"] == "failed" and result["error"]["code"] == "payload_too_large"


# --- lifetime ----------------------------------------------------------------


async def test_unknown_session_is_404_everywhere(client: httpx.AsyncClient) -> None:
    sid = "sis-does-not-exist"
    for response in (
        await client.get(f"{BASE}/{sid}"),
        await append(client, sid, 0, "x"),
        await client.post(f"{BASE}/{sid}/finish"),
        await client.get(f"{BASE}/{sid}/events"),
        await client.get(f"{BASE}/{sid}/result"),
        await client.delete(f"{BASE}/{sid}"),
    ):
        assert_error(response, 404, "session_not_found")


async def test_idle_session_expires_and_aborts_engine_work(
    redis_url: str, engine: ScriptedEngine,
) -> None:
    settings = make_settings(redis_url=redis_url, session_timeout_sec=0.3, tend_interval_sec=0.05)
    async with app_client(settings, engine) as client:
        sid = await create(client)
        await append(client, sid, 0, "started")
        assert (await view(client, sid))["state"] == "streaming"
        await asyncio.sleep(0.8)
        for response in (await client.get(f"{BASE}/{sid}"), await append(client, sid, 1, "late"),
                         await client.post(f"{BASE}/{sid}/finish"), await client.get(f"{BASE}/{sid}/result")):
            assert_error(response, 410, "session_expired")
        assert engine.sessions[0].aborted


async def test_gaps_at_timeout_fail_the_session_with_the_missing_ids(redis_url: str, engine: ScriptedEngine) -> None:
    settings = make_settings(redis_url=redis_url, session_timeout_sec=0.3, tend_interval_sec=0.05)
    async with app_client(settings, engine) as client:
        sid = await create(client, start_policy="on_end_only")
        await append(client, sid, 0, "a")
        await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 2})
        await asyncio.sleep(0.8)
        result = (await client.get(f"{BASE}/{sid}/result")).json()
        assert result["state"] == "failed"
        assert result["error"]["code"] == "incomplete_input"
        assert result["error"]["missing_sequence_ids"] == [1, 2]


async def test_cancel_aborts_engine_and_closes_input(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = Script(hang=True)
    sid = await create(client)
    await append(client, sid, 0, "thinking", end_of_input=True)
    await asyncio.sleep(0.1)
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204
    assert (await client.delete(f"{BASE}/{sid}")).status_code == 204
    await asyncio.sleep(0.1)
    assert engine.sessions[0].aborted
    assert_error(await append(client, sid, 1, "after"), 409, "session_closed")
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].event == "error" and events[-1].json()["error"]["code"] == "session_cancelled"
    assert (await view(client, sid))["state"] == "cancelled"


async def test_engine_failure_mid_stream_sends_error_event(client: httpx.AsyncClient, engine: ScriptedEngine,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    engine.script = Script(error_after_words=2)
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "one two three", "end_of_input": True})
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[0].json()["choices"][0]["delta"] == {"role": "assistant"}
    assert events[-1].event == "error" and events[-1].json()["error"]["code"] == "engine_error"
    assert "[DONE]" not in [e.data for e in events]
    assert (await view(client, sid))["state"] == "failed"
    assert any(sid in r.getMessage() and "engine_error" in r.getMessage() for r in caplog.records), \
        "the replica's log says why the session failed"


async def test_an_answer_that_stops_making_progress_fails_with_engine_timeout(
        redis_url: str, engine: ScriptedEngine) -> None:
    # A stuck engine request used to leave the session generating forever.
    engine.script = Script(hang=True)
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05, engine_progress_timeout_sec=0.4)
    async with app_client(settings, engine) as client:
        sid = await create(client, first_chunk={"sequence_id": 0, "text": "a b", "end_of_input": True})
        async with asyncio.timeout(5):
            events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
        assert content_of(events) == "echo: a b"  # what came before the stall stays
        assert events[-1].event == "error" and events[-1].json()["error"]["code"] == "engine_timeout"
        result = (await client.get(f"{BASE}/{sid}/result")).json()
        assert result["state"] == "failed" and result["error"]["code"] == "engine_timeout"
        assert engine.sessions[0].aborted


async def test_a_slow_but_moving_answer_is_not_timed_out(redis_url: str, engine: ScriptedEngine) -> None:
    engine.script = Script(word_delay_sec=0.15)
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05, engine_progress_timeout_sec=0.4)
    async with app_client(settings, engine) as client:
        sid = await create(client, first_chunk={"sequence_id": 0, "text": "a b c d e", "end_of_input": True})
        events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
        assert events[-1].data == "[DONE]"  # 1 s in all, but never 0.4 s without a word


async def test_an_adapter_that_raises_fails_its_session_at_once(
        client: httpx.AsyncClient, engine: ScriptedEngine, caplog: pytest.LogCaptureFixture) -> None:
    engine.script = Script(crash_after_words=1)
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "a b", "end_of_input": True})
    async with asyncio.timeout(5):
        events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert events[-1].event == "error"
    assert (await view(client, sid))["state"] == "failed"
    assert any(sid in r.getMessage() and r.exc_info for r in caplog.records)


# --- operations --------------------------------------------------------------


async def test_health_readiness_and_metrics(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).status_code == 200
    # vLLM's probes, as `vllm serve` answers them: an empty 200 while the engine is healthy.
    for probe in (client.get("/health"), client.get("/ping"), client.post("/ping")):
        answer = await probe
        assert answer.status_code == 200 and answer.content == b""
    assert (await client.get("/version")).json() == {"version": importlib.metadata.version("omni-gateway")}
    engine.healthy = False
    assert_error(await client.get("/readyz"), 503, "engine_unavailable")
    assert_error(await client.get("/health"), 503, "engine_unavailable")
    sid = await create(client, start_policy="on_end_only")
    await append(client, sid, 0, "count me")
    await append(client, sid, 0, "count me")
    metrics = (await client.get("/metrics")).text
    assert 'omni_gateway_chunks_total{modality="text",outcome="accepted"} 1.0' in metrics
    assert 'omni_gateway_chunks_total{modality="text",outcome="duplicate"} 1.0' in metrics
    assert 'omni_gateway_sessions{state="open"} 1.0' in metrics
    assert "omni_gateway_append_latency_seconds_count 2.0" in metrics
    response = await client.get(f"{BASE}/{sid}")
    assert response.headers["x-request-id"]


async def test_store_outage_is_503_with_envelope(engine: ScriptedEngine) -> None:
    from tests.redis_server import free_port

    settings = make_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_sec=0.5)
    async with app_client(settings, engine) as client:
        response = await client.post(BASE, json={})
        assert_error(response, 503, "store_unavailable")
        assert response.headers["retry-after"] == "1"
        assert_error(await client.get("/readyz"), 503, "store_unavailable")


async def test_disabled_service_refuses_sessions(redis_url: str, engine: ScriptedEngine) -> None:
    async with app_client(make_settings(redis_url=redis_url, enabled=False), engine) as client:
        assert_error(await client.post(BASE, json={}), 503, "streaming_input_disabled")


def test_a_stored_context_overflow_reads_back_as_the_413_it_was() -> None:
    # Two classes share the code: the chat doors' 400 is said at once, never stored.
    stored = errors.ContextLengthExceeded("too long", param="sequence_id").envelope()
    assert errors.from_envelope(stored).status_code == 413


def test_a_plain_history_message_dumps_as_before_the_sdk_fields_were_taken() -> None:
    # A create's idempotency digest is of the dump: replicas of the earlier release compute it too.
    plain = ChatMessage(role="user", content="hi").model_dump()
    assert list(plain) == ["role", "content", "name", "tool_calls", "tool_call_id"]
    assert ChatMessage(role="assistant", content=None, refusal="no").model_dump()["refusal"] == "no"


def test_envelope_types_are_json_serializable() -> None:
    from gateway import errors

    assert json.loads(json.dumps(errors.SessionNotFound("x").envelope()))["error"]["code"] == "session_not_found"


async def test_heartbeats_keep_an_idle_stream_alive(redis_url: str) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=1.2))
    async with app_client(make_settings(redis_url=redis_url, sse_ping_sec=1), engine) as client:
        sid = await create(client, first_chunk={"sequence_id": 0, "text": "slow", "end_of_input": True})
        body = (await client.get(f"{BASE}/{sid}/events")).text
    assert ": ping" in body
    assert content_of(parse_sse(body)) == "echo: slow"


async def test_engine_refusing_a_session_fails_it_instead_of_leaving_it_running(
    client: httpx.AsyncClient, engine: ScriptedEngine,
) -> None:
    from omni_adapter.port import EngineRejectedError

    engine.refuse_with = EngineRejectedError("sampling options the engine refuses")
    sid = await create(client, first_chunk={"sequence_id": 0, "text": "hi", "end_of_input": True})
    result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 5})).json()
    assert result["state"] == "failed" and result["error"]["code"] == "validation_error"
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert [e.event for e in events] == ["error"]
