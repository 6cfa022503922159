"""What the gateway itself costs: append latency and throughput, relay, memory.

Generation is out of the way: the gateway runs as its own process on the
stamping engine of :mod:`bench.servers` (no inference), with a real
``redis-server``; load comes from this process over loopback.

- Appends: C concurrent sessions (``on_end_only``, never finished) append
  small text chunks, first each at a client's pace (one per 250 ms, the
  latency a client sees at that load), then back to back (the most appends
  per second the replica takes, and its CPU time per append).
- Relay: from the engine emitting a token (the stamp in its text) to the SSE
  client reading it, for 1, 20 and 200 sessions streaming at once (100
  tokens/s each), and the Redis commands each token cost (``INFO
  commandstats`` before and after: publishing, reading, and the sessions'
  own calls spread over their tokens).
- Memory per idle session: gateway RSS and Redis ``used_memory`` growth per
  session, minus the payload, for buffered (not started) sessions and for
  started ones (an engine session and its runner waiting for input), and the
  Redis client connections each kind adds.
- Floors, in the same run: a bare Redis round trip (PING), a bare HTTP
  request to the smallest ASGI app under the same uvicorn and client, and
  the relay's floor: the same stamped tokens streamed by the smallest ASGI
  app (``bare-relay``) to the same client, at 1, 20 and 200 sessions.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from bench.client import SessionClient, http_session
from bench.procs import rss_bytes, server
from bench.stats import summary
from tests.redis_server import free_port, redis_process

#: The sampling profiler, from the ``bench`` extra (a binary beside the interpreter).
PY_SPY = Path(sys.executable).parent / "py-spy"
#: A flat-out client refused (503 overloaded) waits this long before sending again.
REFUSED_PAUSE_SEC = 0.1
CHUNK_TEXT = "The quick brown fox jumps over the lazy dog; " * 2  # 90 bytes
#: Lift the per-identity limits: every simulated client shares one identity here.
GATEWAY_ENV = {"OMNI_GATEWAY_MAX_SESSIONS_PER_IDENTITY": "0", "OMNI_GATEWAY_RATE_LIMIT_RPS": "0",
               "OMNI_GATEWAY_MAX_OPEN_SESSIONS": "0", "OMNI_GATEWAY_MAX_ENGINE_SESSIONS": "5000",
               "OMNI_GATEWAY_SHUTDOWN_GRACE_SEC": "0", "OMNI_GATEWAY_DRAIN_SEC": "0",
               # One process unless a run says otherwise (``--workers``), so the
               # engine benchmarks stay comparable with earlier runs.
               "OMNI_GATEWAY_API_WORKERS": "0"}

#: The relay's "settled" lags leave out this much after every session streams (the start's backlog).
SETTLE_SEC = 1.0

#: The decode clock of the replica's shapes, whose hand-off is timed to the first token.
HANDOFF_TICK_SEC = 0.0005

#: Admission off (``gateway/web/middleware/admission.py``), for the parts that measure something else.
NO_SHEDDING = {"OMNI_GATEWAY_MAX_IN_FLIGHT_REQUESTS": "0", "OMNI_GATEWAY_MAX_LOOP_LAG_SEC": "0"}


@dataclass(frozen=True)
class OverheadConfig:
    concurrency: tuple[int, ...] = (1, 50, 200, 1000)
    seconds_per_level: float = 8.0
    #: Each load run starts with this much unmeasured (sessions starting their first appends).
    warmup_sec: float = 1.0
    #: Latency is measured with each session appending once per this period.
    pace_sec: float = 0.25
    relay_sessions: tuple[int, ...] = (1, 20, 200)
    relay_tokens: int = 100
    #: The relay at ``relay_rate_sessions`` sessions, each streaming at these
    #: tokens/s for ``relay_rate_seconds``: where the relay's P99 holds on this machine.
    relay_rates: tuple[int, ...] = (100, 50, 25, 15, 10, 5)
    relay_rate_sessions: int = 200
    relay_rate_seconds: float = 5.0
    idle_sessions: int = 1000
    started_sessions: int = 500
    floor_samples: int = 2000
    #: Run py-spy on the gateway during this concurrency level (0: no profile).
    profile_at: int = 200
    #: The replica's shapes compared (``--workers``: 0 is one process doing
    #: everything; N is N API workers beside the engine process).
    api_workers: tuple[int, ...] = (0, 1, 2)
    #: Concurrency levels run for each shape.
    workers_concurrency: tuple[int, ...] = (50, 200)
    #: The relay through each shape: these many sessions streaming at once (100 tokens/s each).
    workers_relay_sessions: tuple[int, ...] = (20, 200)
    workers_relay_tokens: int = 300
    #: Overload: each shape is offered this multiple of its own flat-out rate.
    overload_factor: float = 2.0
    overload_sessions: int = 200
    handoff_sessions: int = 20
    #: The wait before each memory reading: the runners settle into their blocking reads.
    memory_settle_sec: float = 2.0


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (a replica's API workers; they outlive no measurement)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").glob("*/children") for c in task.read_text().split()]
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in children)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def redis_rtt(url: str, samples: int) -> dict:
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
        took = []
        for _ in range(samples):
            started = time.perf_counter()
            await client.ping()
            took.append((time.perf_counter() - started) * 1000)
    finally:
        await client.aclose()
    return summary(took)


async def bare_http(url: str, samples: int) -> dict:
    async with http_session(1) as http:
        took = []
        for n in range(samples + 50):
            started = time.perf_counter()
            async with http.post(url, json={"sequence_id": n, "text": CHUNK_TEXT}) as response:
                await response.read()
            if n >= 50:  # the first requests warm the connection up
                took.append((time.perf_counter() - started) * 1000)
    return summary(took)


async def append_load(base_url: str, concurrency: int, config: OverheadConfig, pid: int,
                      profile_to: Path | None) -> dict:
    """One concurrency level: latency at a client's pace, then throughput flat out."""
    async with http_session(concurrency) as http:
        client = SessionClient(http, base_url)
        gate = asyncio.Semaphore(50)  # open the sessions at a steady pace, not in one burst

        async def create() -> str:
            async with gate:
                return await client.create(start_policy="on_end_only")

        sessions = await asyncio.gather(*(create() for _ in range(concurrency)))
        next_seq = dict.fromkeys(sessions, 0)
        paced = await drive(client, next_seq, config, config.pace_sec, pid, None)
        flat_out = await drive(client, next_seq, config, None, pid, profile_to)
        await asyncio.gather(*(client.delete(sid) for sid in sessions))
    return {"concurrency": concurrency,
            "append_p50_ms": paced["p50_ms"], "append_p99_ms": paced["p99_ms"],
            "paced_offered_per_s": round(concurrency / config.pace_sec), "paced_refused": paced["refused"],
            "appends_per_s": flat_out["per_s"], "flat_out_p50_ms": flat_out["p50_ms"],
            "flat_out_p99_ms": flat_out["p99_ms"], "refused": flat_out["refused"],
            "gateway_cpu_ms_per_append": flat_out["cpu_ms_each"]}


