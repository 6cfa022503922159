"""The voice page (/demo) in a real Chromium: Debian's ``chromium`` driven by
Playwright, its fake microphone playing a spoken question from a WAV file,
against a real gateway (uvicorn, real Redis) whose engine hears (Moonshine)
and speaks (hibari). The page calls /v1/realtime/calls over WebRTC with a
client secret from its own endpoint (the default), or talks to the
/v1/realtime WebSocket (the fallback), like any browser client.

Screenshots go to ``test-artifacts/`` (gitignored); each test prints its path.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiortc import RTCPeerConnection
from playwright.async_api import Browser, Page, async_playwright

from gateway.api.demo.router import FILES
from omni_adapter.audio import resample, wav_of
from omni_adapter.listener import with_listener
from omni_adapter.scripted import Script, ScriptedEngine
from omni_adapter.talker import with_talker
from tests.gateway.client import app_client, live_app, make_settings
from tests.gateway.test_api import assert_error
from tests.voice import SPEECH_RATE, speech

QUESTION = "What is the capital of France?"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
#: Chromium's fake capture device reads WAV files at 48 kHz without surprises.
MIC_RATE = 48_000
#: Chromium, headless and quiet: no GPU, no network of its own, the fake microphone allowed.
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required"]

#: Silence before the question in the microphone's file. The file plays from when the page opens
#: the microphone, and the page listens once connected (a WebRTC call: offer, answer, ICE); the
#: question must not start before. With 0.3 s, a loaded CI machine connected later, and the
#: Listener heard "The Battle of France." for the question's end.
LEAD_SEC = 1.5


def held_ms() -> float:
    """How long to hold the button once the page listens: until the file's question has ended."""
    return (LEAD_SEC + len(speech(QUESTION)) / 2 / SPEECH_RATE) * 1000 + 800


def spoken_question(path: Path, before_sec: float, after_sec: float) -> Path:
    """The question as the microphone hears it: silence, hibari speaking, silence; 48 kHz pcm16 WAV."""
    pcm = bytes(2 * int(SPEECH_RATE * before_sec)) + speech(QUESTION) + bytes(2 * int(SPEECH_RATE * after_sec))
    path.write_bytes(wav_of(resample(pcm, SPEECH_RATE, MIC_RATE), MIC_RATE))
    return path


@asynccontextmanager
async def chromium(mic_wav: Path | None, *, allow_mic: bool = True) -> AsyncIterator[Browser]:
    """A real Chromium; ``mic_wav`` plays once as the microphone (``%noloop``), then silence."""
    args = list(ARGS)
    if allow_mic:
        args.append("--use-fake-ui-for-media-stream")  # grants the microphone without a prompt
    if mic_wav is not None:
        args.append(f"--use-file-for-fake-audio-capture={mic_wav}%noloop")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            yield browser
        finally:
            await browser.close()


async def open_page(browser: Browser, url: str, errors: list[str]) -> Page:
    page = await browser.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    await page.goto(f"{url}/demo")
    await page.wait_for_selector("body[data-loaded]")
    return page


async def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


async def turn_texts(page: Page) -> dict[str, Any]:
    return await page.evaluate("""() => {
        const turn = document.querySelector('#turns .turn:last-child');
        return {you: turn.querySelector('.you').textContent, assistant: turn.querySelector('.assistant').textContent,
                audio: turn.dataset.audioStarted || null, status: turn.dataset.status || null,
                latency: document.getElementById('latency').dataset.ms || null,
                error: document.body.dataset.error || null};
    }""")


def heard_the_question(text: str) -> bool:
    return "capital of france" in text.lower()


# --- served only when enabled ---------------------------------------------------------


