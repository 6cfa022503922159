"""OpenAI Realtime over a WebSocket, with the official ``openai`` SDK as the client.

Every event the server sends is validated against the SDK's own models of
server events (``RealtimeServerEvent``): a conformance check, not asserts
written from memory. The scripted engine answers ``echo: <input>``; the
spoken turns use the real Listener (Silero VAD + Moonshine) on speech made by hibari,
and the last test the real vLLM engine with the Talker.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from openai import AsyncOpenAI
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from gateway.api.realtime.resume import event_place
from omni_adapter.listener import with_listener
from omni_adapter.scripted import Script, ScriptedEngine, text_capabilities
from tests.gateway.client import live_app, make_settings
from tests.voice import SPEECH_RATE, pieces, speech, word_error_rate

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
QUESTION = "What is the capital of France?"


def conforming(event: Any) -> dict[str, Any]:
    """The event as sent, after checking it against the SDK's model of its type."""
    raw = event.to_dict() if hasattr(event, "to_dict") else event
    SERVER_EVENT.validate_python(raw)
    return raw


async def until(connection: Any, last: str, within_sec: float = 30) -> list[dict[str, Any]]:
    """Every server event up to and including the first of type ``last``."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(within_sec):
        async for event in connection:
            seen.append(conforming(event))
            if seen[-1]["type"] == last:
                return seen
    raise AssertionError(f"the connection closed before {last}: {[e['type'] for e in seen]}")


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def answer_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] in (
        "response.output_text.delta", "response.output_audio_transcript.delta"))


def realtime_event_counts(scraped: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each ``omni_gateway_realtime_events_total`` sample in a scrape."""
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(scraped)
            if family.name == "omni_gateway_realtime_events" for sample in family.samples
            if sample.name.endswith("_total")]


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url:
        yield url, engine


def sdk(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


async def text_turn(connection: Any, text: str) -> list[dict[str, Any]]:
    await connection.conversation.item.create(item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await connection.response.create()
    return await until(connection, "response.done")


async def test_a_text_turn_is_a_session_and_its_answer_streams_back(server: tuple[str, ScriptedEngine]) -> None:
    url, engine = server
    async with sdk(url).realtime.connect(model="scripted") as connection:
        created = await until(connection, "session.created")
        assert created[0]["session"]["model"] == "scripted"
        await connection.session.update(session=TEXT_ONLY)
        updated = await until(connection, "session.updated")
        assert updated[-1]["session"]["output_modalities"] == ["text"]
        events = await text_turn(connection, "hello thére ☃")
    assert answer_text(events) == "echo: hello thére ☃", "text beyond ASCII comes back as it went"
    assert types(events)[:2] == ["conversation.item.added", "conversation.item.done"]
    assert types(events).index("response.created") < types(events).index("response.output_text.delta")
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "echo: hello thére ☃"
    assert done["usage"]["output_tokens"] > 0
    assert engine.sessions[0].input_text == "hello thére ☃"
    async with httpx.AsyncClient() as http:
        scraped = (await http.get(f"{url}/metrics")).text
    counted = {(labels["direction"], labels["type"]): value for labels, value in realtime_event_counts(scraped)}
    deltas = types(events).count("response.output_text.delta")
    assert counted["out", "response.output_text.delta"] == deltas > 1, "every event sent is counted"
    assert counted["out", "response.done"] == 1 and counted["in", "response.create"] == 1


async def test_turns_carry_the_conversation(server: tuple[str, ScriptedEngine]) -> None:
    url, engine = server
    async with sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={**TEXT_ONLY, "instructions": "Be brief."})
        await text_turn(connection, "first question")
        second = await text_turn(connection, "second question")
    assert answer_text(second) == "echo: second question"
    history = engine.sessions[1].request.messages
    assert [(m["role"], m["content"]) for m in history] == [
        ("system", "Be brief."), ("user", "first question"), ("assistant", "echo: first question")]


async def test_bad_events_get_an_error_event_and_the_connection_goes_on(
        server: tuple[str, ScriptedEngine]) -> None:
    url, _ = server
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for bad in ("not json", json.dumps([1]), json.dumps({"type": "no.such.event", "event_id": "evt_1"}),
                    json.dumps({"type": "input_audio_buffer.append", "audio": "***"}),
                    json.dumps({"type": "input_audio_buffer.commit"}),  # nothing to commit
                    json.dumps({"type": "response.cancel"}),  # nothing to cancel
                    # JSON's escapes allow a lone surrogate, which no UTF-8 text can carry back:
                    '{"type": "no.such.event", "event_id": "\\ud800"}',
                    json.dumps({"type": "conversation.item.create", "item": {
                        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a\udc00"}]}}),
                    json.dumps({"type": "session.update", "session": {"max_output_tokens": -1}})):
            await ws.send(bad)
            error = conforming(json.loads(await ws.recv()))
            assert error["type"] == "error" and error["error"]["message"], bad
            assert error["error"]["code"] != "internal_error", bad
        assert error["error"]["param"] == "session.max_output_tokens"
        # An item's extra fields come back as sent, an integer beyond 64 bits too.
        big = {"type": "input_text", "text": "hi", "note": 10**30}
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [big]}}))
        added = conforming(json.loads(await ws.recv()))
        assert added["type"] == "conversation.item.added" and added["item"]["content"] == [big]
        assert json.loads(await ws.recv())["type"] == "conversation.item.done"
        await ws.send(json.dumps({"type": "no.such.event", "event_id": "evt_9"}))
        assert json.loads(await ws.recv())["error"]["event_id"] == "evt_9"
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        assert json.loads(await ws.recv())["type"] == "session.updated"


