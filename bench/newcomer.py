"""A newcomer's timeline: setup, first start, first answer, a restart; in one run.

What someone who just cloned the repository waits for, measured on a fresh
copy of this tree (``git archive HEAD``) in a temporary folder:

1. ``scripts/setup.sh``, serving's setup, with no ``.venv`` there yet;
2. ``scripts/setup.sh`` again: what ``serve.sh`` adds on a set-up machine;
3. ``scripts/serve.sh`` with empty compile caches: seconds to ``/readyz``, then
   to the first answer of a chat completion (one short question);
4. the background compile the first start launches (auto compile, the CPU's
   default): seconds from ``/readyz`` until its log line says it finished;
5. a restart (SIGTERM, then ``serve.sh`` again, the caches now warm): seconds to
   ``/readyz``, and whether it started compiled (its log says which auto chose).

A truly fresh machine is not available here: pip's cache is warm (wheels
are not downloaded again), the Debian packages are installed, and the
embedded model is already converted in ``~/.cache/omni-gateway`` (its
conversion takes about 20 s). The compile caches are a folder of this run
(``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``), so the first start is cold.

    python -m bench.newcomer        # writes results/newcomer.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import httpx

from bench.procs import stop_group
from tests.redis_server import free_port

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent
QUESTION = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def timed(command: list[str], cwd: Path, log: Path) -> float:
    started = time.monotonic()
    with log.open("ab") as out:
        subprocess.run(command, cwd=cwd, check=True, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return round(time.monotonic() - started, 1)


def serve_until_ready(tree: Path, port: int, env: dict[str, str], log: Path,
                      timeout_sec: float = 900) -> tuple[subprocess.Popen[bytes], float]:
    started = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(["./scripts/serve.sh", "--host", "127.0.0.1", "--port", str(port)], cwd=tree,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    while time.monotonic() - started < timeout_sec:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return proc, round(time.monotonic() - started, 1)
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"not ready after {timeout_sec} s; see {log}")


#: serve's log lines: the background compile is done; which mode a start's auto chose.
COMPILE_FINISHED = "engine compile: the background compile finished"
COMPILE_FAILED = "engine compile: the background compile failed"
CHOSE_COMPILED = "engine compile: auto chose compiled"


def wait_for_line(log: Path, lines: tuple[str, ...], since: int, timeout_sec: float = 900) -> str:
    """The first of ``lines`` that ``log`` holds after its first ``since`` bytes."""
    deadline = time.monotonic() + timeout_sec
    while time.monotonic() < deadline:
        text = log.read_bytes()[since:].decode(errors="replace")
        for line in lines:
            if line in text:
                return line
        time.sleep(1)
    raise TimeoutError(f"none of {lines} in {log} after {timeout_sec} s")


def measure(folder: Path) -> dict:
    tree = folder / "omni-gateway"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    log = folder / "newcomer.log"
    out: dict = {"setup_sec": timed(["./scripts/setup.sh"], tree, log)}
    out["setup_again_sec"] = timed(["./scripts/setup.sh"], tree, log)
    env = os.environ | {"VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
                        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache")}
    port = free_port()
    proc, out["first_start_ready_sec"] = serve_until_ready(tree, port, env, log)
    asked = time.monotonic()
    try:
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=QUESTION, timeout=120)
        answer.raise_for_status()
        out["first_answer_sec"] = round(out["first_start_ready_sec"] + time.monotonic() - asked, 1)
        out["first_answer"] = answer.json()["choices"][0]["message"]["content"]
        # Stopped now, the first start would kill its background compile: the restart would be eager.
        if wait_for_line(log, (COMPILE_FINISHED, COMPILE_FAILED), since=0) == COMPILE_FAILED:
            raise RuntimeError(f"the background compile failed; see {log}")
        out["background_compile_sec"] = round(time.monotonic() - asked, 1)  # from ready, roughly
    finally:
        stop_group(proc, 60)
    restarted_at = log.stat().st_size
    proc, out["restart_ready_sec"] = serve_until_ready(tree, port, env, log)
    stop_group(proc, 60)
    out["restart_compiled"] = CHOSE_COMPILED in log.read_bytes()[restarted_at:].decode(errors="replace")
    out["fresh_machine_to_first_answer_sec"] = round(out["setup_sec"] + out["first_answer_sec"], 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="newcomer-") as folder:
        out = measure(Path(folder))
    print(json.dumps(out))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "newcomer.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = [("setup.sh, fresh .venv (pip cache warm, model converted)", out["setup_sec"]),
            ("setup.sh again (what serve.sh adds)", out["setup_again_sec"]),
            ("serve.sh to ready, compile caches empty", out["first_start_ready_sec"]),
            ("... to the first answer", out["first_answer_sec"]),
            ("fresh .venv to the first answer", out["fresh_machine_to_first_answer_sec"]),
            ("background compile, after ready (serving meanwhile)", out["background_compile_sec"]),
            (f"restart: serve.sh to ready ({'compiled' if out['restart_compiled'] else 'eager'})",
             out["restart_ready_sec"])]
    (args.results / "newcomer.md").write_text(
        "| step | seconds |\n|---|---|\n" + "".join(f"| {name} | {sec} |\n" for name, sec in rows))


if __name__ == "__main__":
    main()
