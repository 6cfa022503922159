"""Realtime transcription sessions (``?intent=transcription``): streaming speech to text.

Real redis-server, the real Listener (Silero VAD, Moonshine) in front of the scripted
Thinker, which must never be asked; speech made on the spot by hibari and by espeak-ng in
voices of its own; the official ``openai`` SDK as the client, every event checked against
its models.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import websockets

from omni_adapter.audio import parse_wav, resample
from omni_adapter.listener import with_listener
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import conforming, sdk, types, until
from tests.voice import SPEECH_RATE, pieces, speech, word_error_rate

TRANSCRIBED = "conversation.item.input_audio_transcription.completed"
SILENCE = bytes(SPEECH_RATE)  # half a second of pcm16


def espeak(text: str, voice: str) -> bytes:
    """espeak-ng saying ``text`` in ``voice``, as pcm16 at OpenAI's 24 kHz."""
    espeak_ng = shutil.which("espeak-ng")
    assert espeak_ng is not None, "espeak-ng is not installed (scripts/setup.sh installs it)"
    wav = subprocess.run([espeak_ng, "-v", voice, "-s", "150", "--stdout", text], check=True,
                         capture_output=True).stdout
    pcm, rate = parse_wav(wav)
    return resample(pcm, rate, SPEECH_RATE)


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[tuple[str, ScriptedEngine]]:
    thinker = ScriptedEngine()
    async with live_app(make_settings(redis_url=redis_url), with_listener(thinker)) as url:
        yield url, thinker


async def append(connection: Any, pcm: bytes) -> None:
    for piece in pieces(pcm, SPEECH_RATE, 100):
        await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())


async def test_each_committed_utterance_is_transcribed_and_nothing_is_answered(
        server: tuple[str, ScriptedEngine]) -> None:
    """pipecat's way: no server VAD, a commit when its own VAD hears the speaker stop. Each
    commit's transcript comes as its own item's, in order, and the next utterance streams in
    meanwhile."""
    url, thinker = server
    said = [("What is the capital of France?", speech("What is the capital of France?")),
            ("Play some relaxing music in the living room.",
             espeak("Play some relaxing music in the living room.", "en-gb+f2")),
            ("What time does the train to Boston leave?",
             espeak("What time does the train to Boston leave?", "en-gb+m2"))]
    async with sdk(url).realtime.connect(model="gpt-realtime-whisper",
                                         extra_query={"intent": "transcription"}) as connection:
        created = await until(connection, "session.created")
        assert created[-1]["session"]["type"] == "transcription"
        await connection.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None,
            "transcription": {"model": "gpt-realtime-whisper", "language": "en"}}}})
        updated = (await until(connection, "session.updated"))[-1]["session"]
        assert updated["audio"]["input"]["turn_detection"] is None
        assert updated["audio"]["input"]["transcription"]["model"] == "gpt-realtime-whisper"
        for _, pcm in said:
            await append(connection, pcm + SILENCE)
            await connection.input_audio_buffer.commit()  # no wait: the next one streams in at once
        events: list[dict[str, Any]] = []
        while sum(e["type"] == TRANSCRIBED for e in events) < len(said):
            events += await until(connection, TRANSCRIBED)
        # The session goes on: the history holds each utterance's words.
        last_item = [e for e in events if e["type"] == TRANSCRIBED][-1]["item_id"]
        await connection.conversation.item.retrieve(item_id=last_item)
        retrieved = (await until(connection, "conversation.item.retrieved"))[-1]["item"]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    transcribed = [e for e in events if e["type"] == TRANSCRIBED]
    assert [e["item_id"] for e in transcribed] == [e["item_id"] for e in committed]
    assert [e["previous_item_id"] for e in committed] == [None, committed[0]["item_id"], committed[1]["item_id"]]
    for (words, _), event in zip(said, transcribed, strict=True):
        assert word_error_rate(words, event["transcript"]) <= 0.15, event["transcript"]
        assert event["usage"]["type"] == "duration" and event["usage"]["seconds"] > 1
        deltas = "".join(e["delta"] for e in events if e.get("item_id") == event["item_id"]
                         and e["type"] == "conversation.item.input_audio_transcription.delta")
        assert deltas == event["transcript"], "the deltas add up to the transcript"
    assert retrieved["content"][0]["transcript"] == transcribed[-1]["transcript"]
    assert not [t for t in types(events) if t.startswith("response.")]
    assert thinker.sessions == [], "a transcription asks the Thinker nothing"