async def test_a_lone_surrogate_is_refused_by_its_place_and_never_taken(server: tuple[str, ScriptedEngine]) -> None:
    """JSON's ``\\ud800`` (a text UTF-8 cannot hold) in instructions or an item is an error naming
    it, and nothing of the event is applied: taken, it failed every answer after it."""
    url, engine = server
    lone = "a\ud800b"
    said = [{"type": "input_text", "text": lone}]
    bad = [
        ({"type": "session.update", "session": {"type": "realtime", "instructions": lone}}, "session.instructions"),
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "system", "content": said}},
         "item.content.0.text"),
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": lone}]}}, "item.content.0.text"),
        ({"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c1", "name": "f",
                                                       "arguments": lone}}, "item.arguments"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "c1",
                                                       "output": lone}}, "item.output"),
        ({"type": "response.create", "response": {"instructions": lone}}, "response.instructions"),
    ]
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        assert json.loads(await ws.recv())["type"] == "session.updated"
        for n, (event, where) in enumerate(bad):
            await ws.send(json.dumps({**event, "event_id": f"evt_{n}"}))  # (json writes it as \\ud800)
            error = conforming(json.loads(await ws.recv()))["error"]
            assert (error["code"], error["param"], error["event_id"]) == ("invalid_payload", where, f"evt_{n}")
            assert error["message"] == f"{where} is not valid Unicode (a lone surrogate)"
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        while (event := conforming(json.loads(await ws.recv())))["type"] != "response.done":
            assert event["type"] != "error", event
    assert event["response"]["status"] == "completed"
    assert engine.sessions[-1].request.messages == ({"role": "system", "content": "You are a helpful assistant."},)


async def test_a_commit_of_a_few_stray_bytes_is_refused_and_the_buffer_goes_on(
        server: tuple[str, ScriptedEngine]) -> None:
    """As at OpenAI: a commit of less than 100 ms of audio is input_audio_buffer_commit_empty;
    the audio stays, and with more it commits."""
    url, _ = server
    async with sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={**TEXT_ONLY, "audio": {"input": {"turn_detection": None}}})
        await connection.input_audio_buffer.append(audio=base64.b64encode(b"\x01\x02\x03").decode())
        await connection.input_audio_buffer.commit()
        refused = await until(connection, "error")
        await connection.input_audio_buffer.append(audio=base64.b64encode(bytes(2 * SPEECH_RATE // 5)).decode())
        await connection.input_audio_buffer.commit()
        committed = await until(connection, "input_audio_buffer.committed")
    assert refused[-1]["error"]["code"] == "input_audio_buffer_commit_empty", refused[-1]
    assert committed[-1]["item_id"]


async def test_a_model_not_served_is_said_in_an_error_event_and_an_alias_is_served(redis_url: str) -> None:
    # A framework's default model name: the socket is taken and the reason said in an event
    # (a refused handshake would reach its log as "HTTP 404"), then closed.
    engine = ScriptedEngine(capabilities=replace(text_capabilities(), model_names=("scripted", "gpt-realtime")))
    async with live_app(make_settings(redis_url=redis_url), engine) as url:
        async with sdk(url).realtime.connect(model="gpt-4o-realtime-preview") as connection:
            error = conforming(await connection.recv())
            assert error["type"] == "error" and error["error"]["code"] == "model_not_found"
            assert "scripted, gpt-realtime" in error["error"]["message"]
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await connection.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        # The reason is cut to fit a close frame in bytes, however the name is spelt.
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime?model=" + "mödèl-" * 40) as ws:
            assert json.loads(await ws.recv())["error"]["code"] == "model_not_found"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert not engine.sessions
        async with sdk(url).realtime.connect(model="gpt-realtime") as connection:
            created = await until(connection, "session.created")
            assert created[0]["session"]["model"] == "gpt-realtime"
            await connection.session.update(session=TEXT_ONLY)
            assert answer_text(await text_turn(connection, "hello")) == "echo: hello"


async def test_cancel_mid_answer_ends_the_response_as_cancelled(redis_url: str) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=0.2))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session=TEXT_ONLY)
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "one two three four five six seven"}]})
        await connection.response.create()
        await until(connection, "response.output_text.delta")
        await connection.response.cancel()
        events = await until(connection, "response.done")
        assert events[-1]["response"]["status"] == "cancelled"
        assert events[-1]["response"]["status_details"]["reason"] == "client_cancelled"
        await asyncio.sleep(0.1)
        assert engine.sessions[0].aborted
        # The connection goes on: the next turn is answered.
        assert answer_text(await text_turn(connection, "again")).endswith("again")


