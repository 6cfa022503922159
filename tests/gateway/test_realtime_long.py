"""A long Realtime conversation on the real engines: truncation keeps every turn inside its budget.

15 text turns over the official ``openai`` SDK, answers of a few tokens. The
history's budget is small here (``token_limits.post_instructions``, 200 tokens) so
that truncation happens twice within 15 turns; with the default budget
(the model's context less room for the input and the answer) the same code
runs, later. On the ``vllm serve`` sidecar the history is counted by the sidecar
(its ``/tokenize``), from an API worker, which has no engine of its own.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from asgi_lifespan import LifespanManager

from gateway.runtime.app import create_app
from gateway.runtime.processes import uvicorn_config
from gateway.settings import Settings
from omni_adapter.factory import EngineChoice, open_prompt_counter
from omni_adapter.http_engine import HttpEngine
from omni_adapter.port import Engine
from tests.frameworks.conftest import RecordingEngine
from tests.gateway.client import live_app, make_settings, served
from tests.gateway.test_realtime import sdk, text_turn
from tests.redis_server import free_port
from tests.vllm_sidecar import VllmSidecar

pytestmark = pytest.mark.engine
BUDGET = 200
TURNS = 15


def short_answers_within(budget: int) -> dict[str, Any]:
    """Text turns answered in a few tokens, the history (instructions too) kept within ``budget``
    tokens, dropped down to half of it when it outgrows it."""
    return {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 6, "temperature": 0,
            "instructions": "You are a helpful assistant. Answer in a few words.",
            "audio": {"input": {"turn_detection": None}},
            "truncation": {"type": "retention_ratio", "retention_ratio": 0.5,
                           "token_limits": {"post_instructions": budget}}}


async def test_a_long_conversation_never_errors_and_the_history_stays_in_its_budget(redis_url: str, vllm_engine: Any) -> None:
    engine = RecordingEngine(vllm_engine)
    async with live_app(make_settings(redis_url=redis_url), engine) as url, \
            sdk(url).realtime.connect(model=engine.capabilities.model_names[0]) as conn:
        await conn.session.update(session=short_answers_within(BUDGET))
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


@asynccontextmanager
async def api_worker_beside(settings: Settings, engine: Engine) -> AsyncIterator[str]:
    """A replica's two halves in this loop: the engine process's app (``engine``: its runners and
    tender) and an API worker's, served; the worker's URL. The worker has no engine, only the
    card the engine process publishes, as under ``omni-gateway serve`` with API workers."""
    async with LifespanManager(create_app(settings, engine=engine, role="engine"), startup_timeout=60):
        worker = create_app(settings, role="api", preload=False)
        port = free_port()
        async with served(uvicorn_config(worker, settings, host="127.0.0.1", port=port, log_level="warning")):
            yield f"http://127.0.0.1:{port}"


SIDECAR_BUDGET = 120
SIDECAR_TURNS = 8


async def test_on_the_sidecar_an_api_worker_trims_the_history_the_sidecar_counts(
        redis_url: str, http_engine: HttpEngine, vllm_sidecar: VllmSidecar) -> None:
    """The sidecar engine counts a history for ``truncation`` (it had nothing to count with, and
    a conversation past its context failed every answer from then on): a conversation that
    outgrows its budget drops its oldest items, and its answers go on."""
    engine = RecordingEngine(http_engine)
    settings = make_settings(redis_url=redis_url, engine="openai-http", engine_url=vllm_sidecar.url,
                             replica_id=f"sidecar-count-{uuid.uuid4().hex[:8]}")
    async with api_worker_beside(settings, engine) as url, \
            sdk(url).realtime.connect(model=engine.capabilities.model_names[0]) as conn:
        # The models' context is the sidecar's, as vLLM's own /v1/models tells it.
        cards = await sdk(url).models.list()
        assert [card.model_extra["max_model_len"] for card in cards.data] == [vllm_sidecar.max_model_len]
        await conn.session.update(session=short_answers_within(SIDECAR_BUDGET))
        for turn in range(SIDECAR_TURNS):
            events = await text_turn(conn, f"Turn {turn}: name a fruit.")
            assert [e for e in events if e["type"] == "error"] == [], turn
            done = events[-1]["response"]
            assert done["status"] in ("completed", "incomplete"), (turn, done)
            assert done["output"] and done["output"][0]["content"][0]["text"], (turn, done)
    turns = [r for r in engine.requests if r.messages and r.messages[0]["content"].startswith("You are")]
    assert len(turns) == SIDECAR_TURNS
    counter = await open_prompt_counter(EngineChoice(kind="openai-http", engine_url=vllm_sidecar.url), None)
    assert counter is not None
    try:
        history_tokens = [await counter.prompt_tokens(dataclasses.replace(r, request_id="count")) for r in turns]
    finally:
        await counter.aclose()
    assert max(history_tokens) <= SIDECAR_BUDGET, history_tokens
    assert any(b < a for a, b in zip(history_tokens, history_tokens[1:], strict=False)), \
        ("the oldest items were dropped", history_tokens)
    assert turns[-1].messages[1]["content"] != "Turn 0: name a fruit.", "the oldest turn went first"
