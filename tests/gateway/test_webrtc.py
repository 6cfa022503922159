"""Realtime over WebRTC (``/v1/realtime/calls``), called by an aiortc peer as a browser would.

Real parts: Redis, aiortc on both sides (Opus both ways, the data channel),
the real Listener (Silero VAD + Moonshine) hearing speech made by the real
Talker (hibari), and the Talker speaking the answer, which the test hears on
the answer's track and recognizes. The Thinker is the scripted engine
(``echo: <what it heard>``); the browser test does the same with a real browser.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import websockets
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from pydantic import TypeAdapter

from gateway.api.realtime import sideband, webrtc
from gateway.store.redis_store import SessionStore
from omni_adapter.listener import with_listener
from omni_adapter.scripted import Script, ScriptedEngine
from omni_adapter.talker import with_talker
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_client_secrets import KEY
from tests.gateway.test_realtime import QUESTION, sdk
from tests.gateway.webrtc_peer import Peer
from tests.voice import SPEECH_RATE, recognize, speech

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)


@pytest.fixture
async def voice(redis_url: str) -> AsyncIterator[str]:
    engine = with_talker(with_listener(ScriptedEngine()))
    async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), engine) as url:
        yield url


async def secret(url: str, **session: Any) -> str:
    minted = await sdk(url, api_key=KEY).realtime.client_secrets.create(
        session={"type": "realtime", "instructions": "Answer briefly.", **session})
    return str(minted.value)


def types(events: list[dict[str, Any]]) -> list[str]:
    for event in events:
        SERVER_EVENT.validate_python(event)  # every event is one the official SDK knows
    return [e["type"] for e in events]


async def test_a_call_hears_the_question_answers_aloud_and_barge_in_clears_the_answer(voice: str) -> None:
    async with Peer(voice, await secret(voice)) as peer:
        created = await peer.until("session.created")
        assert created[-1]["session"]["instructions"] == "Answer briefly."
        peer.say(speech(QUESTION))
        turn = types(await peer.until("output_audio_buffer.stopped", 60))
        for expected in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "response.created", "output_audio_buffer.started",
                         "response.output_audio.done", "response.done"):
            assert expected in turn, turn
        assert "response.output_audio.delta" not in turn  # the audio came on the track
        assert turn.index("output_audio_buffer.started") < turn.index("response.done")
        heard = recognize(bytes(peer.heard), SPEECH_RATE).lower()
        assert "capital" in heard and "france" in heard, heard

        # Barge-in: speech while the answer plays flushes it.
        peer.say(speech("Tell me more about France."))
        await peer.until("output_audio_buffer.started", 60)
        peer.say(speech("Stop."))
        barged = types(await peer.until("output_audio_buffer.cleared", 30))
        assert "input_audio_buffer.speech_started" in barged
        assert "output_audio_buffer.stopped" not in barged

        # And the client's own clear (after a response.cancel, in OpenAI's words).
        await peer.until("output_audio_buffer.started", 60)
        peer.send({"type": "output_audio_buffer.clear"})
        assert types(await peer.until("output_audio_buffer.cleared", 10))


@pytest.mark.parametrize("stop", ["cut", "ended"])
async def test_a_turn_ends_when_the_callers_rtp_stops_mid_speech(voice: str, stop: str) -> None:
    """RTP that stops mid-speech (``cut``: a lost network, a sender that stopped; ``ended``: the
    track ended) leaves no turn open: the gap is heard as silence, so server_vad ends the turn
    after its silence_duration_ms (500 ms) as OpenAI's does, and the words before it are answered."""
    async with Peer(voice, await secret(voice)) as peer:
        await peer.until("session.created")
        peer.say(speech("What is the capital of France, and what is the capital of Spain?"))
        await peer.until("input_audio_buffer.speech_started", 30)
        await asyncio.sleep(1.2)  # mid-speech
        if stop == "cut":
            peer.mic.cut()
        else:
            peer.mic.stop()
        stopped_at = time.monotonic()
        turn = types(await peer.until("input_audio_buffer.committed", 5))
        waited = time.monotonic() - stopped_at
        assert "input_audio_buffer.speech_stopped" in turn, turn
        assert waited < 2.0, f"the turn ended {waited:.2f} s after the last frame"
        answer = await peer.until("response.done", 60)
        assert answer[-1]["response"]["status"] == "completed"


async def test_signalling_is_refused_without_a_live_secret_or_an_offer(voice: str) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        await Peer(voice, "ek_forged").call()
    assert refused.value.code == "invalid_api_key"
    async with httpx.AsyncClient(base_url=voice, headers={"Authorization": f"Bearer {KEY}"}) as client:
        not_sdp = await client.post("/v1/realtime/calls", content="hello", headers={"Content-Type": "application/sdp"})
        assert not_sdp.status_code == 400
        assert not_sdp.json()["error"]["param"] == "sdp"
        wrong_type = await client.post("/v1/realtime/calls", json={"sdp": "v=0"})
        assert wrong_type.status_code == 400
        bad_session = await client.post("/v1/realtime/calls", files={"sdp": (None, "v=0\r\nm=audio 9"),
                                                                     "session": (None, '{"output_modalities": 1}')})
        assert bad_session.status_code == 400
        assert bad_session.json()["error"]["param"] == "session.output_modalities"