async def test_server_vad_cuts_the_speech_into_utterances_and_answers_are_refused(
        server: tuple[str, ScriptedEngine]) -> None:
    """LiveKit's way (its default for OpenAI's transcribe models): server VAD ends each utterance
    at the pause after it. An event that asks for an answer is an error, and the session goes on."""
    url, thinker = server
    first, second = "Please set a timer for ten minutes.", "What is the largest animal in the ocean?"
    async with sdk(url).realtime.connect(model="gpt-4o-mini-transcribe",
                                         extra_query={"intent": "transcription"}) as connection:
        await connection.session.update(session={"type": "transcription", "audio": {"input": {
            "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
        await append(connection, SILENCE + speech(first) + 2 * SILENCE + espeak(second, "en-gb+f2") + 2 * SILENCE)
        events = await until(connection, TRANSCRIBED)
        events += await until(connection, TRANSCRIBED)
        await connection.response.create()
        refused = await until(connection, "error")
        await append(connection, speech(first) + 2 * SILENCE)
        again = await until(connection, TRANSCRIBED)
    order = types(events)
    assert order.count("input_audio_buffer.speech_started") == order.count("input_audio_buffer.speech_stopped") == 2
    assert order.index("input_audio_buffer.speech_stopped") < order.index("input_audio_buffer.committed") \
        < order.index(TRANSCRIBED)
    heard = [e["transcript"] for e in events if e["type"] == TRANSCRIBED]
    assert word_error_rate(first, heard[0]) == 0 and word_error_rate(second, heard[1]) <= 0.15, heard
    assert refused[-1]["error"]["code"] == "invalid_request" and "transcription" in refused[-1]["error"]["message"]
    assert word_error_rate(first, again[-1]["transcript"]) == 0
    assert thinker.sessions == []


async def test_what_a_transcription_session_cannot_do_is_said(server: tuple[str, ScriptedEngine],
                                                              redis_url: str) -> None:
    url, _ = server
    ws_url = url.replace("http", "ws") + "/v1/realtime"
    async with sdk(url).realtime.connect(model="gpt-4o-transcribe",
                                         extra_query={"intent": "transcription"}) as connection:
        # A language the recognizer does not hear, named in either of OpenAI's fields.
        for transcription, param in [({"language": "fr"}, "language"), ({"languages": ["en", "de"]}, "languages")]:
            await connection.session.update(session={"type": "transcription",
                                                      "audio": {"input": {"transcription": transcription}}})
            error = (await until(connection, "error"))[-1]["error"]
            assert error["param"] == f"session.audio.input.transcription.{param}", error
        await connection.input_audio_buffer.commit()  # nothing appended
        assert (await until(connection, "error"))[-1]["error"]["code"] == "input_audio_buffer_commit_empty"
        # A refused update changes nothing: the session is still a transcription session.
        await connection.session.update(session={"type": "realtime", "instructions": 5})  # type: ignore[typeddict-item]
        assert (await until(connection, "error"))[-1]["error"]["param"] == "session.instructions"
        await connection.response.create()
        assert "transcription" in (await until(connection, "error"))[-1]["error"]["message"]
    # A realtime session that has had input does not turn into a transcription session.
    async with websockets.connect(ws_url) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}))
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription"}}))
        seen = [json.loads(await ws.recv()) for _ in range(3)]
        assert seen[-1]["type"] == "error" and seen[-1]["error"]["param"] == "session.type", seen
    # An engine without a Listener cannot hear without answering: said, then closed.
    async with live_app(make_settings(redis_url=redis_url), ScriptedEngine()) as deaf, \
            websockets.connect(deaf.replace("http", "ws") + "/v1/realtime?intent=transcription") as ws:
        said = conforming(json.loads(await ws.recv()))
        assert said["type"] == "error" and said["error"]["param"] == "session.type"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()


async def test_a_broken_socket_gets_the_transcript_on_another_replica(redis_url: str) -> None:
    """The socket breaks right after the commit; the reconnect (to another replica, with
    ``last_event_id``) gets the transcript, and the session goes on there."""
    settings = make_settings(redis_url=redis_url)
    words = "Remind me to call my mother tonight."
    async with live_app(settings, with_listener(ScriptedEngine())) as a, \
            live_app(settings, with_listener(ScriptedEngine())) as b:
        ws = await websockets.connect(a.replace("http", "ws") + "/v1/realtime?intent=transcription")
        created = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
        last = json.loads(await ws.recv())["event_id"]
        for piece in pieces(speech(words), SPEECH_RATE, 100):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while (event := json.loads(await ws.recv()))["type"] != "input_audio_buffer.committed":
            last = event["event_id"]
        ws.transport.abort()
        async with websockets.connect(f"{b.replace('http', 'ws')}/v1/realtime?session_id="
                                      f"{created['session']['id']}&last_event_id={last}") as again:
            after = []
            while not after or after[-1]["type"] != TRANSCRIBED:
                after.append(conforming(json.loads(await asyncio.wait_for(again.recv(), 30))))
            assert after[0]["session"]["type"] == "transcription"
            assert word_error_rate(words, after[-1]["transcript"]) == 0, after[-1]
            assert after[-1]["item_id"] == event["item_id"]
            for piece in pieces(speech(words) + SILENCE, SPEECH_RATE, 100):
                await again.send(json.dumps({"type": "input_audio_buffer.append",
                                             "audio": base64.b64encode(piece).decode()}))
            await again.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while (event := json.loads(await asyncio.wait_for(again.recv(), 30)))["type"] != TRANSCRIBED:
                pass
            assert word_error_rate(words, event["transcript"]) == 0


async def test_a_commit_told_is_kept_when_its_replica_stops_right_after(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica killed right after it told the client ``committed``, before the utterance's
    input was ended (a CI run of the kill -9 test hit that moment): the reconnect found an open
    turn, and the transcript never came. The commit is saved before it is told."""
    from gateway.service.sessions import SessionService

    stopped, finish = asyncio.Event(), SessionService.finish
    first: list[bool] = []

    async def stops_at_the_first(self: SessionService, *args: Any, **kwargs: Any) -> Any:
        if not first:  # replica a: as if killed here (its commit told, the input not ended)
            first.append(True)
            await stopped.wait()
        return await finish(self, *args, **kwargs)

    monkeypatch.setattr(SessionService, "finish", stops_at_the_first)
    settings = make_settings(redis_url=redis_url)
    words = "Remind me to call my mother tonight."
    async with live_app(settings, with_listener(ScriptedEngine())) as a, \
            live_app(settings, with_listener(ScriptedEngine())) as b:
        ws = await websockets.connect(a.replace("http", "ws") + "/v1/realtime?intent=transcription")
        session_id = json.loads(await ws.recv())["session"]["id"]
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
        for piece in pieces(speech(words), SPEECH_RATE, 100):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while (committed := json.loads(await ws.recv()))["type"] != "input_audio_buffer.committed":
            pass
        ws.transport.abort()
        try:
            async with websockets.connect(f"{b.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                                          f"&last_event_id={committed['event_id']}") as again:
                while (event := json.loads(await asyncio.wait_for(again.recv(), 30)))["type"] != TRANSCRIBED:
                    assert event["type"] != "error", event
        finally:
            stopped.set()
    assert event["item_id"] == committed["item_id"] and word_error_rate(words, event["transcript"]) == 0, event


def test_a_realtime_session_is_saved_as_the_release_before_saved_it() -> None:
    """A rolling deploy: a replica of the release before restores a realtime session saved by this
    one (it knows no session type); a transcription session round-trips whole."""
    from gateway.api.realtime.config import RealtimeConfig

    plain = RealtimeConfig(model="m", can_speak=True, can_transcribe=True)
    assert "session_type" not in plain.saved() and "can_transcribe" not in plain.saved()
    plain.update({"type": "transcription", "audio": {"input": {"transcription": {"model": "gpt-realtime-whisper"}}}})
    assert plain.server_vad is None, "OpenAI's recognizers that find no turn ends have no server VAD"
    plain.update({"type": "transcription", "audio": {"input": {"transcription": None}}})
    assert plain.transcription == {}, "a transcription session always tells its transcripts"
    assert RealtimeConfig.restored(plain.saved(), can_transcribe=True) == plain


def spoken(text: str) -> bytes:
    """hibari saying ``text`` with nothing before or after: speech that ends where the pause begins."""
    samples = np.frombuffer(speech(text), dtype="<i2")
    loud = np.flatnonzero(np.abs(samples) > 100)
    return samples[loud[0]:loud[-1] + 1].tobytes()


async def test_utterances_sent_faster_than_they_play_are_cut_where_they_are(
        server: tuple[str, ScriptedEngine]) -> None:
    """A recording sent in appends of seconds (faster than it plays), its pauses just over the
    500 ms that end a turn: server VAD hears the end of one utterance and the start of the next
    inside one append, often within 100 ms of each other, and cuts each where it was heard. Each
    utterance is its own item, whole, with its own start and stop."""
    url, _ = server
    said = ["Please set a timer for ten minutes.", "What is the capital of France?", "Turn off the lights.",
            "What time is it?"]
    recording = bytearray(SILENCE)
    for at, words in enumerate(said):
        # Pauses of 580-640 ms: the next start is heard 60-130 ms after the stop.
        recording += spoken(words) + bytes(2 * SPEECH_RATE * (580 + 20 * at) // 1000)
    recording += 2 * SILENCE
    async with sdk(url).realtime.connect(model="gpt-4o-transcribe",
                                         extra_query={"intent": "transcription"}) as connection:
        await connection.session.update(session={"type": "transcription", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
        for piece in pieces(bytes(recording), SPEECH_RATE, 4000):
            await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        events: list[dict[str, Any]] = []
        while sum(e["type"] == TRANSCRIBED for e in events) < len(said):
            events += await until(connection, TRANSCRIBED)
    started, stopped, committed, transcribed = ([e for e in events if e["type"] == kind] for kind in (
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
        TRANSCRIBED))
    items = [e["item_id"] for e in committed]
    assert len(set(items)) == len(said)
    assert [e["item_id"] for e in started] == [e["item_id"] for e in stopped] == items == \
        [e["item_id"] for e in transcribed]
    starts, stops = [e["audio_start_ms"] for e in started], [e["audio_end_ms"] for e in stopped]
    assert all(start < stop for start, stop in zip(starts, stops, strict=True)), (starts, stops)
    assert all(stop < start for stop, start in zip(stops, starts[1:], strict=False)), (starts, stops)
    heard = [e["transcript"] for e in transcribed]
    assert [word_error_rate(words, text) for words, text in zip(said, heard, strict=True)] == [0] * len(said), heard