async def drive(client: SessionClient, next_seq: dict[str, int], config: OverheadConfig, pace_sec: float | None,
                pid: int, profile_to: Path | None) -> dict:
    """Append to every session for ``config.seconds_per_level`` after its ``warmup_sec``.

    ``pace_sec``: each session appends once per period (open loop, random
    phase), like a client streaming 250 ms of audio at a time; ``None``: each
    appends again as soon as the last one is answered (the most it can take).
    """
    latencies: list[float] = []
    refused: Counter[str] = Counter()
    seconds = config.seconds_per_level
    warmup_until = time.monotonic() + config.warmup_sec
    warmup_perf = time.perf_counter() + config.warmup_sec
    stop_at = warmup_until + seconds

    async def appender(sid: str) -> None:
        due = time.monotonic() + (random.uniform(0, pace_sec) if pace_sec else 0.0)
        while due < stop_at:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            started = time.perf_counter()
            try:
                await client.append(sid, next_seq[sid], CHUNK_TEXT)
            except RuntimeError as exc:  # an error answer: counted, not timed, sent again
                refused[str(exc).split(" {")[0] + " " + _code(str(exc))] += 1
                # At the next turn (paced), or after a pause as Retry-After asks: an
                # immediate resend would turn every refusal into a retry storm.
                await asyncio.sleep(pace_sec or REFUSED_PAUSE_SEC)
                due = time.monotonic()
                continue
            if started >= warmup_perf:
                latencies.append((time.perf_counter() - started) * 1000)
            next_seq[sid] += 1
            due = due + pace_sec if pace_sec else time.monotonic()

    tasks = [asyncio.create_task(appender(sid)) for sid in next_seq]
    await asyncio.sleep(max(0.0, warmup_until - time.monotonic()))
    cpu_before, count_before = tree_cpu_seconds(pid), len(latencies)
    profiler = None
    if profile_to is not None and PY_SPY.exists():
        profiler = await asyncio.create_subprocess_exec(
            str(PY_SPY), "record", "--pid", str(pid), "--duration", str(max(1, int(seconds) - 1)),
            "--format", "raw", "--output", str(profile_to), "--nonblocking", "--rate", "250",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await asyncio.gather(*tasks)
    cpu = tree_cpu_seconds(pid) - cpu_before
    if profiler is not None:
        await asyncio.wait_for(profiler.wait(), 60)
    stats = summary(latencies)
    return {"p50_ms": stats["p50"], "p99_ms": stats["p99"], "per_s": round(len(latencies) / seconds),
            "cpu_ms_each": round(cpu * 1000 / max(1, len(latencies) - count_before), 3),
            "refused": dict(refused)}


async def overload(base_url: str, sessions: int, offered_per_s: float, config: OverheadConfig) -> dict:
    """Open-loop appends at ``offered_per_s`` in all: the share refused and the latency of the accepted.

    Each session sends at its own steady pace whatever the answers (one call
    at a time: a session whose answer comes late sends its next chunk late,
    never in a burst); a refused chunk is sent again (same sequence id) at
    its next turn, as a client would.
    """
    pace = sessions / offered_per_s
    latencies: list[float] = []
    refused: Counter[str] = Counter()
    async with http_session(sessions) as http:
        client = SessionClient(http, base_url)
        gate = asyncio.Semaphore(50)

        async def create() -> str:
            async with gate:
                return await client.create(start_policy="on_end_only")

        ids = await asyncio.gather(*(create() for _ in range(sessions)))
        seconds = config.seconds_per_level
        warmup_perf = time.perf_counter() + config.warmup_sec
        stop_at = time.monotonic() + config.warmup_sec + seconds

        async def sender(sid: str) -> None:
            seq, due = 0, time.monotonic() + random.uniform(0, pace)
            while due < stop_at:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                due = max(due + pace, time.monotonic())
                started = time.perf_counter()
                try:
                    await client.append(sid, seq, CHUNK_TEXT)
                except RuntimeError as exc:
                    if started >= warmup_perf:
                        refused[str(exc).split(" {")[0] + " " + _code(str(exc))] += 1
                    continue
                seq += 1
                if started >= warmup_perf:
                    latencies.append((time.perf_counter() - started) * 1000)

        await asyncio.gather(*(sender(sid) for sid in ids))
        await asyncio.gather(*(client.delete(sid) for sid in ids))
    answered = len(latencies) + sum(refused.values())
    stats = summary(latencies)
    return {"sessions": sessions, "offered_per_s": round(offered_per_s), "accepted_per_s": round(len(latencies) / seconds),
            "refused": dict(refused), "refused_share": round(sum(refused.values()) / max(1, answered), 3),
            "accepted_p50_ms": stats["p50"], "accepted_p99_ms": stats["p99"]}


def _code(message: str) -> str:
    """The envelope's code in a refusal the client reported."""
    return message.split("'code': '")[1].split("'")[0] if "'code': '" in message else "?"


async def handoff(base_url: str, sessions: int) -> list[float]:
    """Client sends the chunk that starts the work -> the engine emits its first token, in ms.

    Through API workers this includes the hand-off to the engine process
    (the announcement, its tender's claim, the runner's start).
    """
    async with http_session(sessions * 2) as http:
        client = SessionClient(http, base_url)

        async def one() -> float:
            sid = await client.create(start_policy="on_first_chunk", max_tokens=1)
            first: list[int] = []

            async def read() -> None:
                async for _, text in client.content_deltas(sid):
                    first.extend(int(stamp) for stamp in text.split())

            reader = asyncio.create_task(read())
            await asyncio.sleep(0.05)  # subscribed before the work starts
            sent = time.time_ns()
            await client.append(sid, 0, "go", end=True)
            await reader
            # The engine's first token is due at the first tick of its clock after it
            # started: up to HANDOFF_TICK_SEC late (the shapes' servers tick that fast).
            return (first[0] - sent) / 1e6

        lags = []
        for _ in range(sessions):  # one at a time: the hand-off, not a queue
            lags.append(await one())
        return lags


async def command_calls(rdb: aioredis.Redis) -> Counter[str]:
    """Redis's count of calls per command since it started."""
    stats = await rdb.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})


