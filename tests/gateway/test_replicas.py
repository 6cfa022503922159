"""Several replicas on one real Redis, in one process (scripted engine).

Ownership through leases: any replica serves any call, work beyond a
replica's capacity waits in Redis, a replica that shuts down or dies hands
its sessions over, and the stream its clients read stays one stream. The
same protocol with real processes, kill -9 and the real engine is in
tests/replicas/.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gateway.store.redis_store import SessionStore
from gateway.work.draining import Draining
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, content_of, make_settings, parse_sse
from tests.gateway.test_api import append, assert_error, create, view

TEXT = "one two three four five six seven eight"
ANSWER = f"echo: {TEXT}"


def stream_roles(body: str) -> int:
    return sum(1 for e in parse_sse(body) if e.event is None and e.data != "[DONE]"
               and e.json()["choices"] and e.json()["choices"][0]["delta"].get("role"))


async def test_any_replica_serves_any_call(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url)
    async with app_client(settings, ScriptedEngine()) as a, app_client(settings, ScriptedEngine()) as b:
        sid = await create(a)
        assert (await append(b, sid, 0, "from b ")).status_code == 202
        events = asyncio.create_task(b.get(f"{BASE}/{sid}/events"))
        assert (await append(a, sid, 1, "and a", end_of_input=True)).status_code == 202
        body = (await events).text
        assert content_of(parse_sse(body)) == "echo: from b and a"
        result = (await a.get(f"{BASE}/{sid}/result", params={"wait": 5})).json()
        assert result["completion"]["choices"][0]["message"]["content"] == "echo: from b and a"


async def test_work_beyond_capacity_waits_in_redis_for_room(redis_url: str) -> None:
    engine = ScriptedEngine(Script(word_delay_sec=0.05))
    settings = make_settings(redis_url=redis_url, max_engine_sessions=1, tend_interval_sec=0.05)
    async with app_client(settings, engine) as client:
        first = await create(client, first_chunk={"sequence_id": 0, "text": TEXT, "end_of_input": True})
        second = await create(client, first_chunk={"sequence_id": 0, "text": "next", "end_of_input": True})
        waiting = await view(client, second)
        assert waiting["state"] == "generating" and not waiting["owner"], waiting
        assert len(engine.sessions) == 1
        # The moment the first ends, the replica takes the waiting one.
        for sid, answer in ((first, ANSWER), (second, "echo: next")):
            result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 10})).json()
            assert result["completion"]["choices"][0]["message"]["content"] == answer


async def test_shutdown_hands_running_sessions_to_another_replica(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    leaving, staying = ScriptedEngine(Script(word_delay_sec=0.1)), ScriptedEngine()
    async with app_client(settings, leaving) as a:
        sid = await create(a, first_chunk={"sequence_id": 0, "text": TEXT, "end_of_input": True})
        await asyncio.sleep(0.35)  # a few words out, then the replica stops
    assert not leaving.sessions[0].ended or leaving.sessions[0].aborted
    async with app_client(settings, staying) as b:
        body = (await b.get(f"{BASE}/{sid}/events")).text
    # One stream: every word once, one role frame, though two replicas wrote it.
    assert content_of(parse_sse(body)) == ANSWER
    assert stream_roles(body) == 1
    (taken,) = staying.sessions
    assert taken.request.assistant_prefix and ANSWER.startswith(taken.request.assistant_prefix)


async def test_shutdown_grace_lets_running_sessions_finish(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, shutdown_grace_sec=5)
    async with app_client(settings, ScriptedEngine(Script(word_delay_sec=0.02))) as a:
        sid = await create(a, first_chunk={"sequence_id": 0, "text": TEXT, "end_of_input": True})
    async with app_client(settings, ScriptedEngine()) as b:
        result = (await b.get(f"{BASE}/{sid}/result")).json()
    assert result["state"] == "completed"
    assert result["completion"]["choices"][0]["message"]["content"] == ANSWER


async def test_a_dead_owner_loses_its_sessions_when_the_lease_lapses(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(redis_url=redis_url, lease_ttl_sec=0.5, tend_interval_sec=0.05)
    async with app_client(settings, ScriptedEngine()) as b:
        async with app_client(settings, ScriptedEngine(Script(word_delay_sec=0.1)), Draining()) as a:
            sid = await create(a, first_chunk={"sequence_id": 0, "text": TEXT, "end_of_input": True})
            await asyncio.sleep(0.35)
            # Die: stop without handing anything over (no release, no more heartbeats).
            monkeypatch.setattr(SessionStore, "release", lambda *_: asyncio.sleep(0))
        monkeypatch.undo()
        stopped = asyncio.get_running_loop().time()
        assert (await view(b, sid))["state"] == "generating"
        body = (await b.get(f"{BASE}/{sid}/events")).text
        assert asyncio.get_running_loop().time() - stopped >= 0.1  # waited for the lease to lapse
    assert content_of(parse_sse(body)) == ANSWER and stream_roles(body) == 1


async def test_a_draining_replica_is_not_ready_and_takes_no_new_work(redis_url: str) -> None:
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    draining = Draining()
    async with app_client(settings, ScriptedEngine(), draining) as a:
        assert (await a.get("/readyz")).status_code == 200
        draining.begin()
        assert_error(await a.get("/readyz"), 503, "engine_unavailable")
        # Sessions still start here (input is only Redis), but their engine
        # work waits for a replica that is not leaving.
        sid = await create(a, first_chunk={"sequence_id": 0, "text": "hi", "end_of_input": True})
        await asyncio.sleep(0.2)
        assert not (await view(a, sid))["owner"]
        async with app_client(settings, ScriptedEngine()) as b:
            result = (await b.get(f"{BASE}/{sid}/result", params={"wait": 5})).json()
    assert result["completion"]["choices"][0]["message"]["content"] == "echo: hi"


async def test_a_spoken_session_handed_over_mid_input_tells_its_transcript_once(redis_url: str) -> None:
    from omni_adapter.listener import with_listener
    from tests.gateway.test_voice import raw_audio
    from tests.voice import SPEECH_RATE, pieces, speech, word_error_rate

    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    said = "Please tell me a short story about a dog. Then explain why the sky is blue."
    audio = pieces(speech(said), SPEECH_RATE, 200)
    half = len(audio) * 2 // 3
    async with app_client(settings, with_listener(ScriptedEngine())) as a:
        sid = await create(a)
        for seq in range(half):
            assert (await a.post(f"{BASE}/{sid}/chunks", **raw_audio(seq, audio[seq]))).status_code == 202
        await asyncio.sleep(0.5)  # the words heard so far are told before the replica leaves
    async with app_client(settings, with_listener(ScriptedEngine())) as b:
        for seq in range(half, len(audio)):
            response = await b.post(f"{BASE}/{sid}/chunks", **raw_audio(seq, audio[seq], end=seq == len(audio) - 1))
            assert response.status_code == 202
        body = (await b.get(f"{BASE}/{sid}/events")).text
    heard = [e.json()["input_transcript"] for e in parse_sse(body) if e.event == "transcript"]
    assert len(heard) >= 2 and word_error_rate(said, heard[-1]) == 0, heard
    # The new owner went on from what the first one heard: nothing is told twice.
    assert all(later.startswith(earlier) and later != earlier for earlier, later in itertools.pairwise(heard))
    assert content_of(parse_sse(body)) == "echo: " + heard[-1]
    assert stream_roles(body) == 1


async def test_after_a_hand_off_mid_answer_the_audio_says_the_whole_answer(redis_url: str) -> None:
    """The new owner speaks what the old one wrote but had not spoken yet (issue 28):
    the audio frames of both owners, stitched, say the whole text (the real Talker,
    heard back by the real recognizer)."""
    import base64
    import json

    from omni_adapter.talker import with_talker
    from tests.voice import SPEECH_RATE, recognize, word_error_rate

    said = "The capital of France is Paris. It is a large city on the river Seine, visited by many people."
    deltas = [word if i == 0 else " " + word for i, word in enumerate(said.split())]
    settings = make_settings(redis_url=redis_url, tend_interval_sec=0.05)
    leaving = ScriptedEngine(Script(answer=lambda *_: deltas, word_delay_sec=0.12))
    async with app_client(settings, with_talker(leaving)) as a:
        sid = await create(a, modalities=["text", "audio"],
                           first_chunk={"sequence_id": 0, "text": "hi", "end_of_input": True})
        await asyncio.sleep(1.0)  # some phrases written, not all of them spoken: then the replica stops
    staying = ScriptedEngine(Script(answer=lambda *_: deltas))
    async with app_client(settings, with_talker(staying)) as b:
        body = (await b.get(f"{BASE}/{sid}/events")).text
    events = parse_sse(body)
    assert content_of(events) == said
    (taken,) = staying.sessions
    assert taken.request.assistant_prefix and taken.request.unspoken_prefix, taken.request
    audio = [choice["delta"]["audio"] for e in events if e.event is None and e.data != "[DONE]"
             for choice in json.loads(e.data)["choices"] if "audio" in choice["delta"]]
    assert word_error_rate(said, " ".join(a["transcript"] for a in audio)) == 0.0, [a["transcript"] for a in audio]
    stitched = b"".join(base64.b64decode(a["data"]) for a in audio)
    assert word_error_rate(said, recognize(stitched, SPEECH_RATE)) <= 0.1