async def test_a_field_the_protocol_does_not_have_is_refused_and_the_session_stays(
        server: tuple[str, ScriptedEngine]) -> None:
    """A beta name or a typo is OpenAI's GA ``unknown_parameter``, not a setting silently lost;
    the fields it has that take no effect here are checked, and taken."""
    url, engine = server
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime") as ws:
        created = json.loads(await ws.recv())["session"]

        async def update(session: dict[str, Any]) -> dict[str, Any]:
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            return conforming(json.loads(await ws.recv()))

        refused = [  # (the update, the param its error names)
            ({"type": "realtime", "turn_detection": None, "modalities": ["text"]}, "session.turn_detection"),
            ({"instrucions": "Be brief."}, "session.instrucions"),
            ({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_ms": 200}}}},
             "session.audio.input.turn_detection.silence_ms"),
            ({"audio": {"output": {"speed": 1.25}}}, "session.audio.output.speed"),  # this engine has no Talker
            ({"audio": {"output": {"speed": 1.6}}}, "session.audio.output.speed"),  # OpenAI's Realtime: to 1.5
            ({"audio": {"output": {"speed": True}}}, "session.audio.output.speed"),
            ({"audio": {"input": {"noise_reduction": {"type": "bogus"}}}}, "session.audio.input.noise_reduction"),
            ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "bogus"}}}},
             "session.audio.input.turn_detection.eagerness"),
            ({"tracing": "sometimes"}, "session.tracing"),
            ({"include": ["bogus.field"]}, "session.include"),
            ({"prompt": {"id": "pmpt_123"}}, "session.prompt"),
        ]
        for session, param in refused:
            said = await update(session)
            assert said["type"] == "error" and said["error"]["param"] == param, (session, said)
            assert said["error"]["code"] in ("unknown_parameter", "invalid_value"), said  # OpenAI's codes
        assert said["error"]["message"] and (await update(refused[0][0]))["error"]["code"] == "unknown_parameter"
        # Nothing of the refused updates took effect: the session is as it was created (server VAD on).
        shown = (await update({}))["session"]
        assert shown == created and shown["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        assert shown["audio"]["output"]["speed"] == 1.0
        # What the protocol has and does nothing here is taken: a client sends it unchanged.
        taken = await update({**TEXT_ONLY, "tracing": "auto", "include": ["item.input_audio_transcription.logprobs"],
                              "reasoning": {"effort": "low"}, "prompt": None, "audio": {
                                  "input": {"noise_reduction": {"type": "near_field"}, "turn_detection": None},
                                  "output": {"voice": {"id": "voice_1234"}, "speed": 1}}})
        assert taken["type"] == "session.updated", taken
        assert taken["session"]["audio"]["output"]["voice"] == "voice_1234"

        await ws.send(json.dumps({"type": "response.create", "response": {"modalities": ["text"]}}))
        said = conforming(json.loads(await ws.recv()))
        assert said["type"] == "error" and said["error"]["param"] == "response.modalities", said
        await ws.send(json.dumps({"type": "response.create", "response": {
            "audio": {"output": {"format": {"type": "audio/pcmu"}}}}}))
        said = conforming(json.loads(await ws.recv()))
        assert said["type"] == "error" and said["error"]["param"] == "response.audio.output.format", said
        assert not engine.sessions, "a refused response.create answers nothing"
        await ws.send(json.dumps({"type": "response.create", "response": {
            "audio": {"output": {"voice": "marin", "format": {"type": "audio/pcm", "rate": 24000}}},
            "reasoning": {"effort": "minimal"}, "metadata": {"turn": "1"}}}))
        assert conforming(json.loads(await ws.recv()))["type"] == "response.created"


async def test_a_websocket_to_a_path_without_one_is_a_404(redis_url: str) -> None:
    """Not Starlette's 403, which reads as a refused key (a framework's transport on a wrong URL)."""
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url.replace("http", "ws") + "/v1/nowhere"):
                pass
        assert refused.value.response.status_code == 404
        assert json.loads(refused.value.response.body)["error"]["code"] == "not_found"
        async with httpx.AsyncClient(base_url=url) as http:  # plain HTTP is answered as before
            assert (await http.get("/v1/nowhere")).json()["error"]["code"] == "not_found"