async def relay_with_calls(base_url: str, redis_url: str, pid: int, sessions: int, tokens: int) -> dict:
    """``relay_lags``, and the Redis commands per token the relay took."""
    rdb = aioredis.Redis.from_url(redis_url)
    try:
        before = await command_calls(rdb)
        result = await relay_lags(base_url, pid, sessions, tokens)
        calls = await command_calls(rdb) - before
    finally:
        await rdb.aclose()
    calls["info"] -= 1  # our own look at the counts
    tokens = max(1, result["tokens"])
    # Commands run inside scripts count too (hget, xadd, ...): the calls the
    # gateway makes are the script calls (publish.lua among them) and the reads.
    return result | {"script_calls_per_token": round(calls["evalsha"] / tokens, 3),
                     "xread_per_token": round(calls["xread"] / tokens, 3),
                     "commands_per_token": {name: round(n / tokens, 3) for name, n in calls.most_common() if n > 0}}


async def relay_lags(base_url: str, pid: int, sessions: int, tokens: int) -> dict:
    """The relay's lags and the server's CPU per token; ``all_streaming``: the lags while every
    session streamed at once (``once_all_streaming``); ``settled``: the same from ``SETTLE_SEC``
    later (None for runs shorter than that)."""
    cpu_before, started = tree_cpu_seconds(pid), time.monotonic()
    streams = await stamped_relay(base_url, sessions, tokens)
    cpu, took = tree_cpu_seconds(pid) - cpu_before, time.monotonic() - started
    lags = [lag for stream in streams for _, lag in stream]
    steady, settled = once_all_streaming(streams), once_all_streaming(streams, SETTLE_SEC)
    return {"sessions": sessions, **summary(lags), "tokens": len(lags), "seconds": round(took, 2),
            "all_streaming": summary(steady) if steady else None,
            "settled": summary(settled) if settled else None,
            "gateway_cpu_ms_per_token": round(cpu * 1000 / max(1, len(lags)), 3)}


