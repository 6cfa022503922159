"""Voice to voice over WebRTC against the WebSocket: end of speech -> first sound of the answer, 1 and 4 calls.

A gateway process on its embedded default (real vLLM on the CPU, the
Listener: Silero VAD + Moonshine, the Talker: hibari) on a real Redis, one
process, as ``bench/voice.py`` runs it. Each turn is a new Realtime
connection with ``server_vad`` turns (OpenAI's defaults: the turn ends after
500 ms of silence), which says one spoken question (hibari, as in
``bench/voice.py``) in real time and waits for the whole answer:

- *WebRTC*: an aiortc caller (``tests/gateway/webrtc_peer.py``, the suite's
  own) calls ``/v1/realtime/calls``; the question plays on its Opus
  microphone track in 20 ms frames, silence after it; the answer comes on the
  answer track, Opus paced in real time.
- *WebSocket*: the same 20 ms frames from the same paced track
  (``media.SpeakerTrack``: speech, then silence, as a microphone sends) go as
  ``input_audio_buffer.append`` events over ``/v1/realtime``.

The clock (``time.monotonic``) runs from the moment the microphone track
hands out the last frame of the speech to the *first audio*: the first answer
frame that is not silence on the WebRTC answer track, the first
``response.output_audio.delta`` on the WebSocket. The Talker's answers start
with ~0.2 s of digital silence, which the track plays in real time and a
delta carries at once, so the report adds the *first sound* as heard: the
WebSocket's first sample that is not silence, played from its first delta on
(the track's is its first audio). It includes server_vad's 500 ms of silence;
the server's ``speech_stopped`` event splits it into the input's side and
the answer's. With 4 calls, the four speak at once (their questions
differ in length, so their ends of speech are spread over ~1 s); the
transports take turns round by round, so both see the same machine.

    python -m bench.webrtc_voice               # writes results/webrtc_voice.{json,md}
    python -m bench.webrtc_voice --turns 2     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import websockets

from bench.overhead import GATEWAY_ENV
from bench.procs import embedded_gateway_on_redis, write_results
from bench.stats import summary
from bench.voice import QUESTIONS
from gateway.api.realtime.media import FRAME_BYTES, RATE, SpeakerTrack
from tests.gateway.webrtc_peer import Peer

RESULTS = Path(__file__).parent / "results"
KEY = "sk-bench"
TRANSPORTS = ("websocket", "webrtc")
CALLS = (1, 4)
#: Turns per transport and number of calls (4 calls: a quarter as many rounds).
TURNS = 8
#: The session both transports open with: short spoken answers; server_vad is the default;
#: transcription events say what the Listener heard (for the results).
SESSION = {"type": "realtime", "instructions": "You are a helpful assistant. Answer in one short sentence.",
           "temperature": 0, "max_output_tokens": 32, "audio": {"input": {"transcription": {}}}}
#: Silence on the microphone between the connection's start and the question (as a person draws breath).
BEFORE_SEC = 0.3
SPANS = ("end_of_speech_to_first_audio_sec", "end_of_speech_to_first_sound_sec",
         "end_of_speech_to_speech_stopped_sec", "speech_stopped_to_first_sound_sec")
TIMEOUT_SEC = 120


def questions() -> list[bytes]:
    """The spoken questions, 24 kHz pcm16, without the 0.5 s of silence ``speech()`` ends in."""
    from tests.voice import speech

    return [speech(q)[:-RATE] for q in QUESTIONS]


def said(events: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """What the server heard (the input transcript) and what it answered (the audio transcript)."""
    heard = next((e["transcript"] for e in events
                  if e["type"] == "conversation.item.input_audio_transcription.completed"), None)
    done = next(e for e in events if e["type"] == "response.done")
    parts = [c.get("transcript") or c.get("text") for item in done["response"].get("output", [])
             for c in item.get("content", [])]
    return heard, " ".join(p for p in parts if p) or None


def failed(events: list[dict[str, Any]]) -> None:
    for event in events:
        if event["type"] == "error":
            raise RuntimeError(f"the server sent an error: {event['error']}")
    done = next(e for e in events if e["type"] == "response.done")
    if done["response"]["status"] != "completed":
        raise RuntimeError(f"the answer did not complete: {done['response'].get('status_details')}")


async def webrtc_turn(url: str, question: bytes) -> dict[str, Any]:
    peer = Peer(url, KEY)
    try:
        await peer.call(session=SESSION)
        events = await peer.until("session.created", TIMEOUT_SEC)
        await asyncio.sleep(BEFORE_SEC)
        peer.say(question)
        events += await peer.until("response.done", TIMEOUT_SEC)
        async with asyncio.timeout(TIMEOUT_SEC):
            await peer.sounding.wait()
    finally:
        await peer.__aexit__(None, None, None)
    failed(events)
    assert peer.said_at is not None and peer.first_sound_at is not None
    # The track is heard as it comes: its first audio is its first sound.
    return timings(peer.said_at, peer.first_sound_at, peer.first_sound_at, peer.arrived) | {"events": events}


async def websocket_turn(url: str, question: bytes) -> dict[str, Any]:
    ended: list[float] = []
    mic = SpeakerTrack(lambda _: None, lambda _: ended.append(time.monotonic()))
    events: list[dict[str, Any]] = []
    arrived: list[tuple[str, float]] = []
    delta_at: float | None = None
    sound_at: float | None = None
    silent = 0  # samples of the answer before its first sound (the Talker's leading silence)
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime", max_size=None,
                                  additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:

        async def microphone() -> None:
            while True:
                frame = await mic.recv()
                pcm = bytes(frame.planes[0])[:FRAME_BYTES]
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))

        await ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        streaming = asyncio.create_task(microphone())
        try:
            async with asyncio.timeout(TIMEOUT_SEC):
                spoke = False
                while not events or events[-1]["type"] != "response.done":
                    events.append(json.loads(await ws.recv()))
                    kind = events[-1]["type"]
                    arrived.append((kind, time.monotonic()))
                    if kind == "error":
                        break
                    if kind == "session.updated" and not spoke:
                        spoke = True
                        await asyncio.sleep(BEFORE_SEC)
                        mic.speak("question", question)
                        mic.spoken("question")
                    elif kind == "response.output_audio.delta" and sound_at is None:
                        now = time.monotonic()
                        delta_at = delta_at or now
                        pcm = np.frombuffer(base64.b64decode(events[-1]["delta"]), dtype="<i2")
                        loud = np.flatnonzero(pcm)
                        if loud.size:  # played from the first delta on, waiting for audio that is late
                            sound_at = max(delta_at + (silent + loud[0]) / RATE, now + loud[0] / RATE)
                        silent += pcm.size
        finally:
            streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await streaming
            mic.stop()
    failed(events)
    assert ended and delta_at is not None and sound_at is not None
    return timings(ended[0], delta_at, sound_at, arrived) | {"events": events}


def timings(speech_end: float, first_audio: float, first_sound: float,
            arrived: list[tuple[str, float]]) -> dict[str, float]:
    """From the end of speech to the first audio (the WebSocket's first delta, the track's first
    sound) and to the first sound as heard (after the answer's leading silence, played in real
    time from its first delta on); where that splits: the server's ``speech_stopped`` (sent after
    server_vad's 500 ms of silence) ends the input side, the rest is the answer's side."""
    stopped = next(t for kind, t in arrived if kind == "input_audio_buffer.speech_stopped")
    return {"end_of_speech_to_first_audio_sec": first_audio - speech_end,
            "end_of_speech_to_first_sound_sec": first_sound - speech_end,
            "end_of_speech_to_speech_stopped_sec": stopped - speech_end,
            "speech_stopped_to_first_sound_sec": first_sound - stopped}


TURN = {"webrtc": webrtc_turn, "websocket": websocket_turn}


async def one_turn(url: str, transport: str, calls: int, question: str, clip: bytes) -> dict[str, Any]:
    turn = await TURN[transport](url, clip)
    heard, answer = said(turn.pop("events"))
    return {"transport": transport, "calls": calls, "question": question, **turn, "heard": heard, "answer": answer}


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far: its threads, not its children (vLLM's engine core is one)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def measure(url: str, turns: int = TURNS, calls: tuple[int, ...] = CALLS, warm_up: bool = True,
                  gateway_pid: int | None = None) -> dict[str, Any]:
    clips = questions()
    if warm_up:  # the first compile of each shape, and aiortc's first call
        for transport in TRANSPORTS:
            await one_turn(url, transport, 1, QUESTIONS[0], clips[0])
    results: list[dict[str, Any]] = []
    #: CPU seconds per case (the gateway process's, this client's), counted round by round.
    cpu: dict[str, list[float]] = {}
    for n in calls:
        for r in range(math.ceil(turns / n)):
            for transport in TRANSPORTS:  # taking turns, so both see the same machine
                picked = [(r * n + i) % len(clips) for i in range(n)]
                before = (cpu_seconds(gateway_pid) if gateway_pid else 0.0, time.process_time())
                results += await asyncio.gather(*(one_turn(url, transport, n, QUESTIONS[q], clips[q])
                                                  for q in picked))
                after = (cpu_seconds(gateway_pid) if gateway_pid else 0.0, time.process_time())
                spent = cpu.setdefault(case_name(transport, n), [0.0, 0.0])
                spent[0] += after[0] - before[0]
                spent[1] += after[1] - before[1]

    def by_case(span: str) -> dict[str, dict[str, float]]:
        return {case_name(transport, n): summary(
            [t[span] for t in results if (t["transport"], t["calls"]) == (transport, n)])
            for n in calls for transport in TRANSPORTS}

    counts = {case: s["n"] for case, s in by_case(SPANS[0]).items()}
    per_turn = {case: {"gateway": round(g / counts[case], 3) if gateway_pid else None,
                       "client": round(c / counts[case], 3)} for case, (g, c) in cpu.items()}
    return {"frame_ms": 20, "session": SESSION, "questions": list(QUESTIONS),
            **{span: by_case(span) for span in SPANS}, "cpu_sec_per_turn": per_turn, "turns": results}


def case_name(transport: str, calls: int) -> str:
    return f"{transport}, {calls} call{'s' if calls > 1 else ''}"


def report(result: dict[str, Any]) -> str:
    audio, sound, heard, answered = (result[span] for span in SPANS)
    cpu = result["cpu_sec_per_turn"]
    rows = ["| transport, calls at once | turns | first audio P50 / P99 (s) | first sound P50 / P99 (s) "
            "| end of speech -> speech_stopped P50 (s) | speech_stopped -> sound P50 (s) "
            "| CPU per turn: gateway / client (s) |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {case} | {a['n']} | {a['p50']} / {a['p99']} | {sound[case]['p50']} / {sound[case]['p99']} "
             f"| {heard[case]['p50']} | {answered[case]['p50']} | {cpu[case]['gateway']} / {cpu[case]['client']} |"
             for case, a in audio.items()]
    return "\n".join(["# Voice to voice: WebRTC against the WebSocket (end of speech -> the answer, server_vad)",
                      "", "First audio: the WebSocket's first response.output_audio.delta, the WebRTC track's "
                      "first frame that is not silence. First sound: the first sample that is not silence, "
                      "as heard (the WebSocket's audio played from its first delta on).", "", *rows, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=TURNS, help="turns per transport and number of calls")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    env = GATEWAY_ENV | {"OMNI_GATEWAY_API_KEYS": KEY}
    with embedded_gateway_on_redis(env) as url:
        (gateway,) = [p for p in psutil.Process().children(recursive=True) if "gateway.runtime.cli" in p.cmdline()]
        result = asyncio.run(measure(url, args.turns, gateway_pid=gateway.pid))
    write_results(args.results, "webrtc_voice", result, report(result))


if __name__ == "__main__":
    main()
