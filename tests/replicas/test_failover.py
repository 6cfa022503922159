"""Three real gateway processes, one real Redis, the real engine: nothing lost.

One session is appended to across replicas while its owner is killed with
kill -9 mid-input, then the replica that took it over is killed
mid-generation. The text a subscriber reads (reconnecting with
Last-Event-ID) and the stored result must equal an undisturbed run at
temperature 0: nothing lost, nothing repeated. The same holds when only a
replica's engine core is killed (the replica hands over and exits 1), and
for Realtime sockets (an answer, a transcription) reconnected elsewhere. Then
SIGTERM on the last replica: /readyz fails at once and its running session
still completes.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from gateway.domain.states import SessionState
from gateway.store.keys import SCHEDULE, session_keys
from tests.gateway.test_edge import nginx
from tests.redis_server import redis_process
from tests.replicas.gateways import Gateway, ready, stop_all, wait_until
from tests.voice import SPEECH_RATE, pieces, speech, word_error_rate

SESSIONS = "/v1/streaming_input/sessions"
NAMES = ("replica-a", "replica-b", "replica-c")
LEASE_TTL_SEC = 3
SHUTDOWN_GRACE_SEC = 10
CHUNKS = ["List the", " days of the week,", " one per line."]
#: Every answer runs its 48 tokens (no early end): a kill after its first content frame lands mid-answer
#: however slowly the replica reading it out answers (a CI run's answer ended before its kill).
REQUEST = {"temperature": 0, "max_tokens": 48, "ignore_eos": True, "start_policy": "on_first_chunk"}

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]


@dataclass
class Replicas:
    gateways: dict[str, Gateway]
    redis_url: str
    #: NGINX in front of all three (deploy/edge_nginx.py), round robin: where clients reconnect.
    edge: str

    def diagnostics(self, session_id: str | None = None) -> str:
        """The replicas' logs; with ``session_id``, first what decides its takeover:
        what Redis holds on it, what each replica logged of it, and whether each is ready."""
        tails = "\n".join(g.tail() for g in self.gateways.values())
        if session_id is None:
            return tails
        store = redis.Redis.from_url(self.redis_url, decode_responses=True)
        seconds, micros = store.time()
        told = [f"--- redis at {seconds * 1000 + micros // 1000} ms",
                f"meta: {store.hgetall(session_keys(session_id).meta)}",
                f"schedule: {store.zscore(SCHEDULE, session_id)}"]
        for gateway in self.gateways.values():
            told.append(f"--- {gateway.name} on {session_id}")
            told += [line for line in gateway.log.read_text(errors="replace").splitlines()
                     if session_id in line and "GET " not in line]
            if gateway.alive():
                readiness = httpx.get(f"{gateway.url}/readyz", timeout=5)
                told.append(f"/readyz: {readiness.status_code} {readiness.text}")
        return "\n".join(told) + "\n" + tails


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    workdir: Path = tmp_path_factory.mktemp("replicas")
    with redis_process() as redis_server:
        env = {
            "OMNI_GATEWAY_REDIS_URL": redis_server.url, "OMNI_GATEWAY_LEASE_TTL_SEC": str(LEASE_TTL_SEC),
            "OMNI_GATEWAY_TEND_INTERVAL_SEC": "0.1", "OMNI_GATEWAY_DRAIN_SEC": "3",
            "OMNI_GATEWAY_SHUTDOWN_GRACE_SEC": str(SHUTDOWN_GRACE_SEC),
            "OMNI_GATEWAY_MAX_SESSIONS_PER_IDENTITY": "0", "OMNI_GATEWAY_RATE_LIMIT_RPS": "0",
            "OMNI_GATEWAY_MAX_OPEN_SESSIONS": "0", "OMNI_GATEWAY_KV_CACHE_SPACE_GIB": "1",
            "OMNI_GATEWAY_MAX_MODEL_LEN": "1024",
            # Explicit: the engine adapter exports this for its own process, and
            # a variable this test process inherited would win over the setting.
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        gateways = {name: Gateway(name, workdir, env) for name in NAMES}
        with nginx([f"127.0.0.1:{g.port}" for g in gateways.values()], workdir / "edge") as edge:
            running = Replicas(gateways, redis_server.url, edge)
            try:
                for gateway in running.gateways.values():
                    gateway.start()
                all_ready(running)
                yield running
            finally:
                stop_all(list(running.gateways.values()))


def all_ready(replicas: Replicas) -> None:
    """Every replica answers /readyz: a test that kills one starts it again without waiting."""
    for gateway in replicas.gateways.values():
        wait_until(lambda g=gateway: ready(g), 900, f"{gateway.name} ready", replicas.diagnostics)


def sse_frames(base: str, sid: str, *, after: str | None = None, stop_after_content: int | None = None,
               timeout: float = 240) -> list[tuple[str, str]]:
    """(id, data) of the stream's frames, from ``after``; stop early after N content frames."""
    headers = {"Last-Event-ID": after} if after else {}
    frames: list[tuple[str, str]] = []
    event_id = ""
    with httpx.stream("GET", f"{base}{SESSIONS}/{sid}/events", headers=headers,
                      timeout=httpx.Timeout(timeout)) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("event:"):
                raise AssertionError(f"stream error: {line} {next(response.iter_lines(), '')}")
            elif line.startswith("data:"):
                frames.append((event_id, line[5:].strip()))
                if frames[-1][1] == "[DONE]":
                    break
                if stop_after_content is not None and \
                        sum(1 for _, d in frames if content(d)) >= stop_after_content:
                    break
    return frames