async def relay(base_url: str, sessions: int, tokens: int) -> list[float]:
    """Engine stamp -> SSE client read, in ms, for every token of ``sessions`` streaming at once."""
    return [lag for stream in await stamped_relay(base_url, sessions, tokens) for _, lag in stream]


async def stamped_relay(base_url: str, sessions: int, tokens: int) -> list[list[tuple[int, float]]]:
    """Per session, each token's (engine stamp in ns, stamp -> SSE client read in ms)."""
    async with http_session(sessions * 2) as http:
        client = SessionClient(http, base_url, patient=True)

        async def one() -> list[tuple[int, float]]:
            sid = await client.create(start_policy="on_first_chunk", max_tokens=tokens)

            async def read() -> list[tuple[int, float]]:
                lags = []
                async for _, text in client.content_deltas(sid):
                    now = time.time_ns()
                    lags.extend((int(stamp), (now - int(stamp)) / 1e6) for stamp in text.split())
                return lags

            reader = asyncio.create_task(read())
            await client.append(sid, 0, "go", end=True)
            return await reader

        return list(await asyncio.gather(*(one() for _ in range(sessions))))


def once_all_streaming(streams: list[list[tuple[int, float]]], settle_sec: float = 0.0) -> list[float]:
    """The lags of tokens emitted once every session had emitted its first (and before the first
    ended): all of them streaming at once, without the burst of session starts.

    ``settle_sec`` leaves out that much more after the last first token: the
    backlog the start burst left (200 sessions opened at once) takes about
    half a second to clear at 100 tokens/s each.
    """
    started = max(stream[0][0] for stream in streams if stream) + int(settle_sec * 1e9)
    ending = min(stream[-1][0] for stream in streams if stream)
    return [lag for stream in streams for stamp, lag in stream if started < stamp <= ending]


async def relay_floor(port: int, config: OverheadConfig, logs: Path) -> list[dict]:
    """The relay through nothing but uvicorn (``bare-relay``): 1, 20 and 200 sessions at the
    rate table's highest rate, as long as its runs (so the 200 sessions have a settled part)."""
    rate = max(config.relay_rates)
    with server(["bench.servers", "bare-relay", "--port", str(port), "--token-interval", str(1 / rate)], port=port,
                env={}, log=logs / "bare-relay.log", ready_path="/") as proc:
        return [{"tokens_per_s_each": rate, **await relay_lags(f"http://127.0.0.1:{port}", proc.pid, sessions,
                                                              round(rate * config.relay_rate_seconds))}
                for sessions in config.relay_sessions]


