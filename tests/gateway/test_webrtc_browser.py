"""A real Chromium calls ``/v1/realtime/calls`` with a client secret, as OpenAI's WebRTC guide does.

Debian's chromium (Playwright), its fake microphone playing a spoken
question; a real gateway (uvicorn, real Redis) whose engine hears (Moonshine)
and speaks (hibari), the Thinker scripted (it echoes). The page's script is
the guide's: a peer connection with the microphone track and the
``oai-events`` data channel, the offer posted with the secret. The answer's
track is recorded in the page and recognized here; the page clears an answer,
and a second voice on the microphone track (``replaceTrack``) barges in.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
from playwright.async_api import Page
from playwright.async_api import TimeoutError as PlaywrightTimeout

from omni_adapter.listener import with_listener
from omni_adapter.scripted import ScriptedEngine
from omni_adapter.talker import with_talker
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_client_secrets import KEY
from tests.gateway.test_demo_page import chromium, spoken_question
from tests.gateway.test_realtime import sdk
from tests.voice import SPEECH_RATE, recognize

#: OpenAI's WebRTC example, plus a recorder of the answer's track (24 kHz floats in window.heard).
CALL = """async ({secret}) => {
    const pc = new RTCPeerConnection();
    window.events = [];
    window.heard = [];
    const channel = window.channel = pc.createDataChannel("oai-events");
    channel.onmessage = (e) => window.events.push(JSON.parse(e.data));
    // The microphone opens once the call is up: the fake device plays its file from that moment,
    // and RTP sent before ICE and DTLS are through would be lost.
    window.sender = pc.addTransceiver("audio", {direction: "sendrecv"}).sender;
    channel.onopen = async () => {
        const mic = await navigator.mediaDevices.getUserMedia({audio: true});
        await window.sender.replaceTrack(mic.getTracks()[0]);
    };
    pc.ontrack = (e) => {
        const stream = new MediaStream([e.track]);
        // Chromium feeds a remote track to Web Audio only while a media element plays it.
        const element = new Audio();
        element.muted = true;
        element.srcObject = stream;
        element.play();
        const context = new AudioContext({sampleRate: 24000});
        const recorder = context.createScriptProcessor(4096, 1, 1);
        recorder.onaudioprocess = (a) => { for (const x of a.inputBuffer.getChannelData(0)) window.heard.push(x); };
        context.createMediaStreamSource(stream).connect(recorder);
        recorder.connect(context.destination);
    };
    await pc.setLocalDescription(await pc.createOffer());
    const answer = await fetch("/v1/realtime/calls", {
        method: "POST", body: pc.localDescription.sdp,
        headers: {Authorization: `Bearer ${secret}`, "Content-Type": "application/sdp"}});
    if (answer.status !== 201) return `${answer.status} ${await answer.text()}`;
    await pc.setRemoteDescription({type: "answer", sdp: await answer.text()});
    window.pc = pc;
    return answer.headers.get("Location");
}"""

#: A client event on the call's data channel.
SEND = "(event) => window.pc && window.channel.send(JSON.stringify(event))"


async def wait_for_event(page: Page, kind: str, after: int = 0, within_sec: float = 60) -> None:
    """Until the call's data channel brings ``kind`` (after the first ``after`` events); else say what came."""
    try:
        await page.wait_for_function(f"() => window.events.slice({after}).some((e) => e.type === '{kind}')",
                                     timeout=within_sec * 1000)
    except PlaywrightTimeout:
        seen = await page.evaluate("window.events.map((e) => e.type)")
        raise AssertionError(f"no {kind} within {within_sec} s; the call sent {seen}") from None