def content(data: str) -> str:
    if data == "[DONE]":
        return ""
    return "".join(c["delta"].get("content") or "" for c in json.loads(data)["choices"])


def text_of(frames: list[tuple[str, str]]) -> str:
    return "".join(content(data) for _, data in frames)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{SESSIONS}{path}", json=body, timeout=60)


def chunk(base: str, sid: str, seq: int, end: bool = False) -> None:
    response = post(base, f"/{sid}/chunks", {"sequence_id": seq, "text": CHUNKS[seq], "end_of_input": end})
    assert response.status_code == 202, response.text


def owner(base: str, sid: str) -> str | None:
    return httpx.get(f"{base}{SESSIONS}/{sid}", timeout=30).json()["owner"]


class OwnerWatch:
    """Who runs a session, read from its hash in Redis: no replica's answer can lag
    behind it. Keeps every change it saw, for the failure message."""

    def __init__(self, redis_url: str, session_id: str, diagnostics: Callable[[], str]) -> None:
        self._store = redis.Redis.from_url(redis_url, decode_responses=True)
        self._diagnostics = diagnostics
        self._meta = session_keys(session_id).meta
        self._since = self._last_read = time.monotonic()
        self._seen: list[tuple[float, str, str]] = []
        #: The longest time between two reads: a stalled test process shows here.
        self._longest_gap = 0.0

    def owner(self) -> str:
        state, holder = self._store.hmget(self._meta, "state", "owner")
        now = time.monotonic()
        self._longest_gap, self._last_read = max(self._longest_gap, now - self._last_read), now
        if not self._seen or self._seen[-1][1:] != (state, holder):
            self._seen.append((now - self._since, state, holder))
        # An ended session has no owner: say so at once rather than wait out the timeout for one.
        assert not SessionState(state).is_terminal, \
            f"ended before a survivor was seen running it\n{self}\n{self._diagnostics()}"
        return holder

    def __str__(self) -> str:
        changes = ", ".join(f"+{at:.2f} s {state} {holder!r}" for at, state, holder in self._seen)
        return f"owner changes: {changes}; longest time between two reads {self._longest_gap:.2f} s"