async def memory_per_session(base_url: str, redis_url: str, pid: int, counts: dict[str, int],
                             settle_sec: float = 2.0) -> list[dict]:
    """Gateway RSS and Redis growth per session, for each start policy in ``counts``.

    A warm-up round first (allocator arenas, lazily built code paths), and
    every measured session stays open until all are measured: deleting
    sessions between rounds would return memory in the middle of the next one.
    """
    rdb = aioredis.Redis.from_url(redis_url)
    results, ids = [], []
    async with http_session(50) as http:
        client = SessionClient(http, base_url, patient=True)
        gate = asyncio.Semaphore(50)

        async def one(policy: str) -> str:
            async with gate:
                sid = await client.create(start_policy=policy)
                await client.append(sid, 0, CHUNK_TEXT)
                return sid

        async def used_memory() -> int:
            return (await rdb.info("memory"))["used_memory"]

        async def connections() -> int:
            return int((await rdb.info("clients"))["connected_clients"])

        # As many at once as the measured rounds open (the gate), so the Redis
        # connection pool has grown to that concurrency before anything is measured.
        warmup = await asyncio.gather(*(one(p) for p in counts for _ in range(100)))
        await asyncio.gather(*(client.delete(sid) for sid in warmup))
        for policy, sessions in counts.items():
            await asyncio.sleep(settle_sec)  # runners settle into their blocking reads
            rss_before, redis_before, clients_before = rss_bytes(pid), await used_memory(), await connections()
            ids += await asyncio.gather(*(one(policy) for _ in range(sessions)))
            await asyncio.sleep(settle_sec)
            rss_after, redis_after, clients_after = rss_bytes(pid), await used_memory(), await connections()
            results.append({"policy": policy, "sessions": sessions, "payload_bytes": len(CHUNK_TEXT),
                            "gateway_bytes": round((rss_after - rss_before) / sessions),
                            "redis_bytes": round((redis_after - redis_before) / sessions - len(CHUNK_TEXT)),
                            "redis_connections_added": clients_after - clients_before})
        await asyncio.gather(*(client.delete(sid) for sid in ids))
    await rdb.aclose()
    return results


def time_by_package(raw_profile: Path) -> list[tuple[str, float]]:
    """py-spy's folded stacks -> % of samples whose innermost frame is in each package.

    Self time by package says which layer burns the CPU (the HTTP server,
    the framework, the Redis client, our code) better than any one function.
    """
    by_package: Counter[str] = Counter()
    total = 0
    for line in raw_profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        # A frame reads "function (path/to/module.py:line)"; the package is the path's first part.
        path = leaf.rpartition("(")[2].split(":")[0]
        by_package[path.split("/")[0] if "/" in path else path.removesuffix(".py") or "?"] += int(count)
        total += int(count)
    return [(package, round(100 * n / total, 1)) for package, n in by_package.most_common(12)]


