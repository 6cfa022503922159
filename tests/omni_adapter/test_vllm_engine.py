"""The ``vllm`` adapter against the real engine (and its pure helpers)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from transformers import AutoTokenizer

from omni_adapter.factory import EngineChoice, open_request_checks
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.port import (
    EngineError,
    EngineRejectedError,
    EngineRequest,
    Finished,
    InputChunk,
    SamplingOptions,
)
from omni_adapter.vllm_engine import Step, StopStrings, VllmEngine
from tests.loop_lag import assert_loop_keeps_up
from tests.omni_adapter.sessions import (
    ALIAS,
    HISTORY,
    MODEL,
    collect,
    one_shot,
    request,
    text_chunks,
)

if TYPE_CHECKING:
    from tests.conftest import StartedEngine

QUESTION = "What colour is the sky on a clear day? Answer — briefly, it's a test."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.mark.engine
@pytest.mark.parametrize("pause", [0.0, 0.02], ids=["batched", "paced"])
async def test_streamed_input_answers_like_one_shot(
    vllm_engine: VllmEngine, tokenizer: Any, pause: float
) -> None:
    expected_text, expected_end = await one_shot(vllm_engine, request(), QUESTION)

    session = vllm_engine.open_session(request())
    # 5-byte chunks also split the multi-byte dash. Without a pause, chunks
    # pile up while the engine prefills and go in as one batch.
    for chunk in text_chunks(QUESTION.encode(), 5):
        await session.feed([chunk])
        await asyncio.sleep(pause)
    await asyncio.sleep(0.5)
    prefilled_before_end = session._fed  # white-box: input really was streamed
    await session.end_input()
    text, end = await collect(session.events())

    assert prefilled_before_end > 20
    assert text == expected_text and text
    assert isinstance(end, Finished) and isinstance(expected_end, Finished)
    assert end.finish_reason == expected_end.finish_reason
    assert end.usage == expected_end.usage
    one_shot_ids = tokenizer.apply_chat_template(
        [*HISTORY, {"role": "user", "content": QUESTION}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    assert end.usage.prompt_tokens == len(one_shot_ids)


@pytest.mark.engine
async def test_input_fed_right_before_the_end_goes_in_with_the_final_input(vllm_engine: VllmEngine) -> None:
    """The last words a Listener hears are fed just before the end: one engine pass for
    them and the generation prompt, not a prefill and then another pass."""
    expected_text, expected_end = await one_shot(vllm_engine, request(), QUESTION)
    session = vllm_engine.open_session(request())
    chunks = text_chunks(QUESTION.encode(), 20)
    await session.feed(chunks[:1])
    await asyncio.sleep(0.5)  # prefilled while the input streams
    prefilled_before_end = session._fed
    steps: list[Step] = []
    step = session._step
    session._step = lambda s: (steps.append(s), step(s))[1]  # type: ignore[method-assign]  # white-box
    await session.feed(chunks[1:])
    await session.end_input()
    text, end = await collect(session.events())
    assert prefilled_before_end > 0
    assert steps[:2] == [Step.ENDED, Step.SENT_FINAL], steps
    assert text == expected_text and end == expected_end


@pytest.mark.engine
async def test_abort_while_input_streams_then_engine_still_serves(
    vllm_engine: VllmEngine,
) -> None:
    session = vllm_engine.open_session(request())
    await session.feed(text_chunks(b"This input is never finished, because", 6))
    await asyncio.sleep(0.3)
    await session.abort()
    async with asyncio.timeout(5):
        events = [event async for event in session.events()]
    assert [type(e) for e in events] == [Finished] and events[0].finish_reason == "abort"
    await session.feed(text_chunks(b"ignored", 7))  # after abort: no effect
    text, end = await one_shot(vllm_engine, request(max_tokens=2), "Hi")
    assert isinstance(end, Finished) and end.usage.completion_tokens >= 1


@pytest.mark.engine
async def test_input_longer_than_the_context_fails_the_session(vllm_engine: VllmEngine) -> None:
    session = vllm_engine.open_session(request())
    with pytest.raises(EngineRejectedError):
        await session.feed(text_chunks(b"word " * 5000, 25_000))
    events = [event async for event in session.events()]
    assert len(events) == 1 and isinstance(events[0], EngineError)
    assert events[0].code == "invalid_request"


@pytest.mark.engine
def test_the_event_loop_keeps_turning_while_the_engine_starts(started_vllm_engine: StartedEngine) -> None:
    """The start (importing vLLM, the engine core's process, the model) ran on the loop: 41 s
    without a turn, after which every timeout pending on it expired at once (issue 29, item 12:
    "every Redis call of the process stalled over 10 s")."""
    # What is left is the start thread holding the GIL in one C call (loading torch's
    # libraries): 0.32 s on a quiet machine, 1.1 s once on a loaded 2-core CI machine.
    assert started_vllm_engine.start_loop_lag_sec < 2.5


@pytest.mark.engine
@pytest.mark.parametrize("text", [
    pytest.param(("Lorem ipsum dolor sit amet, consectetur. " * 60_000)[:2 * 1024 * 1024], id="2MB-of-words"),
    pytest.param("a" * (2 * 1024 * 1024), id="2MB-without-a-boundary"),
])
async def test_a_big_chunk_is_tokenized_off_the_event_loop(vllm_engine: VllmEngine, text: str) -> None:
    """Other sessions' appends, streams and heartbeats keep their latency meanwhile."""
    chunk = [InputChunk(0, "text", text.encode())]

    async def feed_one_session() -> None:
        with pytest.raises(EngineRejectedError, match="context"):
            await vllm_engine.open_session(request()).feed(chunk)

    await assert_loop_keeps_up(feed_one_session)


@pytest.mark.engine
async def test_pending_text_without_a_boundary_counts_toward_the_context(vllm_engine: VllmEngine) -> None:
    # Ten 200 KB chunks with no word boundary used to pile up as pending text.
    session = vllm_engine.open_session(request())
    with pytest.raises(EngineRejectedError, match="context"):
        for seq in range(10):
            await session.feed([InputChunk(seq, "text", b"x" * 200_000)])
    assert seq == 0  # refused on the first chunk, not after ten


@pytest.mark.engine
async def test_assistant_prefix_is_continued(vllm_engine: VllmEngine, tokenizer: Any) -> None:
    """After a hand-off the answer so far is the assistant's prefix: it counts as completion."""
    req = request(max_tokens=6)
    req = EngineRequest(
        request_id=req.request_id, model=MODEL, messages=HISTORY, sampling=req.sampling,
        assistant_prefix="The sky is",
    )
    _, end = await one_shot(vllm_engine, req, QUESTION)
    rendered = tokenizer.apply_chat_template(
        [*HISTORY, {"role": "user", "content": QUESTION}],
        add_generation_prompt=True, tokenize=False,
    )
    assert isinstance(end, Finished)
    prefix_tokens = len(tokenizer("The sky is", add_special_tokens=False).input_ids)
    assert end.usage.prompt_tokens + prefix_tokens == len(tokenizer(rendered + "The sky is").input_ids)
    # max_tokens covers the whole answer, the prefix included.
    assert prefix_tokens < end.usage.completion_tokens <= 6


@pytest.mark.engine
async def test_open_session_rejects_invalid_sampling(vllm_engine: VllmEngine) -> None:
    with pytest.raises(EngineRejectedError):
        vllm_engine.open_session(EngineRequest("x", MODEL, (), SamplingOptions(top_p=7.0)))


@pytest.mark.engine
async def test_capabilities_and_health(vllm_engine: VllmEngine) -> None:
    caps = vllm_engine.capabilities
    assert caps.incremental and caps.model_names == (MODEL, ALIAS)
    assert caps.input_modalities == caps.output_modalities == frozenset({"text"})
    await vllm_engine.check_health()


def run_stops(stops: Sequence[str], deltas: Sequence[str], *, keep: bool = False) -> tuple[str, bool]:
    scanner, out = StopStrings(stops, keep=keep), ""
    for delta in deltas:
        text, stopped = scanner.feed(delta)
        out += text
        if stopped:
            return out, True
    return out + scanner.flush(), False


@pytest.mark.parametrize(
    ("stops", "deltas", "expected"),
    [
        ((), ["Hel", "lo"], ("Hello", False)),
        (("END",), ["abc E", "N", "D more"], ("abc ", True)),
        (("END",), ["abc E", "N", "d"], ("abc ENd", False)),
        (("xyz", "b"), ["aaxy", "zb"], ("aa", True)),
        (("\n\n",), ["one\n", "\ntwo"], ("one", True)),
    ],
)
def test_stop_strings_never_emit_part_of_a_stop(
    stops: tuple[str, ...], deltas: list[str], expected: tuple[str, bool]
) -> None:
    assert run_stops(stops, deltas) == expected


@pytest.mark.parametrize(
    ("stops", "deltas", "kept", "dropped"),
    [
        (("END",), ["abc E", "N", "D more"], "abc END", "abc "),
        # The stop that ends first wins, as in vLLM ("b" ends before "abc" does).
        (("abc", "b"), ["xabc d"], "xab", "xa"),
        (("\n\n",), ["one\n", "\ntwo"], "one\n\n", "one"),
    ],
)
def test_a_stop_string_is_kept_when_asked_and_the_first_to_end_stops(
    stops: tuple[str, ...], deltas: list[str], kept: str, dropped: str
) -> None:
    """vLLM's ``include_stop_str_in_output``."""
    assert run_stops(stops, deltas, keep=True) == (kept, True)
    assert run_stops(stops, deltas) == (dropped, True)


@pytest.mark.engine
async def test_a_process_without_the_engine_checks_as_the_engine_does(vllm_engine: VllmEngine) -> None:
    """An API worker opens no engine; it loads the tokenizer and must answer every check alike."""
    choice = EngineChoice(kind="vllm", max_model_len=vllm_engine.max_input_tokens + 1)
    checks = await open_request_checks(choice, vllm_engine.capabilities)
    assert checks is not None and checks.max_input_tokens == vllm_engine.max_input_tokens
    long_history = (*HISTORY, {"role": "assistant", "content": "Noted. " * 40})
    for req in (request(), request(history=long_history)):
        assert checks.check_request(req) == vllm_engine.check_request(req) > 0
    for text in ("What is the capital of France and why?", "  spaced  words ", "x"):
        assert checks.input_tokens_at_least(text) == vllm_engine.input_tokens_at_least(text)
    old, new = "The first page. The second page.", "The first page. A re-ranked page."
    assert checks.common_prefix_tokens(old, new) == vllm_engine.common_prefix_tokens(old, new)
    assert 0 < checks.common_prefix_tokens(old, new)[0] < checks.common_prefix_tokens(old, new)[1]
    bad = EngineRequest("x", MODEL, (), SamplingOptions(top_p=7.0))
    for refuses in (checks.check_request, vllm_engine.check_request):
        with pytest.raises(EngineRejectedError):
            refuses(bad)
    # Only the in-process vLLM engine's checks live in its tokenizer.
    assert await open_request_checks(EngineChoice(kind="openai-http"), vllm_engine.capabilities) is None


@pytest.mark.engine
async def test_the_suite_s_engine_runs_eager(vllm_engine: VllmEngine) -> None:
    """``compile=False`` is eager: no torch.compile, and no background compile either (the
    suite's engines pin it; auto's choice is tested in test_compile_warmup.py)."""
    from vllm.config import CompilationMode

    config = vllm_engine._llm.vllm_config
    assert config.model_config.enforce_eager
    assert config.compilation_config.mode == CompilationMode.NONE
    assert not vllm_engine.compiled and vllm_engine.compile_warmup is None


def test_an_api_workers_checks_have_loaded_what_they_import_before_its_first_request() -> None:
    """An API worker freezes its heap once it serves: what its first check imported (vLLM, its
    chat parsers, the grammar compiler: ~1,650 modules) came after, and every full collection
    walked it while the worker's streams waited. Its checks load it all before it serves."""
    script = textwrap.dedent("""
        import asyncio, sys
        from omni_adapter.factory import EngineChoice, open_request_checks
        from omni_adapter.model_bootstrap import ensure_default_model
        from omni_adapter.port import Capabilities, EngineRequest, SamplingOptions

        caps = Capabilities(input_modalities=frozenset({"text"}), output_modalities=frozenset({"text"}), incremental=True,
                            model_names=("m",), tools=True, structured_outputs=True)
        checks = asyncio.run(open_request_checks(EngineChoice(kind="vllm", model=str(ensure_default_model())), caps))
        before = set(sys.modules)
        tool = {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}}}}}
        for sampling, tools in ((SamplingOptions(max_tokens=5, temperature=0.3), ()),
                                (SamplingOptions(max_tokens=9, response_format=schema), ()),
                                (SamplingOptions(), (tool,))):
            checks.check_request(EngineRequest("r", "m", ({"role": "system", "content": "Be brief."},),
                                               sampling, tools=tools, tool_choice="auto" if tools else None))
        print(sorted(set(sys.modules) - before))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