async def test_browsers_authenticate_with_the_key_subprotocol(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    settings = make_settings(redis_url=redis_url, api_keys="sk-test")
    async with live_app(settings, ScriptedEngine()) as url:
        ws_url = url.replace("http", "ws") + "/v1/realtime"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(ws_url):
                pass
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["code"] == "missing_credentials"
        # A bad key is the client's error: nothing for the server's alerting (uvicorn logs one).
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
        async with websockets.connect(ws_url, subprotocols=[
                "realtime", "openai-insecure-api-key.sk-test"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "realtime"
            assert json.loads(await ws.recv())["type"] == "session.created"
        async with sdk(url, api_key="sk-test").realtime.connect(model="scripted") as connection:
            await until(connection, "session.created")


async def test_a_spoken_turn_with_a_commit_is_heard_while_it_streams(server: tuple[str, ScriptedEngine]) -> None:
    url, engine = server
    transcribed = {**TEXT_ONLY, "audio": {"input": {"turn_detection": None,
                                                    "transcription": {"model": "gpt-4o-transcribe"}}}}
    async with sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session=TEXT_ONLY)
        for piece in pieces(speech(QUESTION), SPEECH_RATE, 200):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await asyncio.sleep(1)  # the phrase ends at the pause after it, and is heard then
        committed_at = time.monotonic()
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        untold = await until(connection, "response.done")
        # Transcription events only when the session asks for them; the answer heard the words either way.
        assert not [e for e in untold if e["type"].startswith("conversation.item.input_audio_transcription")]
        assert answer_text(untold) == "echo: What is the capital of France?"

        await connection.session.update(session=transcribed)
        for piece in pieces(speech(QUESTION), SPEECH_RATE, 200):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        events = await until(connection, "response.done")
        item_id = next(e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed")
        await connection.conversation.item.retrieve(item_id=item_id)
        retrieved = await until(connection, "conversation.item.retrieved")
        assert retrieved[-1]["item"]["content"][0]["transcript"] == "What is the capital of France?"
    heard = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert heard and heard[0]["transcript"] == "What is the capital of France?"
    deltas = "".join(e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert deltas == "What is the capital of France?"
    assert "input_audio_buffer.committed" in types(events)
    assert answer_text(events) == "echo: What is the capital of France?"
    assert engine.sessions[0].fed_at[0] < committed_at, "the words went to the engine before the commit"


async def test_server_vad_answers_without_a_commit_and_speech_cancels_an_answer(redis_url: str) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=0.3))
    quiet = bytes(2 * SPEECH_RATE // 5)  # 200 ms
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"]})  # server_vad
        for piece in [quiet, *pieces(speech(QUESTION), SPEECH_RATE, 100), quiet, quiet, quiet, quiet]:
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        events = await until(connection, "response.output_text.delta")
        order = types(events)
        assert order.index("input_audio_buffer.speech_started") < order.index("input_audio_buffer.speech_stopped") \
            < order.index("input_audio_buffer.committed") < order.index("response.created")
        # Barge-in: the user speaks again while the answer plays.
        for piece in pieces(speech("Wait."), SPEECH_RATE, 100):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        events = await until(connection, "response.done")
        assert events[-1]["response"]["status"] == "cancelled"
        assert events[-1]["response"]["status_details"]["reason"] == "turn_detected"


async def test_a_turn_cut_off_before_it_was_heard_keeps_its_words(redis_url: str) -> None:
    """Two spoken turns sent faster than they play (appends of 4 s): server VAD commits the first,
    and the second's speech cancels its answer (barge-in) before its audio was even heard. As at
    OpenAI, the first item still gets its transcript, and the second turn's history has its words."""
    engine = ScriptedEngine()
    said = ["My name is Bob.", "What is my name?"]
    second = bytes(2 * SPEECH_RATE)  # a second of silence
    recording = second + speech(said[0]) + second + speech(said[1]) + second
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "whisper-1"}}}})
        for piece in pieces(recording, SPEECH_RATE, 4000):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        events: list[dict[str, Any]] = []
        while types(events).count("response.done") < 2:
            events += await until(connection, "response.done")
        transcribed = "conversation.item.input_audio_transcription.completed"
        while types(events).count(transcribed) < 2:
            events += await until(connection, transcribed)
    first, last = (e["response"] for e in events if e["type"] == "response.done")
    assert first["status"] == "cancelled" and first["status_details"]["reason"] == "turn_detected"
    assert last["status"] == "completed"
    order = types(events)
    assert order.index("input_audio_buffer.speech_started", order.index("input_audio_buffer.committed")) \
        < order.index("response.done"), "the user's speech is told before the answer it cancels"
    items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    heard = {e["item_id"]: e["transcript"] for e in events if e["type"] == transcribed}
    assert [word_error_rate(words, heard[item]) for words, item in zip(said, items, strict=True)] == [0, 0], heard
    history = [m["content"] for m in engine.sessions[-1].request.messages if m["role"] == "user"]
    assert any("Bob" in text for text in history), history


