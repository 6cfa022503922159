"""A burst of starts never pushes a replica past its engine cap (issue 29, item 6).

Each call that may start engine work looked at the room, then waited on
Redis, then started its runner: 200 chats at once all saw room before the
first runner registered, and 200 engine sessions ran against a cap of 64.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from omni_adapter.port import EngineRequest
from omni_adapter.scripted import Script, ScriptedEngine, ScriptedSession
from tests.gateway.client import app_client, make_settings

CAP = 64
BURST = 200


@dataclass
class CountingEngine(ScriptedEngine):
    """The scripted engine, counting the sessions it runs at once (opened, not yet closed)."""

    peak_running: int = 0

    def open_session(self, request: EngineRequest) -> ScriptedSession:
        session = super().open_session(request)
        running = sum(1 for s in self.sessions if not s.aborted)
        self.peak_running = max(self.peak_running, running)
        return session


async def test_two_hundred_chats_at_once_run_at_most_the_cap(redis_url: str) -> None:
    engine = CountingEngine(Script(word_delay_sec=0.01))
    settings = make_settings(redis_url=redis_url, max_engine_sessions=CAP, tend_interval_sec=0.05)
    async with app_client(settings, engine) as client:
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(BURST)))
    assert [a.status_code for a in answers] == [200] * BURST
    assert {a.json()["choices"][0]["message"]["content"] for a in answers} == {
        f"echo: question {i}" for i in range(BURST)}
    assert len(engine.sessions) == BURST
    assert engine.peak_running <= CAP, f"{engine.peak_running} engine sessions at once, cap {CAP}"
