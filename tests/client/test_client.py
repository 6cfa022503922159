"""The Python client against a real gateway and real Redis, through a proxy that injects faults.

The gateway runs the scripted engine (it answers ``echo: <input>``, a word
at a time); what it was fed is what the engine session recorded, and what
was stored is read back from Redis. The real vLLM engine's run is in
``test_client_real_engine.py``.
"""

from __future__ import annotations

import time
import wave
from pathlib import Path

import numpy as np
import pytest
import redis

from gateway.settings import Settings
from omni_adapter.port import Capabilities
from omni_adapter.scripted import Script, ScriptedEngine
from omni_client import (
    AsyncClient,
    BadRequest,
    Client,
    Conflict,
    ModelNotFound,
    NotFound,
    RateLimited,
    RetryPolicy,
    SessionFailed,
    SessionNotFound,
    TextDelta,
    TransportFailed,
)
from omni_client.chunks import chunk_of
from omni_client.retry import retryable_status
from tests.client.conftest import LiveGateway
from tests.client.fault_proxy import FaultProxy
from tests.client.helpers import FAST_RETRY, Faults, stored_digests, text_digests
from tests.gateway.client import make_settings
from tests.redis_server import free_port

WORDS = [f"word{i} " for i in range(30)]
TEXT = "".join(WORDS)


def assert_no_duplicate_no_gap(gateway: LiveGateway, session_id: str, view: dict) -> None:
    assert stored_digests(gateway.settings, session_id) == text_digests(WORDS)  # each stored once, whole
    assert view["received_chunks"] == len(WORDS) and view["missing_sequence_ids"] == []
    fed = [s for s in gateway.engine.sessions if s.fed]
    assert len(fed) == 1 and fed[0].input_text == TEXT  # the engine got each chunk once, in order


async def test_async_retries_store_each_chunk_once_and_the_answer_resumes(gateway: LiveGateway) -> None:
    proxy = FaultProxy(gateway.port, Faults())
    with proxy.running():
        async with AsyncClient(proxy.url, retry=FAST_RETRY) as client:
            session = await client.create_session(temperature=0)
            acks = [await session.send(word) for word in WORDS]
            finished = await session.finish()
            text = "".join([e.text async for e in session.answer() if isinstance(e, TextDelta)])
            view = await session.view()

    assert [ack.sequence_id for ack in acks] == list(range(len(WORDS)))
    # Dropped and 502-after requests reached the gateway: their retries were duplicates.
    assert [ack.duplicate for ack in acks] == [seq % 4 in (1, 2) for seq in range(len(WORDS))]
    assert proxy.faults("502") > 0 and finished.missing_sequence_ids == []
    assert_no_duplicate_no_gap(gateway, session.id, view)
    assert proxy.faults("cut:4") == proxy.faults("cut:6") == 1  # the stream broke twice mid-answer
    assert text == f"echo: {TEXT}"

    async with AsyncClient(gateway.url) as direct:  # the same input, undisturbed
        undisturbed = await direct.create_session(temperature=0)
        await undisturbed.send(TEXT, end_of_input=True)
        assert text == await undisturbed.text()


def test_sync_client_behind_the_faulty_proxy(gateway: LiveGateway) -> None:
    proxy = FaultProxy(gateway.port, Faults())
    with proxy.running(), Client(proxy.url, retry=FAST_RETRY) as client:
        session = client.create_session(messages=[{"role": "system", "content": "be brief"}])
        for word in WORDS:
            session.send(word)
        session.finish()
        events = list(session.answer())
        result = session.result(wait=10)
        view = session.view()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == result.text == f"echo: {TEXT}"
    assert result.state == "completed" and result.finish_reason == "stop"
    assert result.usage["completion_tokens"] >= len(WORDS)
    assert_no_duplicate_no_gap(gateway, session.id, view)


