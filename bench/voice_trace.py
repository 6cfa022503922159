"""Where the time goes between the end of spoken input and the first audio: stage timestamps of one run.

``bench/voice.py`` measures the whole span from the client; this one says
which stage spends it. The gateway runs as ``bench/voice.py`` runs it (its
embedded default on a real Redis, one process), started through
``python -m bench.voice_trace serve``, which wraps a few methods of the voice
path to write a timestamp (``time.monotonic``, one clock for every process
of the machine) per stage and session to a JSON-lines file before serving.
Nothing of the shipped code changes. The client sends spoken questions as
``bench/voice.py`` does (1 voice, then 4 at once beside 20 text sessions,
with py-spy on the gateway for the 4-voice rounds) and adds its own marks:
the last chunk's acknowledgement and the first ``delta.audio`` frame read.

    python -m bench.voice_trace                 # writes results/voice_trace.{json,md}
    python -m bench.voice_trace --turns 4 --crowds 1

The report gives, per case, the median time of each stage's first mark
after the end of input (the acknowledgement) and, per stage, the median
time from the mark before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import GATEWAY_ENV, PY_SPY
from bench.procs import server, write_results
from bench.relay_ab import top_functions
from bench.voice import QUESTIONS, TEXTERS, Refusals, spoken, spoken_turn, texter

RESULTS = Path(__file__).parent / "results"
TRACE_ENV = "OMNI_GATEWAY_BENCH_VOICE_TRACE"

# --- the gateway's side: probes ------------------------------------------------------------

_session: contextvars.ContextVar[str] = contextvars.ContextVar("bench_session", default="")
_lock = threading.Lock()
_out: Any = None


def mark(session: str, what: str, **extra: Any) -> None:
    line = json.dumps({"t": time.monotonic(), "sid": session, "what": what, **extra})
    with _lock:
        _out.write(line + "\n")
        _out.flush()


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def install_probes(path: Path) -> None:
    """Timestamps at each stage of the voice path (see the module docstring)."""
    global _out
    _out = path.open("a", buffering=1)

    from gateway.store.redis_store import SessionStore
    from gateway.work.runner import SessionRunner
    from omni_adapter.listener import ListeningSession
    from omni_adapter.talker import HibariTalker
    from omni_adapter.vllm_engine import VllmSession

    def run_engine_session(original: Callable[..., Any]) -> Callable[..., Any]:
        async def probe(self: SessionRunner, attempt: int) -> Any:
            _session.set(self.session_id)  # the runner's tasks (feed, relay, Talker) inherit it
            return await original(self, attempt)
        return probe

    def apply(original: Callable[..., Any]) -> Callable[..., Any]:
        async def probe(self: SessionRunner, session: Any, events: Any, timing: Any) -> Any:
            if any(e.kind == "end" for e in events):
                mark(self.session_id, "runner reads the end")
            return await original(self, session, events, timing)
        return probe

    def listening_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def probe(self: ListeningSession, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            self._bench_sid = _session.get()  # type: ignore[attr-defined]
        return probe

    def in_thread(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def probe(self: ListeningSession, *args: Any) -> Any:
                sid = getattr(self, "_bench_sid", "")
                mark(sid, f"{what} starts")
                result = original(self, *args)
                # ``_hear`` also returns the open phrase so far (a guess's input) since issue 28's drafts.
                mark(sid, f"{what} ends", words=result[0] if isinstance(result, tuple) else result)
                return result
            return probe
        return make

    def thinker_call(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            async def probe(self: VllmSession, *args: Any) -> Any:
                mark(_session.get(), f"thinker {what} starts")
                result = await original(self, *args)
                mark(_session.get(), f"thinker {what} ends")
                return result
            return probe
        return make

    def step(original: Callable[..., Any]) -> Callable[..., Any]:
        def probe(self: VllmSession, step: Any) -> None:
            mark(_session.get(), f"thinker step {step.value}")
            original(self, step)
        return probe

    def on_output(original: Callable[..., Any]) -> Callable[..., Any]:
        async def probe(self: VllmSession, output: Any) -> None:
            text = output.outputs[0].text if output.outputs else ""
            mark(_session.get(), "thinker token", text=text)
            await original(self, output)
        return probe

    def speak(original: Callable[..., Any]) -> Callable[..., Any]:
        async def probe(self: HibariTalker, text: str) -> bytes:
            sid = _session.get()
            mark(sid, "talker phrase queued", text=text)

            def synthesize() -> bytes:
                mark(sid, "talker synthesis starts")
                pcm = self._synthesize(text)
                mark(sid, "talker synthesis ends", audio_sec=len(pcm) / 2 / self.sample_rate)
                return pcm
            return await asyncio.get_running_loop().run_in_executor(self._executor, synthesize)
        return probe

    def publish(original: Callable[..., Any]) -> Callable[..., Any]:
        async def probe(self: SessionStore, session_id: str, lease: Any, first: int, out: Any, *rest: Any) -> Any:
            audio = any('"audio"' in data for _, data, _ in out)
            if audio:
                mark(session_id, "relay publishes audio")
            result = await original(self, session_id, lease, first, out, *rest)
            if audio:
                mark(session_id, "relay published audio")
            return result
        return probe

    _wrap(SessionRunner, "_run_engine_session", run_engine_session)
    _wrap(SessionRunner, "_apply", apply)
    _wrap(ListeningSession, "__init__", listening_init)
    _wrap(ListeningSession, "_hear", in_thread("listener hears a chunk"))
    _wrap(ListeningSession, "_end_phrase", in_thread("listener ends the open phrase"))
    _wrap(VllmSession, "feed", thinker_call("feed"))
    _wrap(VllmSession, "end_input", thinker_call("end_input"))
    _wrap(VllmSession, "_step", step)
    _wrap(VllmSession, "_on_output", on_output)
    _wrap(HibariTalker, "speak", speak)
    _wrap(SessionStore, "publish", publish)


def serve(argv: list[str]) -> None:
    install_probes(Path(os.environ[TRACE_ENV]))
    from gateway.runtime.cli import main as cli

    cli(["serve", *argv])


# --- the client's side -------------------------------------------------------------------

async def traced_turn(client: httpx.AsyncClient, audio: bytes, first: str, refusals: Refusals,
                      marks: list[dict]) -> None:
    """One spoken question as ``bench/voice.py`` sends it, with the client's marks."""
    turn = await spoken_turn(client, audio, first, refusals, clock=time.monotonic)
    if turn is not None:
        sid, acked, sound_at = turn
        marks += [{"t": acked, "sid": sid, "what": "client: end of input acknowledged"},
                  {"t": sound_at, "sid": sid, "what": "client: first audio read"}]