@pytest.fixture(scope="module")
def undisturbed(replicas: Replicas) -> dict:
    """The reference: one session across all three replicas, nobody killed."""
    a, b, c = (replicas.gateways[n].url for n in NAMES)
    sid = post(a, "", REQUEST).json()["session_id"]
    chunk(b, sid, 0)
    chunk(c, sid, 1)
    chunk(a, sid, 2, end=True)
    frames = sse_frames(c, sid)
    result = httpx.get(f"{b}{SESSIONS}/{sid}/result", params={"wait": 60}, timeout=90).json()
    return {"text": text_of(frames), "result": result}


def test_append_create_and_subscribe_on_different_replicas(undisturbed: dict) -> None:
    result = undisturbed["result"]
    assert result["state"] == "completed"
    answer = result["completion"]["choices"][0]["message"]["content"]
    assert answer and undisturbed["text"] == answer
    assert result["completion"]["usage"]["completion_tokens"] >= 8, "too short to be cut mid-generation"


def engine_core_of(gateway: Gateway) -> psutil.Process:
    """The replica's vLLM engine core: a child process of the gateway's, named by vLLM."""
    assert gateway.proc is not None
    cores = [child for child in psutil.Process(gateway.proc.pid).children(recursive=True)
             if "EngineCore" in " ".join(child.cmdline())]
    assert len(cores) == 1, cores
    return cores[0]


def test_a_replica_whose_engine_dies_hands_its_session_over_and_exits(
    replicas: Replicas, undisturbed: dict,
) -> None:
    """kill -9 of the engine core alone (an OOM kill, a crash in the model): the gateway
    process lives on and keeps renewing its leases. It must not fail the session it runs, nor
    claim others' work and fail that: it hands the session to another replica, which goes on
    from Redis (nothing lost or repeated), and exits non-zero so its supervisor starts it again."""
    a, b, c = (replicas.gateways[n] for n in NAMES)
    listening = post(a.url, "", REQUEST).json()["session_id"]  # input still coming when the engine dies
    chunk(a.url, listening, 0)
    sid = post(a.url, "", REQUEST).json()["session_id"]
    chunk(a.url, sid, 0)
    assert owner(b.url, sid) == owner(b.url, listening) == "replica-a"
    chunk(a.url, sid, 1)
    chunk(a.url, sid, 2, end=True)
    try:
        first_part = sse_frames(b.url, sid, stop_after_content=1)
        engine_core_of(a).kill()
        killed = time.monotonic()
        assert a.proc is not None and a.proc.wait(timeout=60) == 1, a.tail()
        # Sooner than a shutdown's grace for running sessions: a dead engine finishes none.
        assert time.monotonic() - killed < SHUTDOWN_GRACE_SEC, a.tail()
        log = a.log.read_text(errors="replace")
        assert "stopping this replica: the vLLM engine died" in log, a.tail()
        # Also proves the kill came before the end of the answer: a finished one is not released.
        for session_id in (sid, listening):
            assert f"session {session_id}: released to another replica" in log, a.tail()
        a.start()  # as its supervisor would: the restart runs beside the rest (the next test waits for it)
        rest = sse_frames(replicas.edge, sid, after=first_part[-1][0])  # reconnect through the edge
        assert rest[-1][1] == "[DONE]"
        assert text_of(first_part) + text_of(rest) == undisturbed["text"], "nothing lost or repeated"
        result = httpx.get(f"{b.url}{SESSIONS}/{sid}/result", timeout=30).json()
        assert result["state"] == "completed", result
        assert result["completion"]["usage"] == undisturbed["result"]["completion"]["usage"]

        chunk(c.url, listening, 1)  # the released listening session goes on elsewhere
        chunk(b.url, listening, 2, end=True)
        assert text_of(sse_frames(replicas.edge, listening)) == undisturbed["text"]
    finally:
        if not a.alive():
            a.start()  # the next tests need three replicas (they wait for it)


def realtime_events(ws: Any, until: str, within_sec: float = 240) -> list[dict]:
    seen: list[dict] = []
    while not seen or seen[-1]["type"] != until:
        seen.append(json.loads(ws.recv(timeout=within_sec)))
        assert seen[-1]["type"] != "error", seen[-1]
    return seen