async def test_a_form_offer_with_a_session_and_hang_up(voice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A hang-up no process holds is a 404 once every process listening has said so,
    # not when the wait for the holder runs out (it took that wait, 1 s, each time).
    monkeypatch.setattr(webrtc, "HANG_UP_WAIT_SEC", 60.0)
    peer = Peer(voice, KEY)
    try:
        await peer.call(session={"type": "realtime", "instructions": "From the form."})  # multipart, as the SDK sends it
        created = await peer.until("session.created")
        assert created[-1]["session"]["instructions"] == "From the form."
        async with httpx.AsyncClient(base_url=voice, headers={"Authorization": f"Bearer {KEY}"}) as client:
            assert (await client.post(peer.location + "/hangup")).status_code == 200
            async with asyncio.timeout(10):
                assert (await client.post(peer.location + "/hangup")).status_code == 404
                unknown = await client.post("/v1/realtime/calls/rtc_unknown/hangup")
                assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "call_id_not_found"
    finally:
        await peer.__aexit__(None, None, None)


async def refused_status(url: str) -> int:
    """The HTTP status a control socket's handshake is refused with (a 404 with OpenAI's code)."""
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}):
            pass
    response = refused.value.response
    if response.status_code == 404:
        assert json.loads(response.body)["error"]["code"] == "call_id_not_found", response.body
    return response.status_code


async def next_of(control: Any, kind: str) -> dict[str, Any]:
    """The next event of this type on a control socket (others, such as rate limits, may come first)."""
    while (event := json.loads(await asyncio.wait_for(control.recv(), 10)))["type"] != kind:
        pass
    return event  # type: ignore[no-any-return]


async def closed_as_the_call_ended(control: Any) -> None:
    """The control socket is closed for the call's end, with nothing more asked of it."""
    with pytest.raises(websockets.ConnectionClosedOK) as closed:
        async with asyncio.timeout(15):
            while True:
                await control.recv()  # the answer's last events, if any, then the close
    assert closed.value.rcvd is not None and closed.value.rcvd.reason == "the call ended"


async def asked_through(control: Any, peer: Peer, text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A question and a response asked on a backend's control socket: the events of the answer on
    the browser's channel, and on the control socket."""
    await control.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await control.send(json.dumps({"type": "response.create"}))
    on_channel = await peer.until("response.done")
    assert on_channel[-1]["response"]["status"] == "completed"
    assert f"echo: {text}" in json.dumps(on_channel)
    seen: list[dict[str, Any]] = []
    while not seen or seen[-1]["type"] != "response.done":
        seen.append(json.loads(await asyncio.wait_for(control.recv(), 10)))
    return on_channel, seen


async def test_a_backend_attaches_to_the_call_with_call_id(voice: str) -> None:
    ws_url = voice.replace("http", "ws") + "/v1/realtime"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert await refused_status(ws_url + "?call_id=rtc_nope") == 404
    async with Peer(voice, await secret(voice, output_modalities=["text"])) as peer:
        await peer.until("session.created")
        call_id = peer.location.rsplit("/", 1)[1]
        async with websockets.connect(f"{ws_url}?call_id={call_id}", additional_headers=auth) as control:
            on_channel, seen = await asked_through(control, peer, "hi there")
            assert "response.created" in types(seen) and "echo: hi there" in json.dumps(seen)
            await peer.__aexit__(None, None, None)  # the browser hangs up: the call ends
            await closed_as_the_call_ended(control)


async def test_a_backend_socket_that_reaches_another_process_is_relayed_the_call(redis_url: str) -> None:
    """A call lives in the process that answered its offer; a backend's ``?call_id=`` socket reaches
    any process (the edge round robins, a replica runs API workers). That one relays the call."""
    settings = make_settings(redis_url=redis_url, api_keys=KEY)
    engine = ScriptedEngine()
    auth = {"Authorization": f"Bearer {KEY}"}
    async with live_app(settings, engine) as holder, live_app(settings, engine) as other:
        elsewhere = other.replace("http", "ws") + "/v1/realtime"
        assert await refused_status(elsewhere + "?call_id=rtc_nope") == 404  # every process said no: at once
        async with Peer(holder, await secret(holder, output_modalities=["text"])) as peer:
            await peer.until("session.created")
            call_id = peer.location.rsplit("/", 1)[1]
            async with websockets.connect(f"{elsewhere}?call_id={call_id}", additional_headers=auth) as control:
                on_channel, seen = await asked_through(control, peer, "hi there")
                # The same events, in the same order, as the browser's channel.
                assert "response.output_text.delta" in types(seen)
                assert [e["event_id"] for e in seen] == [e["event_id"] for e in on_channel]
                await control.send("{not json")  # the socket's own mistake: said on it, the call goes on
                error = await next_of(control, "error")
                assert error["error"]["code"] == "invalid_json", error
                peer.send({"type": "conversation.item.create", "item": {  # the browser's turn: the socket sees it
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "and you"}]}})
                peer.send({"type": "response.create"})
                assert "echo: and you" in json.dumps(await next_of(control, "response.done"))
                await peer.until("response.done")
                await peer.__aexit__(None, None, None)  # the browser hangs up: the call ends
                await closed_as_the_call_ended(control)