@pytest.mark.parametrize("enabled", [False, True])
async def test_the_page_is_served_only_when_enabled(redis_url: str, enabled: bool) -> None:
    async with app_client(make_settings(redis_url=redis_url, demo=enabled), ScriptedEngine()) as client:
        page = await client.get("/demo")
        if not enabled:
            assert_error(page, 404, "not_found")
            assert_error(await client.get("/demo/demo.js"), 404, "not_found")
            return
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert 'src="demo/demo.js"' in page.text
        for name, media_type in FILES.items():
            asset = await client.get(f"/demo/{name}")
            assert asset.status_code == 200, name
            assert asset.headers["content-type"] == media_type
            assert asset.content
        assert_error(await client.get("/demo/router.py"), 404, "not_found")  # only the page's files
        assert not any(p.startswith("/demo") for p in (await client.get("/openapi.json")).json()["paths"])


async def test_the_page_gets_a_client_secret_without_a_key_and_it_opens_only_realtime(redis_url: str) -> None:
    """The page's backend endpoint: no key reaches the browser, so the page may stay on in production."""
    settings = make_settings(redis_url=redis_url, demo=True, api_keys="sk-right")
    async with app_client(settings, ScriptedEngine()) as client:
        minted = await client.post("/demo/client_secret")
        assert minted.status_code == 200, minted.text
        secret = minted.json()["value"]
        assert secret.startswith("ek_") and minted.json()["expires_at"] > time.time()
        bearer = {"Authorization": f"Bearer {secret}"}
        assert_error(await client.get("/v1/models", headers=bearer), 401, "invalid_api_key")
        assert_error(await client.post("/v1/sessions", json={}, headers=bearer), 401, "invalid_api_key")
    async with app_client(make_settings(redis_url=redis_url, demo=False), ScriptedEngine()) as client:
        assert_error(await client.post("/demo/client_secret"), 404, "not_found")


def test_the_page_ships_in_the_package() -> None:
    """The wheel takes package data by pattern: every file the router serves must match it."""
    import tomllib

    patterns = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["gateway"]
    static = Path(__file__).resolve().parents[2] / "gateway" / "api" / "demo" / "static"
    assert "api/demo/static/*" in patterns
    assert sorted(p.name for p in static.iterdir()) == sorted(FILES)


# --- in a real Chromium ------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["webrtc", "websocket"])
async def test_push_to_talk_shows_the_transcript_the_answer_and_plays_it(
        redis_url: str, tmp_path: Path, transport: str) -> None:
    """Hold the button while the fake microphone speaks, release: the question is
    heard (real Listener), answered (scripted Thinker: it echoes) and spoken (real Talker).
    Over WebRTC on a gateway that requires API keys, with none typed: the page's secret is enough."""
    wav = spoken_question(tmp_path / "question.wav", before_sec=LEAD_SEC, after_sec=0.3)
    engine = with_talker(with_listener(ScriptedEngine()))
    errors: list[str] = []
    keys = "sk-right" if transport == "webrtc" else None
    async with live_app(make_settings(redis_url=redis_url, demo=True, api_keys=keys), engine) as url, \
            chromium(wav) as browser:
        page = await open_page(browser, url, errors)
        await page.check(f"input[name=transport][value={transport}]")
        talk = page.locator("#talk")
        box = await talk.bounding_box()
        assert box is not None
        await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        await page.mouse.down()  # opens the microphone: the file starts playing now
        await page.wait_for_selector("body[data-state=listening]", timeout=15_000)
        await page.wait_for_timeout(held_ms())
        await page.mouse.up()
        await page.wait_for_selector("#turns .turn[data-audio-started]", timeout=60_000)
        await page.wait_for_selector("#turns .turn[data-status]", timeout=60_000)
        seen = await turn_texts(page)
        await screenshot(page, f"demo-push-to-talk-{transport}")
    assert heard_the_question(seen["you"]), seen
    assert "echo:" in seen["assistant"] and heard_the_question(seen["assistant"]), seen
    assert seen["status"] == "completed", seen
    assert seen["latency"] is not None and 0 <= int(seen["latency"]) < 30_000, seen
    assert seen["error"] is None and not errors, (seen, errors)