def realtime_text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def ask_over_realtime(ws: Any) -> str:
    """session.created, then one text turn asked (text out, temperature 0); the session id."""
    session_id = json.loads(ws.recv(timeout=60))["session"]["id"]
    ws.send(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "output_modalities": ["text"], "temperature": 0, "max_output_tokens": 48,
        "instructions": "", "audio": {"input": {"turn_detection": None}}}}))
    realtime_events(ws, "session.updated")
    ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "".join(CHUNKS)}]}}))
    ws.send(json.dumps({"type": "response.create"}))
    return session_id


def test_kill_9_of_the_replica_holding_a_realtime_socket_mid_answer(replicas: Replicas) -> None:
    from websockets.sync.client import connect

    # replica-a may still be starting again after the test before: b holds the socket. A
    # replica listens only once its engine is up, so the edge passes over one that is starting.
    _, b, c = (replicas.gateways[n] for n in NAMES)
    realtime = "/v1/realtime"
    with connect(c.url.replace("http", "ws") + realtime) as ws:
        ask_over_realtime(ws)
        whole = realtime_events(ws, "response.done")
        undisturbed = realtime_text(whole)
    assert len(undisturbed.split()) >= 4, undisturbed
    try:
        with connect(b.url.replace("http", "ws") + realtime) as ws_b:
            session_id = ask_over_realtime(ws_b)
            before = realtime_events(ws_b, "response.output_text.delta")
            b.kill9()  # the socket and the engine work of the turn go with it
        b.start()  # as its supervisor would, at once: the next test needs it (a starting replica refuses)
        # Reconnect through the edge: it may try the dead (or starting) replica first, then the next.
        with connect(f"{replicas.edge.replace('http', 'ws')}{realtime}?session_id={session_id}"
                     f"&last_event_id={before[-1]['event_id']}") as ws_edge:
            after = realtime_events(ws_edge, "response.done")
        assert after[0]["type"] == "session.created" and after[0]["session"]["id"] == session_id
        assert realtime_text(before) + realtime_text(after) == undisturbed, "nothing lost or repeated"
        assert after[-1]["response"]["status"] == whole[-1]["response"]["status"]  # (incomplete at 48 tokens)
    finally:
        if not b.alive():
            b.start()  # the next test needs three replicas (it waits for it)


def test_kill_9_of_the_replica_holding_a_transcription_socket_loses_no_committed_utterance(
        replicas: Replicas) -> None:
    """A Realtime transcription session (the real Listener) whose replica is killed right after
    an utterance was committed: the client reconnects through the edge with its session id and
    last event, gets that utterance's transcript (told by the survivor, or replayed if the dead
    replica had told it), and the session goes on."""
    from websockets.sync.client import connect

    all_ready(replicas)  # replicas a and b start again after the tests before: one takes the reconnect
    _, _, c = (replicas.gateways[n] for n in NAMES)
    said = ["What is the capital of France?", "Please set a timer for ten minutes.", "Turn off the lights."]
    transcribed = "conversation.item.input_audio_transcription.completed"

    def say(ws: Any, words: str) -> None:
        for piece in pieces(speech(words) + bytes(SPEECH_RATE), SPEECH_RATE, 100):
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

    try:
        with connect(c.url.replace("http", "ws") + "/v1/realtime?intent=transcription") as ws:
            session_id = json.loads(ws.recv(timeout=60))["session"]["id"]
            ws.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
            realtime_events(ws, "session.updated")
            say(ws, said[0])
            first = realtime_events(ws, transcribed)
            say(ws, said[1])
            committed = realtime_events(ws, "input_audio_buffer.committed")
            c.kill9()  # the socket, and the hearing of the committed utterance, go with it
        c.start()  # as its supervisor would (the next test waits for it)
        with connect(f"{replicas.edge.replace('http', 'ws')}/v1/realtime?session_id={session_id}"
                     f"&last_event_id={committed[-1]['event_id']}") as ws:
            after = realtime_events(ws, transcribed)
            say(ws, said[2])
            last = realtime_events(ws, transcribed)
    finally:
        if not c.alive():
            c.start()
    assert after[0]["type"] == "session.created" and after[0]["session"]["id"] == session_id
    assert after[0]["session"]["type"] == "transcription"
    second = [e for e in after if e["type"] == transcribed]
    assert [e["item_id"] for e in second] == [committed[-1]["item_id"]], "told once, for the committed item"
    heard = [e["transcript"] for e in (first[-1], second[0], last[-1])]
    assert [word_error_rate(words, text) for words, text in zip(said, heard, strict=True)] == [0, 0, 0], heard


