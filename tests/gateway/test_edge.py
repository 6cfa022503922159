"""Through a real NGINX edge (rendered from the production Ingress by deploy/edge_nginx.py)
in front of two real gateways on one real Redis, round robin.

Each test proves settings of ``deploy/api-gateway/ingress-nginx.yaml``: SSE
frames arrive as they are made (proxy-buffering off, and the gateway's
X-Accel-Buffering: no on its own), proxy-request-buffering off (a Mode A upload
reaches the gateway while it is sent; this test fails with buffering on), the
WebSocket upgrade with the browser's subprotocols, X-Request-ID end to end,
proxy-body-size (the gateway's envelope below it, JSON from the edge above),
and WebRTC calls' signalling (SDP and multipart offers, Location, a hangup
that lands on the replica that does not hold the call).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import websockets
from aiortc import RTCPeerConnection

from deploy.edge_nginx import INGRESS, render
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, content_of, live_app, make_settings, parse_sse
from tests.gateway.webrtc_peer import Peer
from tests.redis_server import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
KEY = "sk-edge"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def nginx(upstreams: list[str], workdir: Path, ingress: Path = INGRESS) -> Iterator[str]:
    """Real NGINX in front of ``upstreams``, configured from ``ingress``; its URL."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(render(upstreams, port, workdir, ingress))
    proc = subprocess.Popen([NGINX, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    try:  # from here on NGINX is stopped whatever happens, a failed start too
        while True:
            try:
                httpx.get(f"{url}/edge-itself", timeout=1)  # NGINX answers: the gateways share this loop
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "nginx exited"
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@dataclass
class Edge:
    url: str
    engines: list[ScriptedEngine]
    #: The replicas behind it, each reached directly.
    gateways: list[str]


@asynccontextmanager
async def edge_of(redis_url: str, workdir: Path, script: Script | None = None) -> AsyncIterator[Edge]:
    settings = make_settings(redis_url=redis_url, api_keys=KEY)
    engines = [ScriptedEngine(script or Script()) for _ in range(2)]
    async with live_app(settings, engines[0]) as a, live_app(settings, engines[1]) as b:
        with nginx([a.removeprefix("http://"), b.removeprefix("http://")], workdir) as url:
            yield Edge(url, engines, [a, b])


@pytest.fixture
async def edge(redis_url: str, tmp_path: Path) -> AsyncIterator[Edge]:
    async with edge_of(redis_url, tmp_path / "edge", Script(word_delay_sec=0.15)) as e:
        yield e


async def test_sse_frames_arrive_as_they_are_made_and_resume_on_any_replica(edge: Edge) -> None:
    text = "one two three four five six seven eight"
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as client:
        sid = (await client.post(BASE, json={})).json()["session_id"]
        await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": text, "end_of_input": True})
        arrivals: list[float] = []
        seen: list[str] = []
        started = time.monotonic()
        async with client.stream("GET", f"{BASE}/{sid}/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("id:"):
                    seen.append(line[3:].strip())
                if line.startswith("data:") and '"content"' in line:
                    arrivals.append(time.monotonic() - started)
                if len(arrivals) == 3:
                    break  # the client goes away mid-answer
        # Unbuffered: the first words came long before the answer (9 words, 0.15 s apart) was done.
        assert arrivals[0] < 0.8, arrivals
        rest = await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": seen[-1]})
        whole = parse_sse((await client.get(f"{BASE}/{sid}/events")).text)
    assert content_of(whole) == f"echo: {text}"
    assert content_of(whole).endswith(content_of(parse_sse(rest.text)))
    assert len(content_of(parse_sse(rest.text))) < len(content_of(whole))


async def test_a_mode_a_upload_streams_through_without_request_buffering(edge: Edge) -> None:
    async def fed_anywhere() -> None:
        async with asyncio.timeout(10):
            while not any(e.sessions and e.sessions[0].fed for e in edge.engines):  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    async def body() -> AsyncIterator[bytes]:
        yield json.dumps({"start_policy": "on_first_chunk"}).encode() + b"\n"
        yield json.dumps({"sequence_id": 0, "text": "through "}).encode() + b"\n"
        await fed_anywhere()  # NGINX passed the first record on before the upload ended
        yield json.dumps({"sequence_id": 1, "text": "the edge", "end_of_input": True}).encode() + b"\n"

    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as client:
        response = await client.post("/v1/streaming_input/upload", content=body(),
                                     headers={"Content-Type": "application/x-ndjson"})
    assert response.headers["X-Session-Id"].startswith("sis-")
    assert content_of(parse_sse(response.text)) == "echo: through the edge"


async def test_realtime_upgrades_through_the_edge_with_the_browser_subprotocols(edge: Edge) -> None:
    ws_url = edge.url.replace("http", "ws") + "/v1/realtime"
    async with websockets.connect(ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello edge"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        deltas = []
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "response.done":
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
    assert "".join(deltas) == "echo: hello edge"


async def test_webrtc_calls_are_signalled_through_the_edge_and_hung_up_from_any_replica(edge: Edge) -> None:
    """The offer (the SDK's multipart form, a bare ``application/sdp`` body: here a text client's,
    the data channel alone) and the answer's
    ``Location`` pass the edge as the gateway wrote them; the media goes straight to the replica
    that answered. A hangup the round robin sends to the other replica ends the call too."""
    turn = [{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "through the edge"}]}}, {"type": "response.create"}]
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30) as client:
        peer = Peer(edge.url, KEY)  # signalled through the edge, media to the replica
        try:
            await peer.call(session={"type": "realtime", "output_modalities": ["text"]})  # multipart
            assert re.fullmatch(r"/v1/realtime/calls/rtc_[\w-]+", peer.location), peer.location
            await peer.until("session.created")
            for event in turn:
                peer.send(event)
            assert "echo: through the edge" in json.dumps(await peer.until("response.done"))
            assert (await client.post(peer.location + "/hangup")).status_code == 200
            await asyncio.wait_for(peer.hung_up.wait(), 10)
            assert (await client.post(peer.location + "/hangup")).status_code == 404
        finally:
            await peer.__aexit__(None, None, None)

        offer = RTCPeerConnection()
        try:
            offer.createDataChannel("oai-events")
            await offer.setLocalDescription(await offer.createOffer())
            bare = await client.post("/v1/realtime/calls", content=offer.localDescription.sdp,
                                     headers={"Content-Type": "application/sdp"})
            assert bare.status_code == 201, bare.text
            assert bare.headers["content-type"].startswith("application/sdp") and "a=candidate:" in bare.text
            assert bare.headers["location"].startswith("/v1/realtime/calls/rtc_")
            assert (await client.post(bare.headers["location"] + "/hangup")).status_code == 200
        finally:
            await offer.close()

    # A call held by replica A, hung up on replica B: B asks A through Redis, A ends it.
    a, b = edge.gateways
    async with Peer(a, KEY) as peer, httpx.AsyncClient(headers=AUTH, timeout=30) as client:
        await peer.until("session.created")
        assert (await client.post(b + peer.location + "/hangup")).status_code == 200
        await asyncio.wait_for(peer.hung_up.wait(), 10)
        assert (await client.post(a + peer.location + "/hangup")).status_code == 404
        assert (await client.post(b + "/v1/realtime/calls/rtc_nope/hangup")).status_code == 404


