"""Settings defaults that read right."""

from __future__ import annotations

from gateway.settings import Settings


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