async def test_audio_with_no_words_in_it_says_so_of_its_item(redis_url: str) -> None:
    """Hiss committed and answered: the recognizer hears nothing, the response fails; the item
    got no transcription event at all, and a client waiting for each item's transcript hung."""
    hiss = (np.random.default_rng(0).normal(0, 3000, SPEECH_RATE * 2)).astype("<i2").tobytes()
    async with live_app(make_settings(redis_url=redis_url), with_listener(ScriptedEngine())) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "whisper-1"}, "turn_detection": None}}})
        for piece in pieces(hiss, SPEECH_RATE, 100):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        events = await until(connection, "response.done")
    item = next(e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed")
    failed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.failed"]
    assert [e["item_id"] for e in failed] == [item], types(events)
    assert events[-1]["response"]["status"] == "failed"


async def test_words_heard_before_the_answer_failed_are_the_items(redis_url: str) -> None:
    """The engine fails at the answer's first word, after the recognizer heard the question: the
    item's transcript is what was heard (completed, not failed), and the history keeps it."""
    async with live_app(make_settings(redis_url=redis_url), with_listener(ScriptedEngine(
            Script(error_after_words=0)))) as url, sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "whisper-1"}, "turn_detection": None}}})
        for piece in pieces(speech(QUESTION), SPEECH_RATE, 100):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        events = await until(connection, "response.done")
    assert events[-1]["response"]["status"] == "failed"
    heard = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert [e["transcript"] for e in heard] == [QUESTION], types(events)


@pytest.mark.parametrize("cut_by", ["clear", "commit"])
async def test_speech_going_on_after_a_clear_or_commit_is_a_new_utterance(redis_url: str, cut_by: str) -> None:
    """Server VAD, a clear (or the client's commit) in the middle of speaking: the rest went into
    an item no speech_started announced. It is told as a new utterance now."""
    said = speech("Call Michael Johnson at five five five, one two three four.")
    cut = len(said) // 3 // 2 * 2
    quiet = bytes(2 * SPEECH_RATE)
    async with live_app(make_settings(redis_url=redis_url), with_listener(ScriptedEngine())) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        for piece in pieces(quiet + said[:cut], SPEECH_RATE, 100):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        events = await until(connection, "input_audio_buffer.speech_started")
        await (connection.input_audio_buffer.clear() if cut_by == "clear" else connection.input_audio_buffer.commit())
        for piece in pieces(said[cut:] + quiet, SPEECH_RATE, 100):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        while types(events).count("input_audio_buffer.committed") < (1 if cut_by == "clear" else 2):
            events += await until(connection, "input_audio_buffer.committed")
    started = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert len(started) == 2 and events[-1]["item_id"] == started[-1], types(events)


async def two_utterances_then_a_response(url: str, server_vad: bool, transcribed: int) -> list[dict[str, Any]]:
    """Two utterances committed (by server VAD with ``create_response: false``, or by the client)
    and ``transcribed`` of their transcripts told before the client asks for the response."""
    turn_detection = {"type": "server_vad", "create_response": False} if server_vad else None
    async with sdk(url).realtime.connect(model="scripted") as connection:
        await connection.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
            "input": {"transcription": {"model": "whisper-1"}, "turn_detection": turn_detection}}})
        events: list[dict[str, Any]] = []
        for words in TWO_UTTERANCES:
            for piece in pieces(SECOND + speech(words) + SECOND, SPEECH_RATE, 1000):
                await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
            if not server_vad:
                await connection.input_audio_buffer.commit()
            events += await until(connection, "input_audio_buffer.committed")
        while types(events).count(TRANSCRIBED) < transcribed:
            events += await until(connection, TRANSCRIBED)
        assert "error" not in types(events) and "response.created" not in types(events), events
        await connection.response.create()
        return events + await until(connection, "response.done")