async def test_request_ids_and_body_caps_agree_with_the_gateway(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=60) as client:
        tagged = await client.get(f"{BASE}/sis-none", headers={"X-Request-Id": "req-edge-1"})
        assert tagged.status_code == 404 and tagged.headers["X-Request-Id"] == "req-edge-1"
        assert (await client.get(f"{BASE}/sis-none")).headers["X-Request-Id"], "one is made when none is sent"
        sid = (await client.post(BASE, json={})).json()["session_id"]
        # Over the gateway's chunk cap (16 MiB), under the edge's (23m): the gateway answers, in its envelope.
        over_gateway = await client.post(f"{BASE}/{sid}/chunks", content=b"x" * (16 * 1024 * 1024 + 1), headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "0"})
        assert over_gateway.status_code == 413 and over_gateway.json()["error"]["code"] in (
            "chunk_too_large", "request_too_large")
        # Over the edge's cap: the edge answers, in the same envelope.
        over_edge = await client.post(f"{BASE}/{sid}/chunks", content=b"x" * (24 * 1024 * 1024), headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "0"})
        assert over_edge.status_code == 413 and over_edge.json()["error"]["code"] == "request_too_large"
        # Not routed by the edge: metrics and probes stay inside.
        assert (await client.get("/metrics")).status_code == 404


async def test_the_edges_rate_limit_answers_in_the_gateways_envelope(edge: Edge) -> None:
    # limit-rps 50 with a burst of 4 x 50: a burst of 300 requests from one address is cut.
    async with httpx.AsyncClient(base_url=edge.url, headers=AUTH, timeout=30,
                                 limits=httpx.Limits(max_connections=300)) as client:
        answers = await asyncio.gather(*(client.get("/v1/models") for _ in range(300)))
    limited = [r for r in answers if r.status_code == 429]
    assert limited and all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in limited)
    assert limited[0].headers["Retry-After"] == "1"
    assert sum(r.status_code == 200 for r in answers) >= 200


async def test_the_openai_client_streams_through_the_edge(edge: Edge) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=KEY, max_retries=0)
    stream = await client.chat.completions.create(
        model="scripted", stream=True, messages=[{"role": "user", "content": "hi there"}])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "echo: hi there"


async def test_an_idle_stream_outlives_the_proxy_read_timeout_on_pings(redis_url: str, tmp_path: Path) -> None:
    """The edge's read timeout cuts a silent upstream; the gateway's SSE pings keep a waiting stream alive.

    The same Ingress with the timeouts cut to 2 s, and pings every second: a
    stream that waits 5 s for input is not cut, and then gets its answer.
    """
    ingress = tmp_path / "ingress.yaml"
    ingress.write_text(INGRESS.read_text().replace('proxy-read-timeout: "360"', 'proxy-read-timeout: "2"'))
    settings = make_settings(redis_url=redis_url, api_keys=KEY, sse_ping_sec=1)
    async with live_app(settings, ScriptedEngine()) as a:
        with nginx([a.removeprefix("http://")], tmp_path / "edge", ingress) as url:
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
                sid = (await client.post(BASE, json={})).json()["session_id"]

                async def later() -> None:
                    await asyncio.sleep(5)
                    await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "late",
                                                                     "end_of_input": True})

                sender = asyncio.create_task(later())
                body = (await client.get(f"{BASE}/{sid}/events")).text
                await sender
    assert content_of(parse_sse(body)) == "echo: late"
    before_the_answer = body.split("id:", 1)[0]
    assert before_the_answer.strip() == "" and before_the_answer.count("\n") >= 3, "a keep-alive each second"