async def test_chromium_calls_with_a_client_secret_hears_the_answer_and_clears_one(
        redis_url: str, tmp_path: Path) -> None:
    wav = spoken_question(tmp_path / "question.wav", before_sec=0.5, after_sec=1.0)
    engine = with_talker(with_listener(ScriptedEngine()))
    async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), engine) as url, chromium(wav) as browser:
        secret = (await sdk(url, api_key=KEY).realtime.client_secrets.create()).value
        page = await browser.new_page()
        await page.goto(f"{url}/healthz")  # the gateway's origin: a same-origin fetch, a secure context
        location = await page.evaluate(CALL, {"secret": secret})
        assert str(location).startswith("/v1/realtime/calls/rtc_"), location
        await wait_for_event(page, "output_audio_buffer.stopped", within_sec=60)
        heard = np.asarray(await page.evaluate("window.heard"), dtype=np.float32)
        kinds = await page.evaluate("window.events.map((e) => e.type)")

        # A typed question on the data channel; while its answer plays, the page clears the buffer.
        after = len(kinds)
        await page.evaluate(SEND, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me more."}]}})
        await page.evaluate(SEND, {"type": "response.create"})
        await wait_for_event(page, "output_audio_buffer.started", after, 60)
        await page.evaluate(SEND, {"type": "output_audio_buffer.clear"})
        await wait_for_event(page, "output_audio_buffer.cleared", after, 30)
        await page.close()
    for expected in ("session.created", "input_audio_buffer.speech_started", "input_audio_buffer.committed",
                     "output_audio_buffer.started", "response.done"):
        assert expected in kinds, kinds
    sound = np.flatnonzero(np.abs(heard) > 0.01)
    assert sound.size, "the answer's track was silent"
    pcm = (np.clip(heard[sound[0]:], -1, 1) * 32767).astype("<i2").tobytes()
    words = recognize(pcm, SPEECH_RATE).lower()
    assert "capital" in words and "france" in words, words


#: A second voice on the call's microphone track: a WAV played through Web Audio (the fake
#: device plays its file once), swapped in with ``replaceTrack`` as an app switches inputs.
SPEAK_AGAIN = """async ({wav}) => {
    const context = new AudioContext({sampleRate: 48000});
    const bytes = Uint8Array.from(atob(wav), (c) => c.charCodeAt(0));
    const source = context.createBufferSource();
    source.buffer = await context.decodeAudioData(bytes.buffer);
    const voice = context.createMediaStreamDestination();
    source.connect(voice);
    await window.sender.replaceTrack(voice.stream.getAudioTracks()[0]);
    source.start();
}"""


async def test_chromium_barges_in_by_voice_and_the_turn_ends(redis_url: str, tmp_path: Path) -> None:
    """While a long answer plays, the caller speaks: the answer's audio is cleared, the caller's
    turn ends when the voice does (the microphone is swapped in Chromium, which leaves a gap in
    its RTP), and the new question is answered."""
    wav = spoken_question(tmp_path / "question.wav", before_sec=0.5, after_sec=1.0)
    engine = with_talker(with_listener(ScriptedEngine()))
    long_text = ("Tell me about the capital of France, its museums, its river and its bridges, "
                 "its parks and its gardens, its old streets and its cafes, please.")
    async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), engine) as url, chromium(wav) as browser:
        secret = (await sdk(url, api_key=KEY).realtime.client_secrets.create()).value
        page = await browser.new_page()
        await page.goto(f"{url}/healthz")
        await page.evaluate(CALL, {"secret": secret})
        await wait_for_event(page, "output_audio_buffer.stopped", within_sec=60)

        after = len(await page.evaluate("window.events"))
        await page.evaluate(SEND, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": long_text}]}})
        await page.evaluate(SEND, {"type": "response.create"})
        await wait_for_event(page, "output_audio_buffer.started", after, 60)
        await page.evaluate(SPEAK_AGAIN, {"wav": base64.b64encode(wav.read_bytes()).decode()})
        await wait_for_event(page, "output_audio_buffer.cleared", after, 30)
        await wait_for_event(page, "input_audio_buffer.speech_stopped", after, 30)
        await wait_for_event(page, "input_audio_buffer.committed", after, 30)
        committed = await page.evaluate(f"window.events.findIndex((e, i) => i >= {after} && "
                                        "e.type === 'input_audio_buffer.committed')")
        await wait_for_event(page, "response.done", committed, 60)  # the spoken question's answer
        kinds = await page.evaluate(f"window.events.slice({after}).map((e) => e.type)")
        done = await page.evaluate(f"window.events.slice({after}).filter((e) => e.type === 'response.done')"
                                   ".map((e) => e.response.status)")
        await page.close()
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("output_audio_buffer.cleared"), kinds
    # The long answer's text was complete before its audio played out (the scripted Thinker is
    # quick): its response is done, its audio cleared; then the spoken question is answered.
    assert len(done) == 2 and done[-1] == "completed", done