TWO_UTTERANCES = ["My name is Bob.", "What is my name?"]
SECOND = bytes(2 * SPEECH_RATE)
TRANSCRIBED = "conversation.item.input_audio_transcription.completed"


@pytest.mark.parametrize("server_vad", [True, False], ids=["server_vad", "commits"])
async def test_utterances_not_answered_yet_are_items_of_their_own_answered_together(
        redis_url: str, server_vad: bool) -> None:
    """``create_response: false`` (or commits without a response): each utterance is committed as
    its own item with its own transcript, and the response made later hears them all, as at OpenAI.
    Server VAD's are heard at once (a client may read them before it answers); a commit's when the
    next input comes, or with the answer."""
    engine = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), with_listener(engine)) as url:
        events = await two_utterances_then_a_response(url, server_vad, transcribed=2 if server_vad else 1)
    items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    assert events[-1]["response"]["status"] == "completed"
    heard = {e["item_id"]: e["transcript"] for e in events if e["type"] == TRANSCRIBED}
    assert [word_error_rate(words, heard[item]) for words, item in zip(TWO_UTTERANCES, items, strict=True)] \
        == [0, 0], heard
    history = [m["content"] for m in engine.sessions[-1].request.messages if m["role"] == "user"]
    assert any("Bob" in text for text in history), history
    assert "name" in answer_text(events), "the answer is to the second utterance"


async def test_utterances_to_an_engine_that_hears_audio_itself_are_items_of_one_turn(redis_url: str) -> None:
    """No transcripts to read (the engine hears the audio, as vLLM-Omni's Thinker does): the two
    utterances are two items, and one session hears them both."""
    engine = ScriptedEngine(capabilities=replace(text_capabilities(), input_modalities=frozenset({"text", "audio"})))
    async with live_app(make_settings(redis_url=redis_url), engine) as url:
        events = await two_utterances_then_a_response(url, server_vad=True, transcribed=0)
    assert len({e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"}) == 2
    assert events[-1]["response"]["status"] == "completed"
    assert len(engine.sessions) == 1


async def test_the_sessions_speed_speaks_the_next_answers_faster(redis_url: str) -> None:
    """``audio.output.speed`` (OpenAI's 0.25 to 1.5, between turns): the Talker's own pace (hibari),
    shown in ``session.updated``; a response cannot set its own (OpenAI's protocol has no such field)."""
    from omni_adapter.talker import with_talker
    from tests.voice import recognize

    said = "The museum opens early in the morning."
    engine = with_talker(ScriptedEngine(Script(answer=lambda *_: [said])))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model="scripted") as connection:
        await until(connection, "session.created")
        spoken: dict[float, bytes] = {}
        for speed in (1.0, 1.25):
            await connection.session.update(session={"type": "realtime", "audio": {
                "input": {"turn_detection": None}, "output": {"speed": speed}}})
            updated = await until(connection, "session.updated")
            assert updated[-1]["session"]["audio"]["output"]["speed"] == speed
            events = await text_turn(connection, "When does the museum open?")
            spoken[speed] = b"".join(base64.b64decode(e["delta"]) for e in events
                                     if e["type"] == "response.output_audio.delta")
            assert word_error_rate(said, recognize(spoken[speed], SPEECH_RATE)) == 0, speed
        assert len(spoken[1.25]) < 0.93 * len(spoken[1.0]), (len(spoken[1.25]), len(spoken[1.0]))
        await connection.send({"type": "response.create",
                               "response": {"audio": {"output": {"speed": 1.5}}}})
        refused = await until(connection, "error")
        assert refused[-1]["error"]["param"] == "response.audio.output.speed", refused[-1]
        assert refused[-1]["error"]["code"] == "unknown_parameter"


def test_a_reconnect_keeps_the_speed_and_a_replica_without_it_reads_a_session_at_one() -> None:
    from gateway.api.realtime.config import RealtimeConfig

    config = RealtimeConfig(model="m", can_speak=True, can_change_speed=True)
    assert "speed" not in config.saved(), "a replica of the release before restores it"
    config.update({"audio": {"output": {"speed": 0.75}}})
    assert RealtimeConfig.restored(config.saved(), can_transcribe=False, can_change_speed=True) == config


@pytest.mark.engine
async def test_a_spoken_question_gets_a_spoken_answer_from_the_real_engine(redis_url: str, vllm_engine: Any) -> None:
    from omni_adapter.talker import with_talker
    from tests.voice import recognize, word_error_rate

    engine = with_talker(with_listener(vllm_engine))
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model=engine.capabilities.model_names[0]) as connection:
        await until(connection, "session.created")
        await connection.session.update(session={
            "type": "realtime", "instructions": "You are a helpful assistant. Answer in one sentence.",
            "max_output_tokens": 24, "temperature": 0, "audio": {"input": {"turn_detection": None}}})
        for piece in pieces(speech(QUESTION), SPEECH_RATE, 200):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        events = await until(connection, "response.done", within_sec=120)
    answer = answer_text(events)
    assert "Paris" in answer, answer
    assert events[-1]["response"]["output_modalities"] == ["audio"]
    spoken = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(spoken) > SPEECH_RATE  # more than half a second of speech
    assert word_error_rate(answer, recognize(spoken, SPEECH_RATE)) <= 0.5