def go_silent() -> None:
    """The call's server side stops sending anything at all, as a killed replica does: its UDP
    sockets close without a word (no DTLS alert, no SCTP abort), so the browser hears nothing
    more and is told nothing. (The gateway runs in this process; the page's peer, in Chromium,
    is the only peer connection it holds.)"""
    [pc] = [o for o in gc.get_objects() if isinstance(o, RTCPeerConnection) and o.connectionState == "connected"]
    for transceiver in pc.getTransceivers():
        for protocol in transceiver.receiver.transport.transport._connection._protocols:
            protocol.transport.close()


@pytest.mark.parametrize("breaks", ["hung up", "silent"])
async def test_a_call_that_breaks_off_mid_answer_resumes_and_the_answer_completes(
        redis_url: str, tmp_path: Path, breaks: str) -> None:
    """The call's server side ends mid-answer (hung up), or goes silent as a replica that dies
    does: the page offers again with the conversation and its last event, and the answer goes on."""
    wav = spoken_question(tmp_path / "question.wav", before_sec=LEAD_SEC, after_sec=0.3)
    engine = with_talker(with_listener(ScriptedEngine(Script(word_delay_sec=0.4))))
    errors: list[str] = []
    async with live_app(make_settings(redis_url=redis_url, demo=True), engine) as url, \
            chromium(wav) as browser, httpx.AsyncClient(base_url=url) as http:
        page = await open_page(browser, url, errors)
        talk = page.locator("#talk")
        await talk.dispatch_event("pointerdown")
        await page.wait_for_selector("body[data-state=listening]", timeout=15_000)
        await page.wait_for_timeout(held_ms())
        await talk.dispatch_event("pointerup")
        await page.wait_for_function("() => document.querySelector('#turns .assistant')?.textContent.length > 0",
                                     timeout=60_000)
        call = await page.evaluate("() => document.body.dataset.call")
        if breaks == "hung up":
            secret = (await http.post("/demo/client_secret")).json()["value"]  # the call's identity: demo
            hung_up = await http.post(f"{call}/hangup", headers={"Authorization": f"Bearer {secret}"})
            assert hung_up.status_code == 200, hung_up.text
        else:
            go_silent()
        await page.wait_for_function(f"() => document.body.dataset.call && document.body.dataset.call !== '{call}'",
                                     timeout=20_000)
        await page.wait_for_selector("#turns .turn[data-status]", timeout=60_000)
        seen = await turn_texts(page)
    assert seen["status"] == "completed", seen
    assert seen["assistant"].startswith("echo:") and heard_the_question(seen["assistant"]), seen
    assert seen["assistant"].count("echo:") == 1, "nothing of the answer twice"
    assert seen["error"] is None and not errors, (seen, errors)


async def test_a_denied_microphone_is_said_clearly(redis_url: str) -> None:
    async with live_app(make_settings(redis_url=redis_url, demo=True), ScriptedEngine()) as url, \
            chromium(None, allow_mic=False) as browser:
        page = await open_page(browser, url, [])
        await page.context.clear_permissions()
        await page.locator("#talk").dispatch_event("pointerdown")
        await page.wait_for_selector("body[data-error]", timeout=15_000)
        message = await page.locator("#error").text_content()
    assert message is not None and "Microphone access was denied" in message, message


