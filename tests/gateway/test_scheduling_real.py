"""Scheduling with the real engine (SmolLM2 on vLLM, CPU): the answers do not change.

Temperature 0: a session that waited for room, was parked and resumed, or
had a chunk replaced answers exactly like the same input sent in one piece
to an unscheduled gateway.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from omni_adapter.port import Engine
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse
from tests.gateway.test_scheduling import wait_for

pytestmark = pytest.mark.engine

SAMPLING = {"temperature": 0, "max_tokens": 8, "messages": [{"role": "system", "content": "Answer briefly."}]}
PARTS = [("Name a fruit that is ", "red.", " One word."), ("Name an animal that ", "barks.", " One word."),
         ("Name a colour of the ", "sky.", " One word.")]


async def one_shot(client: httpx.AsyncClient, text: str) -> str:
    response = await client.post(BASE, json={**SAMPLING, "start_policy": "on_end_only",
                                             "first_chunk": {"sequence_id": 0, "text": text, "end_of_input": True}})
    return await answer(client, response.json()["session_id"])


async def answer(client: httpx.AsyncClient, sid: str) -> str:
    return content_of(parse_sse((await client.get(f"{BASE}/{sid}/events", timeout=120)).text))


async def streamed(client: httpx.AsyncClient, pieces: tuple[str, ...]) -> str:
    response = await client.post(BASE, json={**SAMPLING, "start_policy": "on_first_chunk",
                                             "first_chunk": {"sequence_id": 0, "text": pieces[0]}})
    sid = response.json()["session_id"]
    for seq, piece in enumerate(pieces[1:], start=1):
        await asyncio.sleep(0.1)
        chunk = {"sequence_id": seq, "text": piece, "end_of_input": seq == len(pieces) - 1}
        assert (await client.post(f"{BASE}/{sid}/chunks", json=chunk)).status_code == 202
    return await answer(client, sid)


async def test_three_times_the_cap_all_answer_as_unscheduled(redis_url: str, vllm_engine: Engine) -> None:
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as free:
        expected = [await one_shot(free, "".join(p)) for p in PARTS]
    assert all(expected)
    sessions = [*PARTS, *PARTS]  # six sessions; the cap is two, one of them listening
    settings = make_settings(redis_url=redis_url, max_engine_sessions=2, max_listening_sessions=1,
                             idle_park_sec=0, tend_interval_sec=0.05)
    async with app_client(settings, vllm_engine) as capped:
        answers = await asyncio.gather(*(streamed(capped, p) for p in sessions))
    assert answers == [*expected, *expected]


async def test_a_parked_session_resumes_with_the_same_answer(redis_url: str, vllm_engine: Engine) -> None:
    text = "".join(PARTS[0])
    async with app_client(make_settings(redis_url=redis_url, idle_park_sec=0.5), vllm_engine) as client:
        expected = await one_shot(client, text)
        first, rest = text[:12], text[12:]
        response = await client.post(BASE, json={**SAMPLING, "start_policy": "on_first_chunk",
                                                 "first_chunk": {"sequence_id": 0, "text": first}})
        sid = response.json()["session_id"]
        view = await wait_for(client, sid, "parked")
        assert view["owner"] is None and view["state"] == "streaming"
        chunk = {"sequence_id": 1, "text": rest, "end_of_input": True}
        assert (await client.post(f"{BASE}/{sid}/chunks", json=chunk)).status_code == 202
        assert await answer(client, sid) == expected
        view = (await client.get(f"{BASE}/{sid}")).json()
        assert view["parks"] >= 1 and view["resumes"] >= 1 and not view["parked"]


async def test_an_update_answers_the_new_input_and_reports_the_kept_prefix(
        redis_url: str, vllm_engine: Engine) -> None:
    old = ("Context: the sky is blue. ", "Context: grass is green. ", "Question: what colour is the sky?")
    new = (*old[:2], "Question: what colour is grass?")
    async with app_client(make_settings(redis_url=redis_url, idle_park_sec=0), vllm_engine) as client:
        expected = await one_shot(client, "".join(new))
        response = await client.post(BASE, json={**SAMPLING, "start_policy": "on_first_chunk",
                                                 "first_chunk": {"sequence_id": 0, "text": old[0]}})
        sid = response.json()["session_id"]
        for seq in (1, 2):
            await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": old[seq]})
        # The first PUT counts the whole input and marks it; the second counts from chunk 2's mark.
        first = await client.put(f"{BASE}/{sid}/chunks/2", json={"sequence_id": 2, "text": "Question: why?"})
        assert first.status_code == 200, first.text
        replaced = await client.put(f"{BASE}/{sid}/chunks/2", json={"sequence_id": 2, "text": new[2]})
        assert replaced.status_code == 200, replaced.text
        assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202
        assert await answer(client, sid) == expected

    from transformers import AutoTokenizer

    from omni_adapter.model_bootstrap import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    before = tokenizer("".join((*old[:2], "Question: why?")), add_special_tokens=False)["input_ids"]
    after = tokenizer("".join(new), add_special_tokens=False)["input_ids"]
    common = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert replaced.json()["kept_tokens"] == common
    assert replaced.json()["input_tokens"] == len(after)
    assert 0 < common < len(after)
