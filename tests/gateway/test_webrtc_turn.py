"""TURN for WebRTC calls: the credentials in ``webrtc_ice_servers`` get a relay from a real TURN server.

A call's answer carries every candidate aiortc gathered before answering; a
``typ relay`` one exists only if the TURN server (Debian's coturn, long-term
credentials) allotted a relay to the username and credential the setting
gave. With a wrong credential the call still answers, on host candidates.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.webrtc_peer import Peer
from tests.redis_server import free_port

USER, PASSWORD = "omni", "s3cret"
KEY = "sk-turn"


@pytest.fixture
def turn_port(tmp_path: Path) -> Iterator[int]:
    """coturn on loopback (UDP and TCP on one port), one user; its state in ``tmp_path``."""
    port = free_port()
    with (tmp_path / "turn.log").open("wb") as log:
        proc = subprocess.Popen(
            ["turnserver", "-n", "--listening-ip=127.0.0.1", f"--listening-port={port}", "--relay-ip=127.0.0.1",
             "--lt-cred-mech", f"--user={USER}:{PASSWORD}", "--realm=omni-gateway", "--no-tls", "--no-dtls",
             "--no-cli", f"--pidfile={tmp_path / 'turn.pid'}", f"--userdb={tmp_path / 'turndb'}",
             "--log-file=stdout", "--simple-log"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:  # it listens on TCP too once its listeners are up
            assert proc.poll() is None, (tmp_path / "turn.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "coturn did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def answer_sdp(redis_url: str, ice_server: dict[str, str]) -> str:
    settings = make_settings(redis_url=redis_url, api_keys=KEY, webrtc_ice_servers=[ice_server])
    async with live_app(settings, ScriptedEngine()) as url:
        peer = Peer(url, KEY)
        try:
            await peer.call()
            return str(peer.pc.remoteDescription.sdp)
        finally:
            await peer.__aexit__(None, None, None)


def relays(sdp: str) -> list[str]:
    return [line for line in sdp.splitlines() if line.startswith("a=candidate:") and " typ relay " in line]


async def test_the_turn_credentials_get_the_call_a_relay(redis_url: str, turn_port: int) -> None:
    server = {"urls": f"turn:127.0.0.1:{turn_port}?transport=udp", "username": USER, "credential": PASSWORD}
    relayed = relays(await answer_sdp(redis_url, server))
    assert relayed and all(" 127.0.0.1 " in line for line in relayed), relayed  # coturn's --relay-ip
    refused = await answer_sdp(redis_url, {**server, "credential": "wrong"})
    assert "typ host" in refused and relays(refused) == []
