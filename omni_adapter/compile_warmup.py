"""Auto compile on the CPU: eager until this configuration's compile cache is warm, compiled after.

Neither mode alone meets issue #31's goals on the CPU (bench/README.md, "Engine
start"): eager starts in ~20 s but decodes ~21 % slower; compiled decodes fast
and restarts in ~25 s from vLLM's AOT compile cache, but its first start
compiles for ~2 min. So with ``compile`` unset (``OMNI_GATEWAY_ENGINE_COMPILE``),
the CPU engine starts

- **compiled** when our marker says this exact configuration's cache is warm
  and the AOT file the warm-up produced is still there;
- **eager** otherwise, and once it is ready one background process, niced to 19,
  starts the same configuration compiled (vLLM saves the compiled model under
  ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/rank_*/model``),
  writes the marker and exits. The next start is compiled.

The marker lives under ``VLLM_CACHE_ROOT/omni-gateway/compile-warm/<key>.json``.
The key hashes what vLLM's own AOT key is made of (``vllm.compilation.caching
.aot_compile_hash_factors`` and ``decorators._model_hash_key``): the engine
arguments in their compiled form, the vLLM and torch versions, the model's
``config.json``, vLLM's environment factors (``envs.compile_factors()``,
hashed as vLLM hashes them) and Inductor's config. The warm-up starts in the
environment the serving engine started in, not the one vLLM left behind (see
``_start_vllm``). vLLM's key cannot be computed here without
building its config, so ours stands beside it; should the two ever disagree
(a factor we do not hash changed), the compiled start simply compiles cold
once, ~2 min, and vLLM saves the result: slow once, never wrong. The other way
round (our key new, vLLM's cache already warm: a compiled start before, or a
renamed served model), the warm-up's engine loads vLLM's file and writes none.
Either way the marker names the file vLLM's log says it saved or loaded: the
warm-up's log is its own, so two configurations compiling at once on one
machine each record their own file.

One warm-up per machine and key: the launcher takes a non-blocking ``flock`` on
``<key>.lock`` and hands the locked file to the warm-up, which holds it until it
exits; a process that cannot take it starts none. The warm-up dies with the
process that launched it (``omni-gateway-child``: ``PR_SET_PDEATHSIG``), and
vLLM writes its AOT file atomically (a temporary file, then ``os.replace``), so
a killed warm-up leaves no broken cache, only no marker.

``VLLM_CPU_KVCACHE_SPACE`` is not one of vLLM's compile factors (``envs.compile_factors``
ignores it; the cache config's hash ignores ``kv_cache_memory_bytes``), yet the
warm-up takes the serving engine's KV space anyway: whether a compiled graph bakes
in the KV tensors' shapes was not checked, and a loaded graph's guards are off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from omni_adapter.process_lifetime import CHILD_LAUNCHER

logger = logging.getLogger(__name__)

#: The warm-up's CPU weight: it takes what serving leaves (nice 19 against 0: ~1.5 %).
WARMUP_NICENESS = 19
_MARKERS = Path("omni-gateway", "compile-warm")
#: vLLM's lines naming its AOT model file: the one it saved after compiling, or the one it
#: loaded instead of compiling (decorators.py). The warm-up's log is its own (one per key,
#: under the lock), so the last one named is this warm-up's file, whatever else compiles.
_AOT_FILE = re.compile(r"(?:saved AOT compiled function to|Directly load AOT compilation from path) (\S+)")
#: Lines of the warm-up's log quoted when it fails.
_FAILURE_LINES = 5


def vllm_cache_root() -> Path:
    """vLLM's ``VLLM_CACHE_ROOT``, as vLLM resolves it."""
    import vllm.envs

    return Path(vllm.envs.VLLM_CACHE_ROOT)


def compile_key(engine_args: Mapping[str, Any], model: str) -> str:
    """Names one configuration's compile cache: changes with anything vLLM's AOT key changes with
    that we can see before vLLM builds its config. ``engine_args``: the compiled form (JSON-able)."""
    import torch
    import vllm
    import vllm.envs
    from torch._inductor import config as inductor_config
    from vllm.config.utils import hash_factors

    config_json = Path(model, "config.json")
    factors = {
        "engine_args": dict(engine_args),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model_config": hashlib.sha256(config_json.read_bytes()).hexdigest() if config_json.exists() else None,
        "vllm_env": hash_factors(vllm.envs.compile_factors()),
        # vLLM's key has Inductor's config too (VLLM_USE_MEGA_AOT_ARTIFACT: get_inductor_factors),
        # which torch reads from TORCHINDUCTOR_* at its import.
        "inductor": inductor_config.save_config_portable() if vllm.envs.VLLM_USE_MEGA_AOT_ARTIFACT else None,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CompileCache:
    """One configuration's place in the compile cache: its marker, lock and warm-up log."""

    root: Path
    key: str

    @property
    def marker(self) -> Path:
        return self.root / _MARKERS / f"{self.key}.json"

    @property
    def lock(self) -> Path:
        return self.marker.with_suffix(".lock")

    @property
    def log(self) -> Path:
        return self.marker.with_suffix(".log")

    def warm_model_file(self) -> Path | None:
        """The AOT file the warm-up produced, if the marker names one that still exists."""
        try:
            named = Path(json.loads(self.marker.read_text())["model_file"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return named if named.is_file() else None

    def record_warm(self, model_file: Path) -> None:
        """Written whole or not at all: a reader never sees half a marker."""
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        partial = self.marker.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"model_file": str(model_file), "recorded_at": time.time()}) + "\n")
        os.replace(partial, self.marker)


