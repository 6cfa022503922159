"""A long Realtime conversation on the real engine: truncation keeps every turn inside its budget.

15 text turns over the official ``openai`` SDK, answers of a few tokens. The
history's budget is small here (``token_limits.post_instructions``, 200 tokens) so
that truncation happens twice within 15 turns; with the default budget
(the model's context less room for the input and the answer) the same code
runs, later.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.frameworks.conftest import RecordingEngine
from tests.gateway.client import live_app, make_settings
from tests.gateway.test_realtime import sdk, text_turn

pytestmark = pytest.mark.engine
BUDGET = 200
TURNS = 15


async def test_a_long_conversation_never_errors_and_the_history_stays_in_its_budget(redis_url: str, vllm_engine: Any) -> None:
    engine = RecordingEngine(vllm_engine)
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model=engine.capabilities.model_names[0]) as conn:
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"], "max_output_tokens": 6, "temperature": 0,
            "instructions": "You are a helpful assistant. Answer in a few words.",
            "audio": {"input": {"turn_detection": None}},
            "truncation": {"type": "retention_ratio", "retention_ratio": 0.5,
                           "token_limits": {"post_instructions": BUDGET}}})
        cut_offs = 0
        for turn in range(TURNS):
            events = await text_turn(conn, f"Turn {turn}: name a fruit.")
            assert [e for e in events if e["type"] == "error"] == [], turn
            done = events[-1]["response"]
            # An answer cut off at max_output_tokens is incomplete, as at OpenAI (one that ends
            # with its 6th token is complete).
            cut_off = done["status"] == "incomplete"
            assert done["status"] == "completed" or done["usage"]["output_tokens"] == 6, (turn, done)
            if cut_off:
                assert done["status_details"]["reason"] == "max_output_tokens", done
                assert {item["status"] for item in done["output"]} == {"incomplete"}, done
            cut_offs += cut_off
    assert cut_offs, "no answer ran to max_output_tokens: make them longer"
    turns = [r for r in engine.requests if r.messages and r.messages[0]["content"].startswith("You are")]
    assert len(turns) == TURNS
    history_tokens = [vllm_engine.check_request(dataclasses.replace(r, request_id="count")) for r in turns]
    assert max(history_tokens) <= BUDGET, history_tokens
    assert len(turns[-1].messages) < 2 * TURNS, "the oldest turns were dropped"
    # Dropped in batches (down to half the budget), not one item a turn: the history's
    # start stays put for many turns, where the engine's prefix cache serves it.
    starts = [r.messages[1]["content"] if len(r.messages) > 1 else "" for r in turns]
    changes = sum(a != b for a, b in zip(starts, starts[1:], strict=False))
    assert 1 <= changes <= TURNS // 5, starts