def test_kill_9_mid_input_then_mid_generation_loses_and_repeats_nothing(
    replicas: Replicas, undisturbed: dict,
) -> None:
    a, b, c = (replicas.gateways[n] for n in NAMES)
    all_ready(replicas)  # replicas a and b start again after the tests before
    sid = post(a.url, "", REQUEST).json()["session_id"]
    chunk(a.url, sid, 0)  # on_first_chunk: A starts the engine work and holds its lease
    assert owner(b.url, sid) == "replica-a"
    chunk(b.url, sid, 1)

    a.kill9()  # mid-input
    chunk(c.url, sid, 2, end=True)  # input keeps arriving while nobody runs the session
    survivors = {g.name: g for g in (b, c)}
    takeover = OwnerWatch(replicas.redis_url, sid, lambda: replicas.diagnostics(sid))
    wait_until(lambda: takeover.owner() in survivors, LEASE_TTL_SEC * 10, "taken over after the lease",
               lambda: f"{takeover}\n{replicas.diagnostics(sid)}", every=0.02)
    second = survivors[takeover.owner()]
    reader = next(g for g in survivors.values() if g is not second)

    first_part = sse_frames(reader.url, sid, stop_after_content=1)
    second.kill9()  # mid-generation: at once, so the answer cannot finish first
    # A completed session has no owner, so this also proves the kill came
    # before the end of the answer (the lease of a dead owner lapses later).
    assert owner(reader.url, sid) == second.name, "the answer finished before the kill: nothing taken over"
    rest = sse_frames(replicas.edge, sid, after=first_part[-1][0])  # reconnect through the edge

    streamed = text_of(first_part) + text_of(rest)
    assert rest[-1][1] == "[DONE]" and 0 < len(text_of(first_part)) < len(undisturbed["text"])
    assert streamed == undisturbed["text"], "a subscriber must see one stream: nothing lost or repeated"
    assert len({i for i, _ in first_part + rest}) == len(first_part + rest)
    result = httpx.get(f"{reader.url}{SESSIONS}/{sid}/result", timeout=30).json()
    assert result["completion"]["choices"][0]["message"]["content"] == undisturbed["text"]
    assert result["completion"]["usage"] == undisturbed["result"]["completion"]["usage"]
    assert owner(reader.url, sid) is None, "an ended session has no owner"


def test_sigterm_fails_readiness_at_once_and_lets_running_work_finish(replicas: Replicas) -> None:
    last = next(g for g in replicas.gateways.values() if g.alive())
    sid = post(last.url, "", {**REQUEST, "max_tokens": 24}).json()["session_id"]
    chunk(last.url, sid, 0)
    chunk(last.url, sid, 1)
    chunk(last.url, sid, 2, end=True)
    last.terminate()
    assert httpx.get(f"{last.url}/readyz", timeout=5).status_code == 503
    # uvicorn re-raises the signal it handled once it is done: -SIGTERM is a clean exit.
    assert last.proc is not None and last.proc.wait(timeout=120) in (0, -signal.SIGTERM), last.tail()
    assert "Traceback" not in last.log.read_text(), last.tail(80)
    store = redis.Redis.from_url(replicas.redis_url)
    meta = {k.decode(): v.decode() for k, v in store.hgetall(session_keys(sid).meta).items()}
    assert meta["state"] == "completed", f"{meta}\n{last.tail()}"
