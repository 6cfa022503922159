"""``omni-gateway stream``: the real command in a subprocess against a real gateway and Redis."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from gateway.runtime.app import create_app
from gateway.settings import Settings
from gateway.store.keys import session_keys
from omni_adapter.listener import with_listener
from omni_adapter.scripted import Script, ScriptedEngine
from omni_adapter.talker import with_talker
from omni_client import read_wav, wav_bytes
from tests.client.conftest import LiveGateway
from tests.client.helpers import ROOT, omni_gateway, stored_digests
from tests.gateway.client import live_server
from tests.redis_server import free_port
from tests.voice import SPEECH_RATE, recognize, speech

QUESTION = "What is the capital of France? Tell me in a few words please."


@pytest.fixture
def question(tmp_path: Path) -> Path:
    path = tmp_path / "question.txt"
    path.write_text(QUESTION + "\n")
    return path


def test_a_text_file_streams_and_the_answer_prints(gateway: LiveGateway, question: Path) -> None:
    done = omni_gateway("stream", str(question), "--words", "2", "--url", gateway.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"echo: {QUESTION}\n\n"  # the text as chunked and joined, then a newline
    assert "first token" in done.stderr and "after end of input" in done.stderr
    assert "\r" not in done.stderr and "Traceback" not in done.stderr  # no bar when stderr is not a terminal
    fed = gateway.engine.sessions[0]
    assert len(fed.fed) == math.ceil(len((QUESTION + "\n").split()) / 2)


def test_realtime_paces_the_chunks_and_chars_cut_them(gateway: LiveGateway, question: Path) -> None:
    started = time.monotonic()
    done = omni_gateway("stream", "-", "--chars", "12", "--chunk-ms", "150", "--realtime",
                        url=gateway.url, stdin=QUESTION)  # the URL from the environment, text from stdin
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"echo: {QUESTION}")
    session = gateway.engine.sessions[0]
    chunks = math.ceil(len(QUESTION) / 12)
    assert [c.data.decode() for c in session.fed] == [QUESTION[i:i + 12] for i in range(0, len(QUESTION), 12)]
    # Fed as they were sent, 150 ms apart, not all at once. The engine's feed loop may take
    # chunks that arrive close together at once on a busy machine (a CI run fed 5 intervals
    # in 0.34 s): a third of the span is the bar; all at once would be a few ms.
    assert session.fed_at[-1] - session.fed_at[0] >= 0.15 * (chunks - 1) / 3
    assert time.monotonic() - started >= 0.15 * (chunks - 1)


def test_exit_codes_and_messages(gateway: LiveGateway, tmp_path: Path, question: Path) -> None:
    fake_wav = tmp_path / "fake.wav"
    fake_wav.write_bytes(b"RIFF not really a wav file")
    (empty := tmp_path / "empty.txt").write_text("  \n")
    runs = [
        ("stream", str(tmp_path / "nope.txt"), "--url", gateway.url),
        ("stream", str(fake_wav), "--url", gateway.url),
        ("stream", str(empty), "--url", gateway.url),
        ("stream", str(question), "--chunk-ms", "0"),
        ("stream", str(question), "--url", f"http://127.0.0.1:{free_port()}"),
        ("stream", str(question), "--temperature", "9", "--url", gateway.url),
        ("stream", "--help"),
    ]
    # Two at a time: each run is mostly a Python process starting.
    with ThreadPoolExecutor(max_workers=2) as pool:
        missing, bad, empty_run, usage, nowhere, refused, helped = pool.map(lambda args: omni_gateway(*args), runs)
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "nope.txt" in missing.stderr
    assert bad.returncode == 2 and "not a PCM WAV file" in bad.stderr
    assert empty_run.returncode == 2
    assert usage.returncode == 2 and "at least 1" in usage.stderr
    assert nowhere.returncode == 3 and "cannot reach the gateway" in nowhere.stderr
    assert refused.returncode == 4
    assert "the gateway refused: 422 validation_error (temperature)" in refused.stderr

    gateway.engine.script = Script(error_after_words=1)
    failed = omni_gateway("stream", str(question), "--url", gateway.url)
    assert failed.returncode == 5 and "the answer failed: engine_error: scripted failure" in failed.stderr

    for result in (missing, bad, usage, nowhere, refused, failed):
        assert "Traceback" not in result.stderr, result.stderr
    assert helped.returncode == 0 and "examples:" in helped.stdout and "--save-audio answer.wav" in helped.stdout


@pytest.fixture
def voice_gateway(settings: Settings) -> Iterator[LiveGateway]:
    """The real Listener (Moonshine) and Talker (hibari) around the scripted Thinker."""
    thinker = ScriptedEngine()
    with live_server(create_app(settings, engine=with_talker(with_listener(thinker)))) as url:
        yield LiveGateway(url, thinker, settings)


def test_a_wav_streams_in_realtime_and_the_spoken_answer_is_saved(voice_gateway: LiveGateway,
                                                                   tmp_path: Path) -> None:
    spoken = speech("What is the capital of France?")
    question = tmp_path / "question.wav"
    question.write_bytes(wav_bytes(spoken, SPEECH_RATE))
    answer = tmp_path / "answer.wav"
    started = time.monotonic()
    done = omni_gateway("stream", str(question), "--chunk-ms", "200", "--realtime", "--save-audio", str(answer),
                        "--url", voice_gateway.url)
    assert done.returncode == 0, done.stderr
    duration = len(spoken) / 2 / SPEECH_RATE
    assert time.monotonic() - started >= duration  # sent as it was spoken
    session_id = re.search(r"^session (\S+)$", done.stderr, re.M)
    assert session_id is not None, done.stderr
    assert len(stored_digests(voice_gateway.settings, session_id[1])) == math.ceil(duration / 0.2)
    assert "capital" in done.stdout and "heard: What is the capital of France?" in done.stderr
    assert "first audio" in done.stderr and "saved" in done.stderr
    pcm, rate = read_wav(answer.read_bytes())
    assert rate == 24_000 and len(pcm) / 2 / rate > 0.5
    assert "capital" in recognize(pcm, rate)  # the saved answer speaks the echoed question


def test_on_a_terminal_a_progress_bar_counts_sent_and_acknowledged(gateway: LiveGateway, question: Path) -> None:
    import pty

    controller, terminal = pty.openpty()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    with subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "stream", str(question), "--words", "1",
                           "--url", gateway.url], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=terminal,
                          text=True) as proc:
        os.close(terminal)
        stdout, _ = proc.communicate(timeout=120)
        seen = b""
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # the terminal closed with the process
                break
            if not data:
                break
            seen += data
    os.close(controller)
    words = len(QUESTION.split())
    assert proc.returncode == 0 and stdout.startswith("echo: ")
    bar = seen.decode()
    assert "\r" in bar and f"sent {words}/{words}  acked {words}/{words}" in bar


@pytest.fixture
def keyed_settings(redis_url: str) -> Settings:  # noqa: F811 - pytest's fixture injection
    from tests.gateway.client import make_settings

    return make_settings(redis_url=redis_url, api_keys="sk-right")


def test_api_key_and_url_from_flags(keyed_settings: Settings, question: Path) -> None:
    with live_server(create_app(keyed_settings, engine=ScriptedEngine())) as url:
        keyless = omni_gateway("stream", str(question), "--url", url)
        assert keyless.returncode == 4 and "401 missing_credentials" in keyless.stderr
        wrong = omni_gateway("stream", str(question), "--url", url, "--api-key", "sk-wrong")
        assert wrong.returncode == 4 and "401 invalid_api_key" in wrong.stderr
        keyed = omni_gateway("stream", str(question), "--url", url, "--api-key", "sk-right")
        assert keyed.returncode == 0 and keyed.stdout.startswith("echo: What is"), keyed.stderr
    bad_url = omni_gateway("stream", str(question), "--url", "127.0.0.1:8080")
    assert bad_url.returncode == 2 and "--url must start with http://" in bad_url.stderr


def test_ctrl_c_cancels_the_session_and_exits_130(gateway: LiveGateway, question: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored:
    # the CLI gets it as a terminal's Ctrl-C would, however the test suite was started.
    with subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "stream", str(question), "--words", "1",
                           "--chunk-ms", "500", "--realtime", "--url", gateway.url], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        deadline = time.monotonic() + 30
        while not gateway.engine.sessions or len(gateway.engine.sessions[0].fed) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no chunk arrived"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    found = re.search(r"interrupted \(session (\S+) cancelled\)", stderr)
    assert found is not None and "Traceback" not in stderr, stderr
    assert gateway.engine.sessions[0].aborted
    with redis.Redis.from_url(gateway.settings.redis_url or "") as client:
        assert client.hget(session_keys(found[1]).meta, "state") == b"cancelled"


def test_a_refused_chunk_exits_4_and_cancels_its_session(redis_url: str, question: Path) -> None:  # noqa: F811
    from tests.gateway.client import make_settings

    engine = ScriptedEngine()
    with live_server(create_app(make_settings(redis_url=redis_url, max_chunk_bytes=16), engine=engine)) as url:
        done = omni_gateway("stream", str(question), "--chars", "20", "--url", url)
    assert done.returncode == 4 and "413 chunk_too_large" in done.stderr, done.stderr
    with redis.Redis.from_url(redis_url) as client:
        states = {client.hget(key, "state") for key in client.scan_iter("sis:{*}:meta")}
    assert states == {b"cancelled"}  # not left open until it times out
