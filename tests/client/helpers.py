"""Helpers of the client tests: the fault plan, fast retries, chunk digests read back from Redis,
the ``omni-gateway`` command in a subprocess."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import redis

from gateway.settings import Settings
from gateway.store.keys import session_keys
from gateway.store.records import ChunkRecord
from omni_client import RetryPolicy

ROOT = Path(__file__).resolve().parents[2]
FAST_RETRY = RetryPolicy(attempts=6, backoff_sec=0.01, max_backoff_sec=0.05)


class Faults:
    """Every fault in turn: the first try of chunk n meets pass / drop / 502 after / 502
    before (n mod 4), a second try of a chunk meets a 502 once in three, later tries pass;
    the first finish is dropped after it reached the gateway; the first two answer streams
    are cut mid-answer."""

    def __init__(self) -> None:
        self._tries: dict[str, int] = {}
        self._finishes = itertools.chain(["drop"], itertools.repeat("pass"))
        self._streams = itertools.chain(["cut:4", "cut:6"], itertools.repeat("pass"))

    def __call__(self, method: str, path: str, headers: dict[str, str]) -> str:
        if path.endswith("/chunks"):
            seq = headers["x-sequence-id"]
            tries = self._tries[seq] = self._tries.get(seq, 0) + 1
            if tries == 1:
                return ["pass", "drop", "502_after", "502"][int(seq) % 4]
            return "502" if tries == 2 and int(seq) % 3 == 0 else "pass"
        if path.endswith("/finish"):
            return next(self._finishes)
        if "/events" in path:
            return next(self._streams)
        return "pass"


def stored_digests(settings: Settings, session_id: str) -> dict[int, str]:
    """The content digest of each chunk the session took, by sequence id. Its chunks themselves
    are gone once it ended (lua/lib.lua refresh_ttl); their digests stay as long as its result."""
    assert settings.redis_url is not None
    with redis.Redis.from_url(settings.redis_url) as client:
        raw = client.hgetall(session_keys(session_id).digests)
    return {int(seq): record.decode().split(":", 1)[0] for seq, record in raw.items() if seq.isdigit()}


def text_digests(texts: list[str]) -> dict[int, str]:
    """What ``stored_digests`` reads after ``texts`` were sent as text chunks 0, 1, ..."""
    return {seq: ChunkRecord(seq, "text", text.encode()).content_digest for seq, text in enumerate(texts)}


def omni_gateway(*args: str, url: str | None = None, stdin: str | None = None, timeout: float = 120,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    env.pop("OMNI_GATEWAY_URL", None)
    if url:
        env["OMNI_GATEWAY_URL"] = url
    return subprocess.run([sys.executable, "-m", "gateway.runtime.cli", *args], env=env, input=stdin, text=True,
                          capture_output=True, timeout=timeout, cwd=cwd)
