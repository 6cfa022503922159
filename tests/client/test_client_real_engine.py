"""The client on the real vLLM engine (the suite's shared one), through the fault proxy:
retried chunks reach the engine once each, and a broken answer stream resumes to the
same text as an undisturbed run of the same question (temperature 0)."""

from __future__ import annotations

import pytest

from omni_adapter.port import Engine
from omni_client import AsyncClient, TextDelta
from tests.client.fault_proxy import FaultProxy
from tests.client.helpers import FAST_RETRY, Faults, stored_digests, text_digests
from tests.gateway.client import live_app, make_settings

pytestmark = pytest.mark.engine

QUESTION = ["What ", "is ", "the ", "capital ", "of ", "France?"]
BODY = {"messages": [{"role": "system", "content": "You are a helpful assistant."}],
        "temperature": 0, "max_tokens": 24}


async def test_retries_and_resumes_give_the_undisturbed_answer(redis_url: str, vllm_engine: Engine) -> None:
    settings = make_settings(redis_url=redis_url)
    async with live_app(settings, vllm_engine) as url:
        proxy = FaultProxy(int(url.rsplit(":", 1)[1]), Faults())
        with proxy.running():
            async with AsyncClient(proxy.url, retry=FAST_RETRY) as client:
                session = await client.create_session(**BODY)
                acks = [await session.send(word) for word in QUESTION]
                await session.finish()
                text = "".join([e.text async for e in session.answer() if isinstance(e, TextDelta)])
                view = await session.view()
        async with AsyncClient(url) as direct:
            undisturbed = await direct.create_session(**BODY)
            await undisturbed.send("".join(QUESTION), end_of_input=True)
            expected = await undisturbed.text()

    assert any(ack.duplicate for ack in acks) and proxy.faults("502") > 0
    assert stored_digests(settings, session.id) == text_digests(QUESTION)
    assert view["received_chunks"] == len(QUESTION) and view["state"] == "completed"
    assert proxy.faults("cut:4") == proxy.faults("cut:6") == 1
    assert text and text == expected, (text, expected)
