"""Many sessions, one engine: the admission cap, parking idle sessions, update mode.

Fast tests: real Redis, the scripted engine (it records what each engine
request was fed and whether it was aborted). The same behaviour against the
real vLLM engine, with answers compared token for token, is in
test_scheduling_real.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.domain.scheduling import Room, SchedulePolicy, WaitingWork, ranked
from gateway.domain.states import SessionState
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse


async def wait_for(client: httpx.AsyncClient, sid: str, check: str, timeout_sec: float = 10.0) -> dict:
    """Poll the session view until ``check`` (a key that must be truthy) holds."""
    deadline = asyncio.get_running_loop().time() + timeout_sec
    while True:
        view = (await client.get(f"{BASE}/{sid}")).json()
        if view.get(check):
            return view
        assert asyncio.get_running_loop().time() < deadline, f"{check} never became true: {view}"
        await asyncio.sleep(0.05)


async def answer(client: httpx.AsyncClient, sid: str) -> str:
    return content_of(parse_sse((await client.get(f"{BASE}/{sid}/events")).text))


async def open_streaming(client: httpx.AsyncClient, text: str) -> str:
    response = await client.post(BASE, json={"start_policy": "on_first_chunk",
                                             "first_chunk": {"sequence_id": 0, "text": text}})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


# --- the ranking itself -------------------------------------------------------

def work(sid: str, state: SessionState, arrived: int, last: int, computed: int) -> WaitingWork:
    return WaitingWork(sid, state, arrived_ms=arrived, last_input_ms=last, computed_tokens=computed)


WAITING = [
    work("old-listening", SessionState.STREAMING, arrived=1, last=50, computed=10),
    work("fresh-listening", SessionState.STREAMING, arrived=3, last=90, computed=0),
    work("deep-listening", SessionState.STREAMING, arrived=2, last=10, computed=500),
    work("answer", SessionState.GENERATING, arrived=4, last=95, computed=0),
    # A later session whose input completed earlier: its answer is due first.
    work("earlier-answer", SessionState.GENERATING, arrived=5, last=60, computed=0),
]


@pytest.mark.parametrize(("policy", "order"), [
    (SchedulePolicy.FCFS, ["earlier-answer", "answer", "old-listening", "deep-listening", "fresh-listening"]),
    (SchedulePolicy.LCAS, ["earlier-answer", "answer", "fresh-listening", "old-listening", "deep-listening"]),
    (SchedulePolicy.MCPS, ["earlier-answer", "answer", "deep-listening", "old-listening", "fresh-listening"]),
])
def test_answers_go_first_in_completion_order_then_listeners_by_the_policy(policy: SchedulePolicy, order: list[str]) -> None:
    assert [w.session_id for w in ranked(WAITING, policy)] == order


def test_room_keeps_slots_for_answers() -> None:
    room = Room(total=2, listening=1)
    listening, answering = WAITING[0], WAITING[3]
    assert room.fits(listening)
    after = room.taken(listening)
    assert not after.fits(listening), "the listening cap is reached"
    assert after.fits(answering), "an answer still fits in the room kept for it"
    assert not after.taken(answering).fits(answering)


# --- through the gateway --------------------------------------------------------

@pytest.fixture
async def capped(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    """Two engine sessions, at most one of them listening; idle parking off."""
    engine = ScriptedEngine()
    settings = make_settings(redis_url=redis_url, max_engine_sessions=2, max_listening_sessions=1,
                             idle_park_sec=0, tend_interval_sec=0.05)
    async with app_client(settings, engine) as client:
        yield client, engine


async def test_started_sessions_beyond_the_cap_wait_and_all_complete(
        capped: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = capped
    sids = [await open_streaming(client, f"first {i} ") for i in range(6)]
    views = [(await client.get(f"{BASE}/{sid}")).json() for sid in sids]
    assert all(v["state"] == "streaming" for v in views)
    assert sum(v["owner"] is not None for v in views) == 1, "only one session may listen on the engine"
    assert len(engine.sessions) == 1

    for i, sid in enumerate(sids):
        chunk = {"sequence_id": 1, "text": f"second {i}", "end_of_input": True}
        assert (await client.post(f"{BASE}/{sid}/chunks", json=chunk)).status_code == 202
    answers = await asyncio.gather(*(answer(client, sid) for sid in sids))
    assert answers == [f"echo: first {i} second {i}" for i in range(6)]


async def test_an_answer_waiting_for_room_parks_a_listening_session(
        capped: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    client, engine = capped
    listening = await open_streaming(client, "still talking ")
    assert (await client.get(f"{BASE}/{listening}")).json()["owner"] is not None
    # Fill the answer slot with a slow answer, then ask for one more.
    engine.script = Script(word_delay_sec=0.2)
    busy = (await client.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "a b c d e f",
                                                          "end_of_input": True}})).json()["session_id"]
    waiting = (await client.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "quick",
                                                             "end_of_input": True}})).json()["session_id"]
    parked = await wait_for(client, listening, "parked")
    assert parked["state"] == "streaming" and parked["owner"] is None and parked["parks"] == 1
    assert engine.sessions[0].aborted, "parking aborts the engine request"
    assert await answer(client, waiting) == "echo: quick"
    assert await answer(client, busy) == "echo: a b c d e f"

    # Its next input resumes it: the new engine request is fed everything again.
    engine.script = Script()
    done = {"sequence_id": 1, "text": "and done", "end_of_input": True}
    assert (await client.post(f"{BASE}/{listening}/chunks", json=done)).status_code == 202
    assert await answer(client, listening) == "echo: still talking and done"
    view = (await client.get(f"{BASE}/{listening}")).json()
    assert (view["parked"], view["resumes"]) == (False, 1)


async def test_an_idle_session_is_parked_and_its_next_chunk_resumes_it(redis_url: str) -> None:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url, idle_park_sec=0.3), engine) as client:
        sid = await open_streaming(client, "one ")
        view = await wait_for(client, sid, "parked")
        assert view["owner"] is None and engine.sessions[0].aborted
        # A duplicate is not new input: it does not wake the session.
        again = await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "one "})
        assert again.status_code == 200 and (await client.get(f"{BASE}/{sid}")).json()["parked"]

        assert (await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 1, "text": "two"})).status_code == 202
        assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202
        assert await answer(client, sid) == "echo: one two"
        resumed = engine.sessions[-1]
        assert b"".join(c.data for c in resumed.fed) == b"one two", "the resumed request was fed all input"
        view = (await client.get(f"{BASE}/{sid}")).json()
        assert view["state"] == "completed" and view["parks"] >= 1 and view["resumes"] >= 1


async def test_finish_alone_resumes_a_parked_session(redis_url: str) -> None:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url, idle_park_sec=0.2), engine) as client:
        sid = await open_streaming(client, "all of it")
        await wait_for(client, sid, "parked")
        assert (await client.post(f"{BASE}/{sid}/finish")).status_code == 202
        assert await answer(client, sid) == "echo: all of it"


# --- update mode --------------------------------------------------------------------

@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with app_client(make_settings(redis_url=redis_url, idle_park_sec=0), engine) as c:
        yield c, engine


async def test_a_replaced_chunk_restarts_the_engine_request_with_the_new_input(
        client: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    http, engine = client
    sid = await open_streaming(http, "context A. ")
    assert (await http.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 1, "text": "context B. "})).status_code == 202
    async with asyncio.timeout(10):  # the engine took chunk 1 in (on a busy machine its runner may start late)
        while not engine.sessions or len(engine.sessions[0].fed) < 2:  # noqa: ASYNC110 - no event to wait on
            await asyncio.sleep(0.01)
    replaced = await http.put(f"{BASE}/{sid}/chunks/1", json={"sequence_id": 1, "text": "context C. "})
    assert replaced.status_code == 200, replaced.text
    body = replaced.json()
    assert body["replaced"] is True and body["state"] == "streaming"
    assert body["kept_tokens"] is None, "the scripted engine cannot count tokens"
    same = await http.put(f"{BASE}/{sid}/chunks/1", json={"sequence_id": 1, "text": "context C. "})
    assert same.status_code == 200 and same.json()["replaced"] is False

    await http.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 2, "text": "Question?", "end_of_input": True})
    assert await answer(http, sid) == "echo: context A. context C. Question?"
    assert engine.sessions[0].aborted, "the old engine request was given up"
    assert (await http.get(f"{BASE}/{sid}")).json()["replaced_chunks"] == 1


async def test_replacing_before_the_engine_starts_just_swaps_the_chunk(
        client: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    http, engine = client
    sid = (await http.post(BASE, json={"start_policy": "on_end_only",
                                       "first_chunk": {"sequence_id": 0, "text": "old"}})).json()["session_id"]
    assert (await http.put(f"{BASE}/{sid}/chunks/0", json={"sequence_id": 0, "text": "new"})).status_code == 200
    await http.post(f"{BASE}/{sid}/finish")
    assert await answer(http, sid) == "echo: new"
    assert len(engine.sessions) == 1


async def test_replacements_that_cannot_be_taken_say_why_and_change_nothing(
        client: tuple[httpx.AsyncClient, ScriptedEngine]) -> None:
    http, _ = client
    sid = await open_streaming(http, "kept")

    async def put(seq: int, body: dict, **kwargs: object) -> httpx.Response:
        return await http.put(f"{BASE}/{sid}/chunks/{seq}", json=body, **kwargs)  # type: ignore[arg-type]

    never_sent = await put(5, {"sequence_id": 5, "text": "x"})
    assert never_sent.status_code == 409 and never_sent.json()["error"]["code"] == "sequence_conflict"
    mismatch = await put(0, {"sequence_id": 1, "text": "x"})
    assert mismatch.status_code == 422 and mismatch.json()["error"]["param"] == "sequence_id"
    ending = await put(0, {"sequence_id": 0, "text": "x", "end_of_input": True})
    assert ending.status_code == 422
    wrong_type = await http.put(f"{BASE}/{sid}/chunks/0", content=b"x", headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 400
    missing = await http.put(f"{BASE}/sis-nope/chunks/0", json={"sequence_id": 0, "text": "x"})
    assert missing.status_code == 404

    await http.post(f"{BASE}/{sid}/finish")
    assert await answer(http, sid) == "echo: kept", "nothing refused reached the session"
    closed = await put(0, {"sequence_id": 0, "text": "too late"})
    assert closed.status_code == 409 and closed.json()["error"]["code"] == "input_closed"