async def test_a_refused_connection_says_why(redis_url: str, tmp_path: Path) -> None:
    """The WebSocket with a wrong API key: the handshake is refused, and the page shows the gateway's own message."""
    wav = spoken_question(tmp_path / "question.wav", before_sec=0.3, after_sec=0.3)
    settings = make_settings(redis_url=redis_url, demo=True, api_keys="sk-right")
    # An engine that hears: once connected, the microphone's appends are taken, not refused.
    async with live_app(settings, with_listener(ScriptedEngine())) as url, chromium(wav) as browser:
        page = await open_page(browser, url, [])
        await page.check("input[name=transport][value=websocket]")
        await page.fill("#api-key", "sk-wrong")
        await page.locator("#talk").dispatch_event("pointerdown")
        await page.wait_for_selector("body[data-error]", timeout=15_000)
        refused = await page.locator("#error").text_content()
        await page.locator("#talk").dispatch_event("pointerup")
        await page.fill("#api-key", "sk-right")
        await page.locator("#talk").dispatch_event("pointerdown")
        await page.wait_for_selector("body[data-state=listening]", timeout=15_000)
        still_failing = await page.evaluate("() => document.body.dataset.error || null")
        await screenshot(page, "demo-api-key")
    assert refused is not None and "(401)" in refused and "key" in refused.lower(), refused
    assert still_failing is None, still_failing


async def test_the_resampler_keeps_the_pitch(redis_url: str) -> None:
    """48 kHz (the usual microphone rate) to 24 kHz, fed in uneven batches as the worklet does."""
    async with live_app(make_settings(redis_url=redis_url, demo=True), ScriptedEngine()) as url, \
            chromium(None) as browser:
        page = await open_page(browser, url, [])
        result = await page.evaluate("""async () => {
            const {Resampler, floatToPcm16, pcm16Bytes, bytesToBase64, base64ToBytes} = await import('./demo/pcm.js');
            const r = new Resampler(48000, 24000);
            const input = Float32Array.from({length: 48000}, (_, i) => Math.sin(2 * Math.PI * 440 * i / 48000));
            const out = [];
            for (let i = 0; i < input.length; i += 937) out.push(...r.push(input.subarray(i, i + 937)));
            let crossings = 0;
            for (let i = 1; i < out.length; i++) if (out[i - 1] < 0 && out[i] >= 0) crossings++;
            const pcm = floatToPcm16(Float32Array.from([0, 0.5, -1, 1]));
            const back = base64ToBytes(bytesToBase64(pcm16Bytes(pcm)));
            return {length: out.length, crossings, pcm: Array.from(pcm), bytes: Array.from(back)};
        }""")
    assert abs(result["length"] - 24_000) <= 1, result["length"]
    assert 439 <= result["crossings"] <= 440, result["crossings"]
    assert result["pcm"] == [0, 16383, -32768, 32767]
    assert result["bytes"] == [0, 0, 0xFF, 0x3F, 0, 0x80, 0xFF, 0x7F]  # little-endian pcm16


@pytest.mark.engine
@pytest.mark.timeout(600)  # a cold engine start (~100 s) may fall in this test, beside ~75 s in the browser
async def test_hands_free_on_the_real_engine(redis_url: str, vllm_engine: Any, tmp_path: Path) -> None:
    """The issue's check: server turn detection, the real vLLM engine, Listener and Talker."""
    wav = spoken_question(tmp_path / "question.wav", before_sec=1.0, after_sec=4.0)
    engine = with_talker(with_listener(vllm_engine))
    errors: list[str] = []
    async with live_app(make_settings(redis_url=redis_url, demo=True), engine) as url, \
            chromium(wav) as browser:
        page = await open_page(browser, url, errors)
        await page.click("#settings summary")
        await page.fill("#max-tokens", "24")
        await page.check("input[name=mode][value=vad]")
        await page.locator("#talk").click()
        await page.wait_for_selector("#turns .turn[data-audio-started]", timeout=180_000)
        await page.wait_for_selector("#turns .turn[data-status]", timeout=120_000)
        seen = await turn_texts(page)
        await screenshot(page, "demo-hands-free")
    assert heard_the_question(seen["you"]), seen
    assert "Paris" in seen["assistant"], seen
    assert seen["status"] == "completed", seen
    assert seen["latency"] is not None and 0 <= int(seen["latency"]) < 60_000, seen
    assert seen["error"] is None and not errors, (seen, errors)