async def ask_then_break(url: str, words: str, stop: Callable[[list[dict[str, Any]]], bool],
                         ) -> tuple[str, list[dict[str, Any]]]:
    """A text turn asked over a raw socket, which breaks (no close handshake) once ``stop``
    holds for the events seen; the Realtime session's id and those events."""
    ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime")
    session_id = json.loads(await ws.recv())["session"]["id"]
    await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}}))
    await ws.send(json.dumps({"type": "response.create"}))
    before: list[dict[str, Any]] = []
    while not stop(before):
        before.append(conforming(json.loads(await ws.recv())))
    ws.transport.abort()
    return session_id, before


async def resumed_until_done(url: str, session_id: str, last_event_id: str) -> list[dict[str, Any]]:
    """Reconnect with the resume parameters; every event up to ``response.done``."""
    async with websockets.connect(f"{url.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                                  f"&last_event_id={last_event_id}") as ws:
        after: list[dict[str, Any]] = []
        while not after or after[-1]["type"] != "response.done":
            after.append(conforming(json.loads(await asyncio.wait_for(ws.recv(), 30))))
        return after


async def test_a_broken_socket_resumes_on_another_replica_with_nothing_lost_or_repeated(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url)
    words = "one two three four five six seven eight nine ten"
    async with live_app(settings, ScriptedEngine(Script(word_delay_sec=0.15))) as a, \
            live_app(settings, ScriptedEngine()) as b:
        session_id, before = await ask_then_break(
            a, words, lambda seen: sum(e["type"] == "response.output_text.delta" for e in seen) >= 3)
        after = await resumed_until_done(b, session_id, before[-1]["event_id"])
        async with websockets.connect(f"{b.replace('http', 'ws')}/v1/realtime?session_id={session_id}") as ws_b:
            await ws_b.recv()  # session.created: the answer is over, nothing more to replay
            assert after[0]["type"] == "session.created" and after[0]["session"]["id"] == session_id
            assert answer_text(before) + answer_text(after) == f"echo: {words}"
            assert after[-1]["response"]["output"][0]["content"][0]["text"] == f"echo: {words}"
            # The conversation goes on from the other replica.
            await ws_b.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]}}))
            await ws_b.send(json.dumps({"type": "response.create"}))
            turn = []
            while not turn or turn[-1]["type"] != "response.done":
                turn.append(json.loads(await asyncio.wait_for(ws_b.recv(), 30)))
            assert answer_text(turn) == "echo: more"


async def test_a_resume_inside_an_answer_that_has_ended_replays_its_rest(redis_url: str) -> None:
    """The answer ended while its last events were in flight when the socket broke: a reconnect
    from the last event the client got (a delta) replays the rest, up to response.done, once."""
    words = "one two three four five six"
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url:
        session_id, seen = await ask_then_break(url, words, lambda got: bool(got) and got[-1]["type"] == "response.done")
        deltas = [i for i, e in enumerate(seen) if e["type"] == "response.output_text.delta"]
        got = seen[:deltas[1] + 1]  # what reached the client before the break
        after = await resumed_until_done(url, session_id, got[-1]["event_id"])
    assert after[0]["type"] == "session.created"
    assert [e["type"] for e in after[1:]] == [e["type"] for e in seen[deltas[1] + 1:]]
    assert answer_text(got) + answer_text(after) == f"echo: {words}"
    assert after[-1]["response"]["status"] == "completed"
    assert after[-1]["response"]["id"] == seen[-1]["response"]["id"]


