"""Cap slots are freed however a session ends, even when the release fails once (issue 29, item 4).

Freeing a session's slots is a second call after the script that ended it.
Here every session's first release meets Redis paused for writes (``CLIENT
PAUSE``) past the call's time bound, so it fails; what comes next (the
runner's retry, the client's retry, the tender's look at the session) must
free them, or the identity stays locked out for an hour.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack

import httpx
import pytest
import redis

from gateway.store.redis_store import SessionStore
from omni_adapter.scripted import Script, ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings

PER_WAY = 5


def open_slots(admin: redis.Redis) -> int:
    return sum(int(admin.zcard(key)) for key in admin.scan_iter("sis:identity:*:sessions"))


async def retried(call: object) -> httpx.Response:
    """What a client does with a 503: ask again."""
    deadline = time.monotonic() + 15
    while (response := await call()).status_code == 503:  # type: ignore[operator]
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.1)
    return response


async def test_twenty_sessions_end_while_writes_pause_and_every_slot_comes_back(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    admin = redis.Redis.from_url(redis_url)
    released: set[str] = set()
    real_free = SessionStore._free_slots

    async def first_release_meets_a_pause(self: SessionStore, session_id: str, identity: str | None) -> None:
        if session_id not in released:
            released.add(session_id)
            admin.execute_command("CLIENT", "PAUSE", 250, "WRITE")
        await real_free(self, session_id, identity)

    monkeypatch.setattr(SessionStore, "_free_slots", first_release_meets_a_pause)
    monkeypatch.setattr("gateway.work.tender.TENDER_BACKOFF_SEC", (0.1,))
    monkeypatch.setattr("gateway.work.tender.SWEEP_EVERY_SEC", 0.2)
    monkeypatch.setattr("gateway.work.tender.GONE_GRACE_SEC", 1.0)
    common = {"redis_url": redis_url, "redis_timeout_sec": 0.1, "tend_interval_sec": 0.05,
              "max_sessions_per_identity": 4 * PER_WAY, "lease_ttl_sec": 1.0}
    async with AsyncExitStack() as stack:
        # Replica a answers; replica b's engine fails every answer and its sessions idle out fast.
        a = await stack.enter_async_context(app_client(make_settings(**common, replica_id="a"), ScriptedEngine()))
        b = await stack.enter_async_context(app_client(
            make_settings(**common, replica_id="b", session_timeout_sec=1.0),
            ScriptedEngine(Script(error_after_words=1))))

        async def create(client: httpx.AsyncClient, body: dict[str, object]) -> str:
            # Retried under one key: a create whose answer the pause lost must not leave a second session.
            key = {"Idempotency-Key": uuid.uuid4().hex}
            response = await retried(lambda: client.post(BASE, json=body, headers=key))
            assert response.status_code == 201, response.text
            return str(response.json()["session_id"])

        complete = {"first_chunk": {"sequence_id": 0, "text": "done now", "end_of_input": True}}
        completing = [await create(a, complete) for _ in range(PER_WAY)]
        failing = [await create(b, complete) for _ in range(PER_WAY)]
        idling = [await create(b, {"start_policy": "on_end_only"}) for _ in range(PER_WAY)]
        cancelled = [await create(a, {"start_policy": "on_end_only"}) for _ in range(PER_WAY)]
        for sid in cancelled:
            assert (await retried(lambda sid=sid: a.delete(f"{BASE}/{sid}"))).status_code == 204

        # (A failure the pause kept from being recorded is run again, on either replica.)
        ended = {"answered": completing, "failing": failing, "idle": idling, "cancelled": cancelled}
        deadline = time.monotonic() + 60
        for sids in ended.values():
            for sid in sids:
                while (view := await a.get(f"{BASE}/{sid}")).status_code == 503 or \
                        view.status_code == 200 and view.json()["state"] in ("open", "streaming", "generating"):
                    assert time.monotonic() < deadline, view.text
                    await asyncio.sleep(0.05)
                assert view.status_code in (200, 410), view.text
        assert released >= {sid for sids in ended.values() for sid in sids}, "every release met a pause"
        while (count := open_slots(admin)) != 0:
            assert time.monotonic() < deadline, f"{count} slots still held after every session ended"
            await asyncio.sleep(0.05)
        # The identity can open as many sessions as before.
        again = [await create(a, {}) for _ in range(4 * PER_WAY)]
        assert len(again) == 4 * PER_WAY
    admin.close()


async def test_the_output_stream_expires_from_its_first_frame(redis_url: str) -> None:
    """Without a TTL from its creation, the answer's stream of a session whose runner died
    mid-answer outlived every other key of the session."""
    engine = ScriptedEngine(Script(hang=True))
    async with app_client(make_settings(redis_url=redis_url), engine) as client:
        sid = (await client.post(BASE, json={"first_chunk": {"sequence_id": 0, "text": "hi there",
                                                             "end_of_input": True}})).json()["session_id"]
        admin = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 10
        while not admin.exists(f"sis:{{{sid}}}:out"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert admin.pttl(f"sis:{{{sid}}}:out") > 0
        admin.close()
