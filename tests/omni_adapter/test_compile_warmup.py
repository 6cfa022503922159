"""Auto compile (omni_adapter/compile_warmup.py): the key, the marker, the lock, the niced launch.

No engine here: the background compile itself (two minutes of CPU) is measured by
``python -m bench.engine_start --scenario auto``. The launch is tested with stand-in
commands; the shipped command is checked to be the real warm-up.
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from omni_adapter import compile_warmup
from omni_adapter.compile_warmup import (
    WARMUP_NICENESS,
    CompileCache,
    aot_file_named,
    choose,
    compile_key,
    launch_warmup,
    warmup_command,
    warmup_config,
)
from omni_adapter.vllm_engine import VllmEngineConfig, _compile_or_not, engine_args


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 576}')
    return folder


def _key(model: Path, **changes: object) -> str:
    config = VllmEngineConfig(model=str(model), served_model_name="m", **changes)  # type: ignore[arg-type]
    return compile_key(engine_args(config, compiled=True, cpu=True), config.model)


def test_the_key_changes_with_what_vllm_compiles_by(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import vllm

    base = _key(model)
    assert _key(model) == base
    assert _key(model, max_model_len=2048) != base
    assert _key(model, dtype="bfloat16") != base
    # More requests at once than a compiled CPU step holds: a bigger step, another graph.
    assert _key(model, max_num_seqs=1024) != base
    (model / "config.json").write_text('{"hidden_size": 577}')
    assert _key(model) != base
    (model / "config.json").write_text('{"hidden_size": 576}')
    assert _key(model) == base
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1")  # one of vLLM's env compile factors
    assert _key(model) != base
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    assert _key(model) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert _key(model) != base
    monkeypatch.undo()
    from torch._inductor import config as inductor_config

    # What TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1 at torch's import makes it (vLLM's CPU platform sets it later).
    with inductor_config.patch({"cpp.dynamic_threads": not inductor_config.cpp.dynamic_threads}):
        assert _key(model) != base
    assert _key(model) == base


def test_the_key_ignores_what_does_not_change_the_compiled_model(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    base = _key(model)
    # The compiled form is the key whatever the config asks for: auto looks it up eager.
    assert _key(model, compile=False) == _key(model, compile=True) == base
    assert _key(model, kv_cache_space_gib=7) == base
    assert _key(model, aliases=("gpt-realtime",)) == base  # a further name is the gateway's, not vLLM's
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # not a compile factor of vLLM's
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("OMNI_GATEWAY_SOMETHING", "1")
    assert _key(model) == base


def test_vllm_s_env_factors_leave_out_the_kv_cache_space() -> None:
    """The warm-up may start with another KV space without moving vLLM's key (it takes the same anyway)."""
    import vllm.envs

    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm.envs.compile_factors()


def test_vllm_names_the_aot_file_it_saves_or_loads() -> None:
    """The lines ``aot_file_named`` reads, as vLLM writes them, and the folder they name."""
    from vllm.compilation import decorators

    assert "Directly load AOT compilation from path %s" in inspect.getsource(decorators._try_load_aot_compiled_fn)
    source = inspect.getsource(decorators)
    assert '"%ssaved AOT compiled function to %s"' in source
    assert '"torch_aot_compile"' in source
    assert 'f"rank_{rank}_{dp_rank}"' in source


def _aot_file(root: Path, name: str = "abc") -> Path:
    path = root / "torch_compile_cache" / "torch_aot_compile" / name / "rank_0_0" / "model"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"compiled")
    return path


def test_auto_compiles_only_with_a_marker_whose_file_exists(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, "k1")
    assert not choose(cache).compiled  # no marker
    model_file = _aot_file(tmp_path)
    assert not choose(cache).compiled  # a cache vLLM filled, but no warm-up of ours named it
    cache.record_warm(model_file)
    assert choose(cache).compiled
    assert str(cache.marker) in choose(cache).reason
    assert not choose(CompileCache(tmp_path, "k2")).compiled  # another configuration
    model_file.unlink()  # the cache was cleared
    assert not choose(cache).compiled
    cache.marker.write_text("{not json")
    assert not choose(cache).compiled