async def test_concurrent_sends_take_distinct_ids_and_arrive_whole(gateway: LiveGateway) -> None:
    import asyncio

    proxy = FaultProxy(gateway.port, Faults())
    with proxy.running():
        async with AsyncClient(proxy.url, retry=FAST_RETRY) as client:
            session = await client.create_session()
            acks = await asyncio.gather(*(session.send(word) for word in WORDS))
            await session.finish()
            await session.result(wait=10)
            view = await session.view()
    assert sorted(ack.sequence_id for ack in acks) == list(range(len(WORDS)))
    assert_no_duplicate_no_gap(gateway, session.id, view)


def test_errors_are_typed_and_carry_the_envelope(gateway: LiveGateway) -> None:
    with Client(gateway.url, retry=FAST_RETRY) as client:
        with pytest.raises(BadRequest) as bad:
            client.create_session(temperature=9)
        assert bad.value.status == 422 and bad.value.code == "validation_error" and bad.value.param
        assert bad.value.envelope["error"]["code"] == "validation_error"

        session = client.create_session()
        session.send("hello ")
        with pytest.raises(Conflict) as conflict:
            session.send("not hello", sequence_id=0)
        assert conflict.value.code == "sequence_conflict" and conflict.value.sequence_id == 0
        assert session.send("hello ", sequence_id=0).duplicate  # the same bytes again: a duplicate

        with pytest.raises(SessionNotFound) as missing:
            client.session("sis-doesnotexist")
        assert missing.value.status == 404 and missing.value.code == "session_not_found"
        # Another 404 is not a session's: code that recreates a vanished session must not loop on it.
        with pytest.raises(ModelNotFound) as unserved:
            client.create_session(model="no-such-model")
        assert not isinstance(unserved.value, SessionNotFound) and isinstance(unserved.value, NotFound)

    closed = free_port()
    with Client(f"http://127.0.0.1:{closed}", retry=FAST_RETRY) as nowhere, \
            pytest.raises(TransportFailed, match="cannot connect"):
        nowhere.create_session()


def test_a_failed_answer_raises_session_failed(gateway: LiveGateway) -> None:
    gateway.engine.script = Script(error_after_words=2)
    with Client(gateway.url) as client:
        session = client.create_session()
        session.send("a b c d", end_of_input=True)
        with pytest.raises(SessionFailed) as failed:
            list(session.answer())
        assert failed.value.code == "engine_error" and "scripted failure" in failed.value.message
        with pytest.raises(SessionFailed):
            session.result(wait=10)


def test_retry_after_is_honoured_on_429(redis_url: str) -> None:
    from gateway.runtime.app import create_app
    from tests.gateway.client import live_server

    settings = make_settings(redis_url=redis_url, rate_limit_rps=2, rate_limit_burst=2)
    with live_server(create_app(settings, engine=ScriptedEngine())) as url:
        # Backoff alone (1 ms) would give up long before a token comes back; Retry-After waits for it.
        tiny = RetryPolicy(attempts=4, backoff_sec=0.001, max_backoff_sec=0.001)
        with Client(url, retry=tiny) as client:
            session = client.create_session()
            started = time.monotonic()
            for word in WORDS[:6]:
                session.send(word)
            assert time.monotonic() - started >= 1.0  # it did wait
        with Client(url, retry=RetryPolicy(attempts=1)) as impatient, pytest.raises(RateLimited) as limited:
            for _ in range(10):
                impatient.session(session.id).view()
        assert limited.value.status == 429 and limited.value.retry_after is not None


AUDIO_ENGINE = Capabilities(input_modalities=frozenset({"text", "audio"}), output_modalities=frozenset({"text"}),
                            incremental=True, model_names=("scripted",))


