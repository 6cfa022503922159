"""Settings defaults that read right, and the ones with a shape (WebRTC's ICE servers)."""

from __future__ import annotations

import json

import pytest
from aiortc.rtcicetransport import connection_kwargs
from pydantic import ValidationError

from gateway.api.realtime.webrtc import peer_configuration
from gateway.settings import IceServer, Settings


def test_burst_follows_a_lowered_rate() -> None:
    # RATE_LIMIT_RPS=20 used to keep the default burst of 200: ten seconds of traffic at once.
    assert Settings(rate_limit_rps=20).token_burst == 40
    assert Settings(rate_limit_rps=0.5).token_burst == 1
    assert Settings().token_burst == 200


def test_an_explicit_burst_is_kept() -> None:
    assert Settings(rate_limit_rps=20, rate_limit_burst=5).token_burst == 5


def test_burst_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_GATEWAY_RATE_LIMIT_RPS", "20")
    assert Settings().token_burst == 40


TURN = {"urls": ["turn:turn.example.com:3478?transport=udp"], "username": "omni", "credential": "s3cret"}


def test_ice_servers_as_plain_urls_still_read(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_GATEWAY_WEBRTC_ICE_SERVERS", "stun:a.example:3478, stun:b.example:19302,")
    assert Settings().webrtc_ice_servers == [IceServer(urls=["stun:a.example:3478"]),
                                             IceServer(urls=["stun:b.example:19302"])]
    monkeypatch.setenv("OMNI_GATEWAY_WEBRTC_ICE_SERVERS", "")
    assert Settings().webrtc_ice_servers == []


def test_ice_servers_as_json_carry_turn_credentials(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_GATEWAY_WEBRTC_ICE_SERVERS", json.dumps(
        [TURN, {"urls": "stun:stun.example.com:3478"}]))
    turn, stun = Settings().webrtc_ice_servers
    assert (turn.urls, turn.username, turn.credential) == (TURN["urls"], "omni", "s3cret")
    assert stun.urls == ["stun:stun.example.com:3478"] and stun.username is None


@pytest.mark.parametrize(("value", "message"), [
    ("turn:turn.example.com:3478", "needs a username and a credential"),
    (json.dumps([{"urls": "turns:turn.example.com", "username": "omni"}]), "needs a username and a credential"),
    ("https://turn.example.com", "starts with stun:, turn: or turns:"),
    ('[{"urls": "stun:a", ', "not a JSON list of RTCIceServer objects"),
    (json.dumps([{"urls": []}]), "at least 1 item"),
    (json.dumps([{**TURN, "credentialType": "oauth"}]), "Extra inputs are not permitted"),
])
def test_unusable_ice_servers_are_refused_at_start(monkeypatch, value: str, message: str) -> None:
    monkeypatch.setenv("OMNI_GATEWAY_WEBRTC_ICE_SERVERS", value)
    with pytest.raises(ValidationError, match=message):
        Settings()


def test_a_calls_peer_connection_gets_the_turn_credentials() -> None:
    configuration = peer_configuration(Settings(webrtc_ice_servers=[TURN]).webrtc_ice_servers)
    (server,) = configuration.iceServers
    assert (server.urls, server.username, server.credential) == (TURN["urls"], "omni", "s3cret")
    # What aiortc hands its ICE agent (aioice) for the allocation.
    assert connection_kwargs(configuration.iceServers) == {
        "turn_server": ("turn.example.com", 3478), "turn_ssl": False, "turn_transport": "udp",
        "turn_username": "omni", "turn_password": "s3cret"}


def test_served_model_names_read_as_vllm_takes_several(monkeypatch) -> None:
    assert Settings().served_model_name == ()
    monkeypatch.setenv("OMNI_GATEWAY_SERVED_MODEL_NAME", "my-model, gpt-realtime,,my-model")
    assert Settings().served_model_name == ("my-model", "gpt-realtime")