async def measure(config: OverheadConfig, results_dir: Path, log: Callable[[str], object] = print) -> dict:
    out: dict = {"config": config.__dict__ | {"concurrency": list(config.concurrency),
                                              "relay_sessions": list(config.relay_sessions),
                                              "relay_rates": list(config.relay_rates)}}
    with redis_process() as redis, tempfile.TemporaryDirectory() as tmp:
        bare_port, gw_port = free_port(), free_port()
        with server(["bench.servers", "bare", "--port", str(bare_port)], port=bare_port, env={},
                    log=Path(tmp) / "bare.log", ready_path="/"):
            out["redis_rtt_ms"] = await redis_rtt(redis.url, config.floor_samples)
            out["bare_http_ms"] = await bare_http(f"http://127.0.0.1:{bare_port}/", config.floor_samples)
        log(f"floors: redis {out['redis_rtt_ms']['p50']} ms, http {out['bare_http_ms']['p50']} ms")
        out["relay_floor"] = await relay_floor(bare_port, config, Path(tmp))
        log(f"relay floor: {out['relay_floor']}")
        env = GATEWAY_ENV | {"OMNI_GATEWAY_REDIS_URL": redis.url}
        with server(["bench.servers", "stamp", "--port", str(gw_port)], port=gw_port, env=env,
                    log=Path(tmp) / "gateway.log", ready_path="/readyz") as proc:
            base = f"http://127.0.0.1:{gw_port}"
            out["overhead"] = []
            for concurrency in config.concurrency:
                profile = results_dir / "overhead_profile.raw" if concurrency == config.profile_at else None
                level = await append_load(base, concurrency, config, proc.pid, profile)
                log(f"appends x{concurrency}: {level}")
                out["overhead"].append(level)
                if profile is not None and profile.exists():
                    out["profile_at"] = concurrency
                    out["profile_top"] = time_by_package(profile)
        # The relay is measured on a gateway that sheds nothing: 200 sessions at
        # 100 tokens/s are more than this machine serves, and refused streams
        # would measure the shedding (the overload part below does that).
        with server(["bench.servers", "stamp", "--port", str(gw_port)], port=gw_port, env=env | NO_SHEDDING,
                    log=Path(tmp) / "gateway-relay.log", ready_path="/readyz") as proc:
            base = f"http://127.0.0.1:{gw_port}"
            out["relay"] = []
            for sessions in config.relay_sessions:
                out["relay"].append(await relay_with_calls(base, redis.url, proc.pid, sessions,
                                                             config.relay_tokens))
                log(f"relay x{sessions}: {out['relay'][-1]}")

        out["relay_rates"] = []
        for rate in config.relay_rates:
            interval = ["--token-interval", str(1 / rate)]
            with server(["bench.servers", "stamp", "--port", str(gw_port), *interval], port=gw_port,
                        env=env | NO_SHEDDING, log=Path(tmp) / f"gateway-relay-{rate}.log",
                        ready_path="/readyz") as proc:
                level = await relay_with_calls(f"http://127.0.0.1:{gw_port}", redis.url, proc.pid,
                                               config.relay_rate_sessions, round(rate * config.relay_rate_seconds))
                level = {"tokens_per_s_each": rate, "offered_tokens_per_s": rate * config.relay_rate_sessions,
                         "delivered_tokens_per_s": round(level["tokens"] / level["seconds"]), **level}
                out["relay_rates"].append(level)
                log(f"relay x{config.relay_rate_sessions} at {rate} tokens/s: {level}")

        out["workers"] = []
        for workers in config.api_workers:
            shape_args = ["--workers", str(workers), "--engine-port", str(free_port()),
                          "--token-interval", str(HANDOFF_TICK_SEC)]
            with server(["bench.servers", "stamp", "--port", str(gw_port), *shape_args], port=gw_port,
                        env=env, log=Path(tmp) / f"gateway-workers-{workers}.log", ready_path="/readyz") as proc:
                base = f"http://127.0.0.1:{gw_port}"
                shape: dict = {"api_workers": workers, "levels": []}
                for concurrency in config.workers_concurrency:
                    shape["levels"].append(await append_load(base, concurrency, config, proc.pid, None))
                capacity = max(level["appends_per_s"] for level in shape["levels"])
                # At least one a second: on a starved machine the quick mode's half-second level
                # may see no append answered (CI: the sidecar's three processes start beside it).
                shape["overload"] = await overload(base, config.overload_sessions,
                                                   max(1.0, capacity * config.overload_factor), config)
                shape["handoff_ms"] = summary(await handoff(base, config.handoff_sessions))
            # The relay through the shape (SSE served by the workers, runners in the engine
            # process), on a gateway that sheds nothing, as for the relay above.
            relay_args = ["--workers", str(workers), "--engine-port", str(free_port())]
            with server(["bench.servers", "stamp", "--port", str(gw_port), *relay_args], port=gw_port,
                        env=env | NO_SHEDDING, log=Path(tmp) / f"gateway-workers-{workers}-relay.log",
                        ready_path="/readyz") as proc:
                shape["relay"] = [await relay_with_calls(f"http://127.0.0.1:{gw_port}", redis.url, proc.pid,
                                                         sessions, config.workers_relay_tokens)
                                  for sessions in config.workers_relay_sessions]
            log(f"workers {workers}: {shape}")
            out["workers"].append(shape)

        # A fresh gateway for memory: after the load above its allocator holds
        # freed memory that new sessions would reuse unseen.
        with server(["bench.servers", "stamp", "--port", str(gw_port)], port=gw_port, env=env,
                    log=Path(tmp) / "gateway-memory.log", ready_path="/readyz") as proc:
            out["memory"] = await memory_per_session(
                f"http://127.0.0.1:{gw_port}", redis.url, proc.pid,
                {"on_end_only": config.idle_sessions, "on_first_chunk": config.started_sessions},
                config.memory_settle_sec)
            log(f"memory: {out['memory']}")
    return out