def cpu_ticks() -> tuple[dict[int, tuple[int, str, int]], int, int]:
    """Every process's (parent, name, CPU ticks so far), and the machine's busy and total ticks."""
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        procs[int(stat.parent.name)] = (int(fields[1]), name, int(fields[11]) + int(fields[12]))
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = cpu[3] + cpu[4]
    return procs, sum(cpu) - idle, sum(cpu)


def cpu_shares(before: tuple, after: tuple, gateway: int, redis: int | None, seconds: float) -> dict[str, float]:
    """Cores used over ``seconds`` by the gateway, its engine process(es), Redis, this client and the
    rest of the machine (other work on a shared machine), and the machine's busy share."""
    (procs0, busy0, total0), (procs1, busy1, total1) = before, after
    hz = os.sysconf("SC_CLK_TCK")

    def part(pid: int) -> str:
        if pid == gateway:
            return "gateway process"
        if pid == redis:
            return "redis"
        if pid == os.getpid():
            return "load client (this process)"
        seen = set()
        while pid in procs1 and pid not in seen:
            seen.add(pid)
            pid = procs1[pid][0]
            if pid == gateway:
                return "engine process(es)"
        return "everything else on the machine"

    used: dict[str, float] = defaultdict(float)
    for pid, (_, _, ticks) in procs1.items():
        used[part(pid)] += (ticks - procs0.get(pid, (0, "", 0))[2]) / hz / seconds
    cores = os.cpu_count() or 1
    return {**{k: round(v, 2) for k, v in sorted(used.items())},
            "machine busy (cores)": round((busy1 - busy0) / max(1, total1 - total0) * cores, 2)}