@pytest.mark.parametrize("engine", [ScriptedEngine(capabilities=AUDIO_ENGINE)])
def test_audio_chunks_in_every_shape_callers_have(gateway: LiveGateway, tmp_path: Path) -> None:
    ramp = np.arange(-800, 800, dtype=np.int16)
    wav_path = tmp_path / "tone.wav"
    with wave.open(str(wav_path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(24_000)
        out.writeframes(ramp.tobytes())
    with Client(gateway.url) as client:
        session = client.create_session(start_policy="on_end_only")
        session.send(ramp)                                          # int16 array, 16 kHz
        session.send(ramp.astype(np.float32) / 32768, sample_rate=24_000)  # floats in [-1, 1]
        session.send(ramp.tobytes(), sample_rate=8_000)              # raw pcm16 bytes
        session.send(wav_path)                                       # a WAV file
        session.send(wav_path.read_bytes(), end_of_input=True)       # a WAV's bytes
        session.result(wait=10)
    [fed] = [s for s in gateway.engine.sessions if s.fed]  # as stored: the runner feeds what Redis holds
    chunks = fed.fed
    assert [(c.sequence_id, c.modality, c.format, c.sample_rate) for c in chunks] == [
        (0, "audio", "pcm16", 16_000), (1, "audio", "pcm16", 24_000), (2, "audio", "pcm16", 8_000),
        (3, "audio", "wav", None), (4, "audio", "wav", None)]
    assert chunks[0].data == chunks[2].data == ramp.tobytes()
    assert np.abs(np.frombuffer(chunks[1].data, "<i2") - ramp).max() <= 1
    assert chunks[3].data == chunks[4].data == wav_path.read_bytes()
    with pytest.raises(ValueError, match="mono"):
        chunk_of(np.zeros((4, 2)))


def test_a_create_is_retried_under_its_idempotency_key_and_makes_one_session(gateway: LiveGateway) -> None:
    plan = iter(["503", "503", "pass", "502_after", "pass"])
    keys: list[str] = []

    def faults(method: str, path: str, headers: dict[str, str]) -> str:
        keys.append(headers.get("idempotency-key", ""))
        return next(plan)

    proxy = FaultProxy(gateway.port, faults)
    with proxy.running(), Client(proxy.url, retry=FAST_RETRY) as client:
        first = client.create_session()  # two refusals, then created
        second = client.create_session()  # made, but the answer was lost: asked again, same key
    assert [fault for *_, fault in proxy.log] == ["503", "503", "pass", "502_after", "pass"]
    assert keys[0] == keys[1] == keys[2] != keys[3] == keys[4] and all(keys)
    assert gateway.settings.redis_url is not None
    with redis.Redis.from_url(gateway.settings.redis_url) as r:
        made = {key.decode().split("{")[1].split("}")[0] for key in r.scan_iter("sis:{*}:meta")}
    assert made == {first.id, second.id}  # one each: nothing created twice


def test_a_call_that_may_have_done_its_work_is_repeated_only_when_safe() -> None:
    # Without an idempotency key, only refusals that surely did nothing.
    assert retryable_status(429, idempotent=False)
    assert retryable_status(503, idempotent=False, code="overloaded")
    assert not retryable_status(503, idempotent=False, code="store_unavailable")  # maybe after the work
    assert not retryable_status(502, idempotent=False)
    assert retryable_status(502, idempotent=True) and retryable_status(503, idempotent=True, code="store_unavailable")


def test_behind_a_round_robin_balancer_every_call_may_land_on_another_replica(
        settings: Settings, gateway: LiveGateway) -> None:
    from gateway.runtime.app import create_app
    from tests.gateway.client import live_server

    other_engine = ScriptedEngine(Script(word_delay_sec=0.02))
    with live_server(create_app(settings.model_copy(update={"replica_id": "other"}), engine=other_engine)) as other:
        other_port = int(other.rsplit(":", 1)[1])
        proxy = FaultProxy([gateway.port, other_port], Faults())
        with proxy.running(), Client(proxy.url, retry=FAST_RETRY) as client:
            session = client.create_session()
            for word in WORDS:
                session.send(word)
            session.finish()
            text = "".join(e.text for e in session.answer() if isinstance(e, TextDelta))
            view = session.view()
    assert text == f"echo: {TEXT}"
    fed = [s for engine in (gateway.engine, other_engine) for s in engine.sessions if s.fed]
    assert len(fed) == 1 and fed[0].input_text == TEXT  # one engine session got everything once
    assert stored_digests(gateway.settings, session.id) == text_digests(WORDS)
    assert view["received_chunks"] == len(WORDS)
