"""Mode A: one streamed upload in (NDJSON records), the session's SSE answer out.

Real sockets (uvicorn on loopback): httpx streams a generator body, curl
uploads with ``Transfer-Encoding: chunked`` from its stdin. The session
starts while the body is still arriving, and an upload that breaks off or
has a record refused leaves a session that Mode B calls continue.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, content_of, live_app, make_settings, parse_sse

UPLOAD = "/v1/streaming_input/upload"
NDJSON = {"Content-Type": "application/x-ndjson"}


def line(record: dict) -> bytes:
    return json.dumps(record).encode() + b"\n"


@pytest.fixture
async def served(redis_url: str) -> AsyncIterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), engine) as url:
        yield url, engine


async def until_fed(engine: ScriptedEngine, chunks: int) -> None:
    async with asyncio.timeout(10):
        while not engine.sessions or len(engine.sessions[0].fed) < chunks:  # noqa: ASYNC110 - no event to wait on
            await asyncio.sleep(0.02)


async def test_the_session_starts_while_the_upload_is_still_arriving(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served

    async def body() -> AsyncIterator[bytes]:
        yield line({"start_policy": "on_first_chunk"})
        yield line({"sequence_id": 0, "text": "streamed "})
        await until_fed(engine, 1)  # the engine has the first chunk before the second is sent
        yield line({"sequence_id": 1, "text": "upload", "end_of_input": True})

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(UPLOAD, content=body(), headers=NDJSON)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert content_of(events) == "echo: streamed upload" and events[-1].data == "[DONE]"
    sid = response.headers["X-Session-Id"]
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get(f"{BASE}/{sid}/result")).json()["state"] == "completed"


async def test_curl_uploads_with_chunked_transfer_encoding(served: tuple[str, ScriptedEngine]) -> None:
    url, _ = served
    records = b"".join([line({}), line({"sequence_id": 0, "text": "from curl", "end_of_input": True})])
    done = await asyncio.to_thread(subprocess.run, [
        "curl", "-sS", "-v", "-N", "-T", "-", "-X", "POST", "-H", "Content-Type: application/x-ndjson",
        "-D", "-", f"{url}{UPLOAD}"], input=records, capture_output=True, timeout=60, check=True)
    *heads, body = done.stdout.decode().split("\r\n\r\n", maxsplit=2)  # "100 Continue", then the answer's
    assert "> transfer-encoding: chunked" in done.stderr.decode().lower()  # curl -T - streams its stdin
    assert "x-session-id: sis-" in heads[-1].lower()
    assert content_of(parse_sse(body)) == "echo: from curl"


async def test_a_refused_record_ends_the_stream_and_mode_b_continues(served: tuple[str, ScriptedEngine]) -> None:
    url, _ = served
    records = [line({}), line({"sequence_id": 0, "text": "kept "}), line({"sequence_id": 0, "text": "other"})]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(UPLOAD, content=b"".join(records), headers=NDJSON)
        error = parse_sse(response.text)[-1]
        assert error.event == "error"
        assert error.json()["error"]["code"] == "sequence_conflict" and error.json()["error"]["param"].startswith("line 3")
        sid = response.headers["X-Session-Id"]
        view = (await client.get(f"{BASE}/{sid}")).json()
        assert view["received_chunks"] == 1 and view["next_sequence_id"] == 1
        appended = await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 1, "text": "then b",
                                                                    "end_of_input": True})
        assert appended.status_code == 202
        result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 10})).json()
    assert result["completion"]["choices"][0]["message"]["content"] == "echo: kept then b"


async def test_a_broken_upload_leaves_a_session_mode_b_continues(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served

    async def body() -> AsyncIterator[bytes]:
        yield line({})
        yield line({"sequence_id": 0, "text": "before the break "})
        await until_fed(engine, 1)
        raise ConnectionError("the uploader's network went away")

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        with pytest.raises(ConnectionError):
            await client.post(UPLOAD, content=body(), headers=NDJSON)
        sid = f"{engine.sessions[0].request.request_id.rsplit('-', 1)[0]}"
        view = (await client.get(f"{BASE}/{sid}")).json()
        assert view["state"] == "streaming" and view["next_sequence_id"] == 1
        await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 1, "text": "and after", "end_of_input": True})
        result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 10})).json()
    assert result["completion"]["choices"][0]["message"]["content"] == "echo: before the break and after"


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"", 422, "empty_input"),
    (b"{not json\n", 400, "invalid_json"),
    (line({"start_policy": "whenever"}), 422, "validation_error"),
])
async def test_a_bad_first_record_is_a_plain_error(served: tuple[str, ScriptedEngine], body: bytes, status: int,
                                                   code: str) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(UPLOAD, content=body, headers=NDJSON)
    assert response.status_code == status and response.json()["error"]["code"] == code