async def test_a_relayed_control_socket_closes_when_the_calls_process_goes_silent(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quiet call's holder says it is alive; when it says nothing (its process died, and the call's
    media with it), the socket on the other process takes the call for over and closes."""
    monkeypatch.setattr(sideband, "ALIVE_EVERY_SEC", 0.2)
    silent = asyncio.Event()
    tell = SessionStore.tell_sideband

    async def holder_dies(store: SessionStore, attachment: str, direction: str, message: str) -> None:
        if not (direction == "out" and silent.is_set()):  # what a dead process no longer says
            await tell(store, attachment, direction, message)

    monkeypatch.setattr(SessionStore, "tell_sideband", holder_dies)
    settings = make_settings(redis_url=redis_url, api_keys=KEY)
    async with live_app(settings, ScriptedEngine()) as holder, live_app(settings, ScriptedEngine()) as other, \
            Peer(holder, await secret(holder, output_modalities=["text"])) as peer:
        await peer.until("session.created")
        call_id = peer.location.rsplit("/", 1)[1]
        url = f"{other.replace('http', 'ws')}/v1/realtime?call_id={call_id}"
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as control:
            await asyncio.sleep(1.5)  # quiet for longer than a silent holder is given
            await asked_through(control, peer, "still there")  # kept open by the holder's word
            silent.set()
            await closed_as_the_call_ended(control)


async def test_a_call_ends_when_the_browser_closes_its_peer_connection(voice: str) -> None:
    async with Peer(voice, KEY) as peer:
        await peer.until("session.created")
    # The peer is closed: the server's side of the call ends (its data channel closes) and is
    # forgotten, which a control socket sees (404), without hanging up itself.
    call_url = f"{voice.replace('http', 'ws')}/v1/realtime?call_id={peer.location.rsplit('/', 1)[1]}"
    async with asyncio.timeout(15):
        while True:
            try:
                async with websockets.connect(call_url, additional_headers={"Authorization": f"Bearer {KEY}"}):
                    await asyncio.sleep(0.2)
            except websockets.InvalidStatus as refused:
                assert refused.response.status_code == 404
                break


async def test_a_call_that_broke_off_is_offered_again_on_another_replica_and_its_answer_completes(
        redis_url: str) -> None:
    """A call cannot move (its media is the replica's), its conversation can: the caller offers again
    to another replica with ``session_id`` and ``last_event_id``, and the answer in flight goes on from
    there, nothing of it twice."""
    slow = ScriptedEngine(Script(word_delay_sec=0.15))
    settings = make_settings(redis_url=redis_url, api_keys=KEY)
    async with live_app(settings, slow) as a, live_app(settings, slow) as b:
        text = {"type": "realtime", "output_modalities": ["text"]}
        first = Peer(a, await secret(a, output_modalities=["text"]))
        try:
            await first.call(session=text)
            conversation = (await first.until("session.created"))[-1]["session"]["id"]
            first.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "one two three four five six seven eight nine ten"}]}})
            first.send({"type": "response.create"})
            before = await first.until("response.output_text.delta")
            before += [await first.events.get() for _ in range(2)]  # a few words heard, then the call breaks
        finally:
            await first.__aexit__(None, None, None)
        refused = Peer(b, await secret(b))
        try:
            with pytest.raises(openai.NotFoundError):
                await refused.call(resume={"session_id": "sess_nope"})
        finally:
            await refused.__aexit__(None, None, None)
        async with Peer(b, await secret(b)) as probe:  # the replica is up; now the resumed call
            await probe.until("session.created")
        second = Peer(b, await secret(b))
        try:
            await second.call(resume={"session_id": conversation, "last_event_id": before[-1]["event_id"]})
            after = await second.until("response.done", 30)
        finally:
            await second.__aexit__(None, None, None)
    assert after[0]["type"] == "session.created" and after[0]["session"]["id"] == conversation
    assert after[-1]["response"]["status"] == "completed"
    said = "".join(e["delta"] for e in before + after if e["type"] == "response.output_text.delta")
    assert said == "echo: one two three four five six seven eight nine ten", said