def by_thread(folded: Path) -> list[tuple[str, float]]:
    """py-spy's samples (with ``--threads``) by process and thread, in % of all samples."""
    counts: dict[str, int] = defaultdict(int)
    for line in folded.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = stack.split(";")
        where = [f for f in frames[:2] if f.startswith(("process ", "thread "))]
        name = " / ".join(f.split(":")[0] if f.startswith("process ") else f for f in where)
        counts[name] += int(samples)
    total = sum(counts.values()) or 1
    return [(name, round(100 * n / total, 1)) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:20]]


def averaged(tables: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    """Shares of several profiles, averaged (a name missing from one counts 0 there)."""
    merged: dict[str, float] = defaultdict(float)
    for table in tables:
        for name, share in table:
            merged[name] += share / len(tables)
    return sorted(((name, round(share, 1)) for name, share in merged.items()), key=lambda kv: -kv[1])


def timelines(trace: list[dict]) -> dict[str, list[tuple[float, str, dict]]]:
    """Per session: (seconds after the end of input's acknowledgement, stage, extra) of the answer's stages.

    Each stage counts once: its first mark from the runner reading the end
    on (which may come before the acknowledgement reaches the client: a
    negative time); the hearing of earlier chunks is left out.
    """
    by_session: dict[str, list[dict]] = defaultdict(list)
    for m in trace:
        by_session[m["sid"]].append(m)
    out = {}
    for sid, marks in by_session.items():
        acked = [m["t"] for m in marks if m["what"] == "client: end of input acknowledged"]
        if not acked or not any(m["what"] == "client: first audio read" for m in marks):
            continue
        end_read = min((m["t"] for m in marks if m["what"] == "runner reads the end"), default=acked[0])
        since = min(end_read, acked[0])
        seen: set[str] = set()
        line = []
        for m in sorted(marks, key=lambda m: m["t"]):
            if m["t"] < since or m["what"] in seen:
                continue
            seen.add(m["what"])
            line.append((round(m["t"] - acked[0], 3), m["what"],
                         {k: v for k, v in m.items() if k not in ("t", "sid", "what")}))
        out[sid] = line
    return out


def stage_medians(lines: list[list[tuple[float, str, dict]]]) -> list[dict]:
    """Per stage: in how many turns it came, the median time after the acknowledgement, and the
    median time from the stage before it (in each turn's own order)."""
    at: dict[str, list[float]] = defaultdict(list)
    gap: dict[str, list[float]] = defaultdict(list)
    order: dict[str, list[int]] = defaultdict(list)
    for line in lines:
        for i, (t, what, _) in enumerate(line):
            at[what].append(t)
            order[what].append(i)
            if i:
                gap[what].append(t - line[i - 1][0])
    stages = sorted(at, key=lambda w: statistics.median(at[w]))
    return [{"stage": w, "n": len(at[w]), "median_sec": round(statistics.median(at[w]), 3),
             "median_from_previous_sec": round(statistics.median(gap[w]), 3) if gap[w] else None}
            for w in stages]


async def measure(url: str, turns: int, crowds: int, gateway_pid: int, redis_pid: int | None,
                  profile_dir: Path) -> dict:
    audio = {q: spoken(q, 200) for q in QUESTIONS}
    marks: list[dict] = []
    sessions: dict[str, list[str]] = {"1 voice": [], "4 voices + 20 text sessions": []}
    refusals = Refusals()
    profiles = []
    cpu: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await traced_turn(client, audio[QUESTIONS[0]], "short", Refusals(), [])  # warm-up
        for n in range(turns):
            before = len(marks)
            await traced_turn(client, audio[QUESTIONS[n % len(QUESTIONS)]], "short", Refusals(), marks)
            sessions["1 voice"] += [m["sid"] for m in marks[before:before + 1]]
        for n in range(crowds):
            before = len(marks)
            into = profile_dir / f"crowd-{n}.folded"
            spy = await asyncio.create_subprocess_exec(
                str(PY_SPY), "record", "--pid", str(gateway_pid), "--duration", "8", "--format", "raw",
                "--output", str(into), "--nonblocking", "--rate", "100", "--threads", "--subprocesses",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            ticks, started = cpu_ticks(), time.monotonic()
            await asyncio.gather(*(traced_turn(client, audio[q], "short", refusals, marks) for q in QUESTIONS[:4]),
                                 *(texter(client, i, refusals) for i in range(TEXTERS)))
            cpu.append(cpu_shares(ticks, cpu_ticks(), gateway_pid, redis_pid, time.monotonic() - started))
            await spy.wait()
            sessions["4 voices + 20 text sessions"] += sorted({m["sid"] for m in marks[before:]})
            if into.exists():
                profiles.append(into)
    return {"marks": marks, "sessions": sessions, "refused_appends": len(refusals.refused),
            "profiles": [str(p) for p in profiles], "cpu_during_crowds": cpu}


def report(result: dict) -> str:
    lines = ["# Voice: where the time goes from the end of input to the first audio", ""]
    for case, rows in result["stages"].items():
        lines += [f"## {case} ({result['turns'][case]} turns; seconds after the end of input's acknowledgement)", "",
                  "| stage | n | median (s) | median from the stage before (s) |", "|---|---|---|---|"]
        lines += [f"| {r['stage']} | {r['n']} | {r['median_sec']} | {r['median_from_previous_sec']} |" for r in rows]
        lines.append("")
    if result.get("cpu_during_crowds"):
        lines += ["## Cores used during each 4-voice round (2 cores on this machine)", "",
                  "| round | " + " | ".join(result["cpu_during_crowds"][0]) + " |",
                  "|---|" + "---|" * len(result["cpu_during_crowds"][0])]
        lines += [f"| {i} | " + " | ".join(str(v) for v in row.values()) + " |"
                  for i, row in enumerate(result["cpu_during_crowds"])]
        lines.append("")
    if result.get("profile_threads"):
        lines += ["## py-spy on the gateway and its engine process during the 4-voice rounds: samples by thread", "",
                  "| process / thread | % of samples |", "|---|---|"]
        lines += [f"| {name} | {share} |" for name, share in result["profile_threads"]]
        lines.append("")
    if result.get("profile_top"):
        lines += ["## The same samples by function (self time, % of samples)", "",
                  "| function | % |", "|---|---|"]
        lines += [f"| `{name}` | {share} |" for name, share in result["profile_top"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
        return
    from tests.redis_server import free_port, redis_process

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10, help="single-voice turns")
    parser.add_argument("--crowds", type=int, default=2, help="rounds of 4 voices beside 20 text sessions")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--name", default="voice_trace")
    args = parser.parse_args(argv)
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.jsonl"
        port = free_port()
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url, TRACE_ENV: str(trace_path)}
        with server(["bench.voice_trace", "serve", "--host", "127.0.0.1", "--port", str(port)], port=port, env=env,
                    log=Path(tmp) / "gateway.log", ready_path="/readyz") as proc:
            run = asyncio.run(measure(f"http://127.0.0.1:{port}", args.turns, args.crowds, proc.pid,
                                      redis.pid, Path(tmp)))
        trace = [json.loads(line) for line in trace_path.read_text().splitlines()] + run["marks"]
        profiles = [Path(p) for p in run["profiles"]]
        top = averaged([top_functions(p, 40) for p in profiles])[:30]
        threads = averaged([by_thread(p) for p in profiles])
    per_session = timelines(trace)
    stages = {case: stage_medians([per_session[s] for s in sids if s in per_session])
              for case, sids in run["sessions"].items()}
    result = {"stages": stages, "turns": {case: sum(s in per_session for s in sids)
                                          for case, sids in run["sessions"].items()},
              "refused_appends": run["refused_appends"], "cpu_during_crowds": run["cpu_during_crowds"],
              "profile_top": top, "profile_threads": threads,
              "timelines": per_session}
    write_results(args.results, args.name, result, report(result))


if __name__ == "__main__":
    main()