def test_the_engine_asks_auto_only_when_compile_is_unset_on_the_cpu(model: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    config = VllmEngineConfig(model=str(model), served_model_name="m")
    assert _compile_or_not(VllmEngineConfig(model=str(model), served_model_name="m", compile=True), True) == (True, None)
    assert _compile_or_not(VllmEngineConfig(model=str(model), served_model_name="m", compile=False), True) == (False, None)
    assert _compile_or_not(config, cpu=False) == (True, None)  # a GPU: vLLM's default
    compiled, to_warm = _compile_or_not(config, cpu=True)
    assert not compiled and to_warm is not None
    assert to_warm == CompileCache(tmp_path / "vllm", _key(model))
    to_warm.record_warm(_aot_file(tmp_path / "vllm"))
    assert _compile_or_not(config, cpu=True) == (True, None)


def test_the_warm_up_records_the_last_file_its_own_log_names() -> None:
    saved = "/c/torch_aot_compile/new/rank_0_0/model"
    loaded = "/c/torch_aot_compile/old/rank_0_0/model"
    log = (f"(Worker pid=7) INFO 11-26 [decorators.py:743] [backbone] saved AOT compiled function to {saved}\n"
           "INFO ready\n")
    assert aot_file_named(log) == Path(saved)
    log += f"(Worker pid=9) INFO 11-26 [decorators.py:319] [backbone] Directly load AOT compilation from path {loaded}\n"
    assert aot_file_named(log) == Path(loaded)
    assert aot_file_named("INFO nothing compiled\n") is None


def _stand_in(program: str) -> list[str]:
    return [sys.executable, "-c", program]


async def test_the_warm_up_runs_niced_and_its_end_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(tmp_path, "k")
    with caplog.at_level(logging.INFO, logger=compile_warmup.__name__):
        warmup = await launch_warmup(cache, _stand_in("import os; print('niceness', os.nice(0))"))
        assert warmup is not None
        assert await warmup.done == 0
    assert f"niceness {WARMUP_NICENESS}" in cache.log.read_text()
    assert f"pid {warmup.pid}, nice {WARMUP_NICENESS}" in caplog.text
    assert "the background compile finished" in caplog.text


async def test_the_warm_up_starts_in_the_environment_it_is_given(tmp_path: Path) -> None:
    """The engine passes the one it started in, before vLLM's CPU platform added its own."""
    cache = CompileCache(tmp_path, "k")
    program = _stand_in("import os; print('flag', os.environ.get('TORCHINDUCTOR_CPP_DYNAMIC_THREADS'))")
    os.environ["TORCHINDUCTOR_CPP_DYNAMIC_THREADS"] = "1"
    try:
        warmup = await launch_warmup(cache, program, {k: v for k, v in os.environ.items()
                                                      if k != "TORCHINDUCTOR_CPP_DYNAMIC_THREADS"})
    finally:
        del os.environ["TORCHINDUCTOR_CPP_DYNAMIC_THREADS"]
    assert warmup is not None and await warmup.done == 0
    assert "flag None" in cache.log.read_text()


async def test_a_failed_warm_up_says_why_and_serving_goes_on(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(tmp_path, "k")
    with caplog.at_level(logging.INFO, logger=compile_warmup.__name__):
        warmup = await launch_warmup(cache, _stand_in("print('RuntimeError: no room for a second engine'); exit(3)"))
        assert warmup is not None
        assert await warmup.done == 3
    assert "failed (exit 3" in caplog.text
    assert "no room for a second engine" in caplog.text


async def test_a_launch_that_cannot_start_is_logged_not_raised(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "omni-gateway").write_text("a file where the marker folder should be")
    with caplog.at_level(logging.INFO, logger=compile_warmup.__name__):
        assert await launch_warmup(CompileCache(tmp_path, "k"), _stand_in("")) is None
    assert "the background compile could not start" in caplog.text


async def test_one_warm_up_per_key_while_its_lock_is_held(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(tmp_path, "k")
    started = tmp_path / "started"
    program = _stand_in(f"open({str(started)!r}, 'a').write('x'); import time; time.sleep(60)")
    first = await launch_warmup(cache, program)
    assert first is not None
    try:
        deadline = time.monotonic() + 60
        while not started.exists():  # niced 19, its Python takes a while to start on a busy machine
            assert time.monotonic() < deadline, "the first warm-up never ran"
            await asyncio.sleep(0.05)
        # The warm-up holds the lock (the launcher let go of its own copy): a second one does not start.
        with caplog.at_level(logging.INFO, logger=compile_warmup.__name__):
            assert await launch_warmup(cache, program) is None
        assert "another process is compiling this configuration" in caplog.text
        other = await launch_warmup(CompileCache(tmp_path, "other"), _stand_in(""))
        assert other is not None and await other.done == 0
    finally:
        await first.stop()
    assert first.process.returncode is not None
    # Gone with its process, the lock is free again; held by someone else, it is not.
    with cache.lock.open("ab") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert await launch_warmup(cache, program) is None
    again = await launch_warmup(cache, _stand_in(""))
    assert again is not None and await again.done == 0
    assert started.read_text() == "x"  # only the first one ran


def test_the_shipped_command_is_the_real_warm_up() -> None:
    config = VllmEngineConfig(model="/m", served_model_name="m", kv_cache_space_gib=3)
    command = warmup_command(warmup_config(config), "k")
    assert command[1:5] == ["-m", "omni_adapter.compile_warmup", "--key", "k"]
    # Through the launcher beside the interpreter: the warm-up dies with the gateway.
    assert Path(command[0]).name in ("omni-gateway-child", Path(sys.executable).name)
    fields = json.loads(command[command.index("--config") + 1])
    assert VllmEngineConfig(**fields) == config  # the same engine, KV space and all


_LAUNCHING_PARENT = """
import asyncio, sys
from pathlib import Path
from omni_adapter.compile_warmup import CompileCache, launch_warmup, warmup_command

async def main():
    launcher = warmup_command({}, "k")[0]  # the shipped command's program: the launcher
    warmup = await launch_warmup(CompileCache(Path(sys.argv[1]), "k"),
                                 [launcher, "-c", "import time; print('armed', flush=True); time.sleep(60)"])
    print(warmup.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_the_warm_up_dies_with_the_process_that_launched_it(tmp_path: Path) -> None:
    """A SIGKILLed gateway leaves no compile burning the CPU (nor holding the lock)."""
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", _LAUNCHING_PARENT, str(tmp_path),
                                                  stdout=asyncio.subprocess.PIPE)
    assert parent.stdout is not None
    pid = int(await asyncio.wait_for(parent.stdout.readline(), 30))
    log = CompileCache(tmp_path, "k").log
    deadline = time.monotonic() + 60  # niced 19: on a busy machine its Python takes a while to start
    while "armed" not in log.read_text():  # the launcher armed the signal before it ran the program
        assert time.monotonic() < deadline, "the warm-up never ran"
        await asyncio.sleep(0.05)
    os.kill(pid, 0)  # running
    parent.kill()
    await parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the warm-up outlived the process that launched it")


async def test_the_factory_gives_vllm_the_first_served_name_and_keeps_the_rest_as_aliases(
        monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    from omni_adapter import vllm_engine
    from omni_adapter.factory import EngineChoice, open_engine

    configs: list[VllmEngineConfig] = []

    async def opened(config: VllmEngineConfig) -> None:
        configs.append(config)
        raise RuntimeError("not started here")

    monkeypatch.setattr(vllm_engine, "open_vllm_engine", opened)
    for names in (("mine", "gpt-realtime", "gpt-4o-mini"), ()):
        with pytest.raises(RuntimeError, match="not started here"):
            await open_engine(EngineChoice(model=str(model), served_model_name=names))
    assert [(c.served_model_name, c.aliases) for c in configs] == [
        ("mine", ("gpt-realtime", "gpt-4o-mini")), (model.name, ())]