@dataclass(frozen=True)
class AutoChoice:
    compiled: bool
    #: Why, for the start's log line.
    reason: str


def choose(cache: CompileCache) -> AutoChoice:
    """Compiled only when the warm-up's AOT file is there to load."""
    model_file = cache.warm_model_file()
    if model_file is not None:
        return AutoChoice(True, f"compiled: the compile cache is warm ({cache.marker} names {model_file})")
    return AutoChoice(False, "eager: this configuration's compile cache is not warm yet")


def _take_lock(path: Path) -> IO[bytes] | None:
    """The lock file, locked; ``None`` if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("ab")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def warmup_config(config: Any) -> dict[str, Any]:
    """The fields of a ``VllmEngineConfig`` the warm-up starts the engine with (neither sampling nor the
    names requests may use are: it answers none)."""
    fields = asdict(config)
    fields.pop("sampling_overrides", None)
    fields.pop("aliases", None)
    return fields


def warmup_command(config: Mapping[str, Any], key: str) -> list[str]:
    """This module's ``main`` on ``config``, through the launcher that makes it die with us."""
    launcher = Path(sys.executable).with_name(CHILD_LAUNCHER)
    program = str(launcher) if launcher.exists() else sys.executable
    return [program, "-m", __name__, "--key", key, "--config", json.dumps(dict(config))]


class WarmUp:
    """The background compile of one configuration: its process, and a task that logs how it ended."""

    def __init__(self, process: asyncio.subprocess.Process, cache: CompileCache) -> None:
        self.process = process
        self._cache = cache
        #: When it was launched (``time.monotonic()``).
        self.started = time.monotonic()
        self.done = asyncio.create_task(self._watch(), name="compile-warmup")

    @property
    def pid(self) -> int:
        return self.process.pid

    async def _watch(self) -> int:
        """Supervised: whatever happens is logged, and serving never hears of it."""
        try:
            code = await self.process.wait()
            took = time.monotonic() - self.started
            if code == 0:
                logger.info("engine compile: the background compile finished in %.0f s; the next start will be "
                            "compiled (%s)", took, self._cache.marker)
            else:
                tail = await asyncio.to_thread(_last_lines, self._cache.log, _FAILURE_LINES)
                logger.warning("engine compile: the background compile failed (exit %s after %.0f s); the next "
                               "start will be eager again. Its log (%s) ends:\n%s", code, took, self._cache.log, tail)
            return code
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine compile: watching the background compile failed")
            return -1

    async def stop(self) -> None:
        """Kill it (with its engine: its children die with it) and wait; vLLM's cache stays whole."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await asyncio.gather(self.done, return_exceptions=True)


def _last_lines(path: Path, count: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-count:])
    except OSError as exc:
        return f"(unreadable: {exc})"


async def launch_warmup(cache: CompileCache, command: Sequence[str],
                        environ: Mapping[str, str] | None = None) -> WarmUp | None:
    """Start ``command`` niced in the background, holding the configuration's lock; ``None``
    (logged) if another process holds it or the launch failed. Never raises: a warm-up is a
    bonus, serving goes on without it. ``environ``: the warm-up's environment, the one the
    serving engine started in (``None``: this process's).

    Launched from the event loop (asyncio forks in the loop's thread, which lives as long as
    the process: the parent-death signal follows the thread that started the child)."""
    try:
        lock = _take_lock(cache.lock)
        if lock is None:
            logger.info("engine compile: eager; another process is compiling this configuration in the "
                        "background (%s is locked), so this one does not", cache.lock)
            return None
        try:
            with cache.log.open("wb") as log:
                process = await asyncio.create_subprocess_exec(
                    "nice", "-n", str(WARMUP_NICENESS), *command,
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                    env=None if environ is None else dict(environ),
                    # The warm-up holds the lock by holding this open file; it is released when it exits.
                    pass_fds=(lock.fileno(),))
        finally:
            lock.close()
    except Exception as exc:
        logger.warning("engine compile: eager; the background compile could not start (%s: %s)",
                       type(exc).__name__, exc)
        return None
    logger.info("engine compile: eager; compiling in the background (pid %d, nice %d, log %s); the next "
                "start will be compiled", process.pid, WARMUP_NICENESS, cache.log)
    return WarmUp(process, cache)


async def _compile(config: dict[str, Any], cache: CompileCache) -> Path:
    """The engine started compiled, then closed: what it leaves behind is vLLM's AOT file,
    named in this warm-up's log (its engine processes write there: their stdout is the log)."""
    from omni_adapter.vllm_engine import VllmEngineConfig, open_vllm_engine

    engine = await open_vllm_engine(VllmEngineConfig(**config))
    await engine.aclose()
    named = aot_file_named(cache.log.read_text(errors="replace"))
    if named is None or not named.is_file():
        raise RuntimeError(f"vLLM's log ({cache.log}) names no AOT model file that exists (is its AOT compile "
                           f"off?); nothing to record")
    return named


def aot_file_named(log: str) -> Path | None:
    """The AOT model file vLLM last named in ``log``: saved after a compile, or loaded instead."""
    found = _AOT_FILE.findall(log)
    return Path(found[-1]) if found else None


def main(argv: list[str] | None = None) -> None:
    """``python -m omni_adapter.compile_warmup --key K --config JSON``: compile, record, exit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True)
    parser.add_argument("--config", required=True, help="VllmEngineConfig fields, JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = json.loads(args.config) | {"compile": True}
    cache = CompileCache(vllm_cache_root(), args.key)
    model_file = asyncio.run(_compile(config, cache))
    cache.record_warm(model_file)
    logger.info("compile cache warm: %s names %s", cache.marker, model_file)


if __name__ == "__main__":
    main()
