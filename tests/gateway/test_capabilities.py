"""The engine's declared modalities decide what create and append accept.

Checked in the service against ``Engine.capabilities``, so the same 422s
hold for every adapter; here with scripted engines that declare different
capabilities. A refused request stores nothing.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import httpx
import pytest

from omni_adapter.port import Capabilities
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse
from tests.gateway.test_api import assert_error, create, view

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image").decode()
PCM = base64.b64encode(b"\x00\x01" * 160).decode()


@pytest.fixture
def engine() -> ScriptedEngine:
    """Takes text and audio, answers in text only."""
    return ScriptedEngine(capabilities=Capabilities(
        input_modalities=frozenset({"text", "audio"}), output_modalities=frozenset({"text"}),
        incremental=True, model_names=("scripted",)))


@pytest.fixture
async def client(redis_url: str, engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(make_settings(redis_url=redis_url), engine) as c:
        yield c


async def test_output_modality_the_engine_cannot_produce_is_refused_at_create(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    error = assert_error(await client.post(BASE, json={"modalities": ["text", "audio"]}),
                         422, "unsupported_modality", "modalities")
    assert "audio" in error["message"] and "it produces: text" in error["message"]
    assert engine.sessions == []


async def test_declared_first_chunk_modality_is_checked_at_create(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    response = await client.post(BASE, json={
        "first_chunk": {"sequence_id": 0, "modality": "image", "payload": PNG, "mime_type": "image/png"}})
    error = assert_error(response, 422, "unsupported_modality", "first_chunk.modality")
    assert "audio, text" in error["message"]
    assert engine.sessions == []


async def test_refused_append_stores_nothing_and_the_session_goes_on(
        client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    sid = await create(client, start_policy="on_end_only")
    before = await view(client, sid)
    assert_error(await client.post(f"{BASE}/{sid}/chunks", json={
        "sequence_id": 0, "modality": "image", "payload": PNG}), 422, "unsupported_modality", "modality")
    assert_error(await client.post(f"{BASE}/{sid}/chunks", content=b"frame", headers={
        "Content-Type": "application/octet-stream", "X-Sequence-Id": "0", "X-Modality": "video",
        "X-End-Of-Input": "true"}), 422, "unsupported_modality", "modality")
    after = await view(client, sid)
    assert {k: after[k] for k in ("state", "next_sequence_id", "received_chunks", "buffered_bytes")} == {
        k: before[k] for k in ("state", "next_sequence_id", "received_chunks", "buffered_bytes")}

    # The refused sequence id is still free; a modality the engine takes goes through.
    assert (await client.post(f"{BASE}/{sid}/chunks", json={
        "sequence_id": 0, "modality": "audio", "payload": PCM, "format": "pcm16"})).status_code == 202
    assert (await client.post(f"{BASE}/{sid}/chunks", json={
        "sequence_id": 1, "text": "and text", "end_of_input": True})).status_code == 202
    events = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert content_of(events) == "echo: <audio>and text"
    assert [c.modality for c in engine.sessions[0].fed] == ["audio", "text"]


async def test_text_only_engine_refuses_audio_input_everywhere(redis_url: str) -> None:
    async with app_client(make_settings(redis_url=redis_url), ScriptedEngine()) as client:
        audio = {"sequence_id": 0, "modality": "audio", "payload": PCM}
        assert_error(await client.post(BASE, json={"first_chunk": audio}),
                     422, "unsupported_modality", "first_chunk.modality")
        sid = await create(client)
        assert_error(await client.post(f"{BASE}/{sid}/chunks", json=audio),
                     422, "unsupported_modality", "modality")
        assert (await view(client, sid))["received_chunks"] == 0