@pytest.mark.parametrize("broken_after", ["response.created", "response.done"])
async def test_a_resume_after_the_answer_failed_gets_its_failed_response_done(redis_url: str,
                                                                              broken_after: str) -> None:
    """The answer failed (the engine's error) while the socket was broken, or its failure was in
    flight: the reconnect gets response.done failed, not silence for ever."""
    words = "one two three four five six"
    async with live_app(make_settings(redis_url=redis_url),
                        ScriptedEngine(Script(error_after_words=2, word_delay_sec=0.1))) as url:
        session_id, seen = await ask_then_break(url, words, lambda got: bool(got) and got[-1]["type"] == broken_after)
        if broken_after == "response.done":
            seen = seen[:-3]  # its last events never reached the client
        await asyncio.sleep(1)  # the answer fails meanwhile
        after = await resumed_until_done(url, session_id, seen[-1]["event_id"])
    done = after[-1]["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"], done
    assert not {e["event_id"] for e in after[1:]} & {e["event_id"] for e in seen}, "nothing is sent twice"


async def test_a_resume_from_any_event_gets_exactly_the_events_after_it(redis_url: str) -> None:
    """Events answering the client's own requests (session.updated, its item's, response.created)
    were not sent again: a client whose socket broke before the answer's first frame never got
    response.created. From whichever event it got last, it gets exactly those after it, the same
    ids, in the same order. Another session's event id is refused."""
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url:
        ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime")
        sent = [json.loads(await ws.recv())]
        session_id = sent[0]["session"]["id"]
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two three"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        while sent[-1]["type"] != "rate_limits.updated":  # (the answer's last event, after response.done)
            sent.append(conforming(json.loads(await ws.recv())))
        first_done = len(sent) - 1
        # A second turn: its events are placed in its own run (frame ids of two sessions do not compare).
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "four five"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        while sent[-1]["type"] != "response.done":
            sent.append(conforming(json.loads(await ws.recv())))
        ws.transport.abort()
        # From anywhere in the last answer, or the first one's end (an answer before the last is not
        # kept to replay): the rest.
        for cut in range(first_done, len(sent) - 1):
            after = await resumed_until_done(url, session_id, sent[cut]["event_id"])
            assert after[0]["type"] == "session.created"
            assert [(e["type"], e["event_id"]) for e in after[1:]] \
                == [(e["type"], e["event_id"]) for e in sent[cut + 1:]], sent[cut]["type"]
        async with sdk(url).realtime.connect(model="scripted") as other:
            elsewhere = (await until(other, "session.created"))[-1]["event_id"]
        for foreign in (elsewhere, sent[3]["event_id"][:-1] + ("0" if sent[3]["event_id"][-1] != "0" else "1")):
            assert event_place(foreign) is not None
            async with websockets.connect(f"{url.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                                          f"&last_event_id={foreign}") as refused:
                error = json.loads(await refused.recv())
                assert error["type"] == "error" and error["error"]["param"] == "last_event_id", error


async def test_a_resume_after_an_out_of_band_answer_sends_nothing_again(redis_url: str) -> None:
    """An answer, then an out-of-band one (conversation: none); the socket breaks after the latter's
    last event. The reconnect has nothing to send: the last answer was sent whole again (the
    out-of-band answer's events were placed before it)."""
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as url:
        ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime")
        session_id = json.loads(await ws.recv())["session"]["id"]
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "one two"}]}}))
        for request in ({"type": "response.create"},
                        {"type": "response.create", "response": {"conversation": "none"}}):
            await ws.send(json.dumps(request))
            while (last := json.loads(await ws.recv()))["type"] != "rate_limits.updated":  # (after response.done)
                pass
        ws.transport.abort()
        async with websockets.connect(f"{url.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                                      f"&last_event_id={last['event_id']}") as quiet:
            assert json.loads(await quiet.recv())["type"] == "session.created"
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(quiet.recv(), 1)


async def test_a_resume_of_an_unknown_session_is_refused(server: tuple[str, ScriptedEngine]) -> None:
    url, _ = server
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime?session_id=sess_nope") as ws:
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == "session_not_found"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    # A mangled last event id is refused too (a client that would miss events never learnt it).
    session_id, _ = await ask_then_break(url, "hi", lambda got: bool(got) and got[-1]["type"] == "response.done")
    async with websockets.connect(f"{url.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                                  "&last_event_id=bogus") as ws:
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["param"] == "last_event_id"
