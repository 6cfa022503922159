"""Function calling: vLLM's parsers and structured output, on both real adapters (``real_engine``:
in process, and the ``vllm serve`` sidecar, which parses with the same parsers), and the parts."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.port import Engine, Finished, SamplingOptions, TextDelta, ToolCallDelta
from omni_adapter.tool_calls import ToolCallParser, conversation, tool_call_parser_class
from tests.omni_adapter.sessions import collect, request, text_chunks

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(ensure_default_model())


async def answer(engine: Engine, text: str, *, chunk: int = 8, **fields: Any) -> list[Any]:
    """Every event of one session fed ``text`` in small chunks (incremental where it can be)."""
    session = engine.open_session(dataclasses.replace(request(max_tokens=40), **fields))
    for piece in text_chunks(text.encode(), chunk):
        await session.feed([piece])
    await session.end_input()
    events = []
    async for event in session.events():
        events.append(event)
    return events


def calls(events: list[Any]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of each call, from its streamed deltas."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name:
                names[e.index] = e.name
            arguments[e.index] = arguments.get(e.index, "") + e.arguments
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


@pytest.mark.engine
async def test_a_named_function_is_called_with_valid_arguments_even_by_the_small_model(
        real_engine: Engine) -> None:
    events = await answer(real_engine, "What is the weather in Paris today?", tools=(WEATHER, TIME),
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [(name, arguments)] = calls(events)
    assert name == "get_weather" and isinstance(arguments.get("city"), str)
    assert not any(isinstance(e, TextDelta) and e.text for e in events), "no content beside the call"
    first = next(e for e in events if isinstance(e, ToolCallDelta))
    assert first.id and first.name == "get_weather", "the first delta names the call"
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop", "OpenAI's reason for a named call"


@pytest.mark.engine
async def test_required_calls_one_of_the_tools_and_finishes_with_tool_calls(real_engine: Engine) -> None:
    events = await answer(real_engine, "What time is it in Tokyo?", tools=(WEATHER, TIME), tool_choice="required")
    found = calls(events)
    assert found and all(name in ("get_weather", "get_time") for name, _ in found)
    assert all(isinstance(arguments, dict) for _, arguments in found)
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "tool_calls"


@pytest.mark.engine
async def test_auto_and_none_answer_in_text_when_the_model_does_not_call(real_engine: Engine) -> None:
    # The 135M model answers a greeting in words: the parser passes the text on as content.
    for choice in ("auto", "none"):
        events = await answer(real_engine, "Hello! How are you?", tools=(WEATHER,), tool_choice=choice)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert text.strip() and not calls(events), choice
        assert isinstance(events[-1], Finished) and events[-1].finish_reason in ("stop", "length")


@pytest.mark.engine
async def test_auto_relays_the_models_own_call_and_no_start_of_it_as_content(real_engine: Engine) -> None:
    """With ``auto`` the model writes the call in its own format (here held to it by a regex, as
    the 135M model seldom calls unasked) and vLLM's streaming parser told the tag's first tokens
    (``<``, ``tool``, ``_``, ``call``) as content before the call: in process and on ``vllm serve``
    alike, so both adapters hold them back. The sidecar must parse it (``--tool-call-parser``)."""
    said = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    held_to = {"type": "regex", "regex": "".join("\\" + ch if ch in "[]{}" else ch for ch in said)}
    events = await answer(real_engine, "What is the weather in Paris today?", tools=(WEATHER,), tool_choice="auto",
                          sampling=SamplingOptions(temperature=0.0, max_tokens=40, response_format=held_to))
    assert calls(events) == [("get_weather", {"city": "Paris"})]
    assert contents(events) == "", "no piece of the call's opening tag is content"
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "tool_calls"


@pytest.mark.engine
async def test_a_function_result_fed_back_reaches_the_answer(real_engine: Engine) -> None:
    """The result is the streamed input (role ``tool``) after the assistant's call in the history."""
    history = (
        {"role": "system", "content": "Answer with the weather the tool reported."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    )
    session = real_engine.open_session(dataclasses.replace(
        request(max_tokens=24, history=history), tools=(WEATHER,), input_role="tool", input_tool_call_id="call_1"))
    await session.feed(text_chunks(b"Sunny and 24 degrees", 64))
    await session.end_input()
    text, last = await collect(session.events())
    assert isinstance(last, Finished)
    assert "sunny" in text.lower() or "24" in text, text


def test_auto_reads_the_models_own_call_format_with_vllms_parser(tokenizer: Any) -> None:
    """What SmolLM2 writes when it calls (its model card's format), through vLLM's ``xlam`` parser."""
    parser = ToolCallParser(tool_call_parser_class("xlam", tokenizer), tokenizer,
                            (WEATHER,), "auto")
    assert parser.structured_outputs is None, "auto is free text"
    said = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    events = [e for i in range(0, len(said), 7)
              for e in parser.parse(said[i:i + 7], [], finished=i + 7 >= len(said))]
    assert calls(events) == [("get_weather", {"city": "Paris"})] and parser.called


def contents(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize("before", ["", "Let me check. "])
def test_a_calls_opening_tag_is_not_told_as_content(tokenizer: Any, before: str) -> None:
    """SmolLM2 writes ``<tool_call>`` in five tokens, and vLLM's streaming parser told the first
    four as content ("<tool_call" beside the calls; a Responses message item of it). Words before
    the tag stay, as ``vllm serve``'s whole-answer parse keeps them."""
    parser = ToolCallParser(tool_call_parser_class("xlam", tokenizer), tokenizer, (WEATHER,), "auto")
    said = [*before.split(" ")[:-1], " " if before else "", "<", "tool", "_", "call", ">", '[{"', "name",
            '": "', "get", "_weather", '", "', "arguments", '": {"', "city", '": "', "Paris", '"}}]',
            "</", "tool", "_", "call", ">"]
    events = [e for i, piece in enumerate(said) for e in parser.parse(piece, [], finished=i == len(said) - 1)]
    assert calls(events) == [("get_weather", {"city": "Paris"})]
    assert contents(events).replace(" ", "") == before.replace(" ", ""), contents(events)


def test_text_that_only_looks_like_a_calls_start_is_told_whole(tokenizer: Any) -> None:
    parser = ToolCallParser(tool_call_parser_class("xlam", tokenizer), tokenizer, (WEATHER,), "auto")
    said = ["If a", " <", " b then", " <", "tool"]  # held back, then told: the answer ended
    events = [e for i, piece in enumerate(said) for e in parser.parse(piece, [], finished=i == len(said) - 1)]
    assert contents(events) == "If a < b then <tool" and not calls(events)


def test_a_call_to_a_function_the_request_did_not_declare_is_left_out(tokenizer: Any) -> None:
    """SmolLM2 asked about a capital with only a weather tool calls "capital": no client can run it."""
    parser = ToolCallParser(tool_call_parser_class("xlam", tokenizer), tokenizer, (WEATHER,), "auto")
    said = ('<tool_call>[{"name": "capital", "arguments": {"country": "France"}}, '
            '{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>')
    events = [e for i in range(0, len(said), 5)
              for e in parser.parse(said[i:i + 5], [], finished=i + 5 >= len(said))]
    assert calls(events) == [("get_weather", {"city": "Paris"})]
    assert {e.index for e in events if isinstance(e, ToolCallDelta)} == {0}, "the kept call is the answer's first"

    alone = ToolCallParser(tool_call_parser_class("xlam", tokenizer), tokenizer, (WEATHER,), "auto")
    only = '<tool_call>[{"name": "capital", "arguments": {"country": "France"}}]</tool_call>'
    events = [e for i in range(0, len(only), 5) for e in alone.parse(only[i:i + 5], [], finished=i + 5 >= len(only))]
    assert not [e for e in events if isinstance(e, ToolCallDelta)]
    assert "tool_call" not in contents(events), "the left-out call's tag is not content either"
    assert not alone.called, "an answer without a call finishes with stop, not tool_calls"


def test_without_parallel_calls_one_call_stands(tokenizer: Any) -> None:
    """``parallel_tool_calls: false``: ``required``'s schema holds one call; with ``auto`` the first
    call is the answer's and later ones are left out (as vLLM's server filters them)."""
    xlam = tool_call_parser_class("xlam", tokenizer)
    single = ToolCallParser(xlam, tokenizer, (WEATHER, TIME), "required", parallel=False)
    assert single.structured_outputs is not None and single.structured_outputs.json["maxItems"] == 1
    several = ToolCallParser(xlam, tokenizer, (WEATHER, TIME), "required")
    assert several.structured_outputs is not None and "maxItems" not in several.structured_outputs.json

    parser = ToolCallParser(xlam, tokenizer, (WEATHER, TIME), "auto", parallel=False)
    said = ('<tool_call>[{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}, '
            '{"name": "get_weather", "arguments": {"city": "Tokyo"}}]</tool_call>')
    events = [e for i in range(0, len(said), 6)
              for e in parser.parse(said[i:i + 6], [], finished=i + 6 >= len(said))]
    assert calls(events) == [("get_time", {"zone": "Asia/Tokyo"})]


def test_a_template_without_tools_is_told_them_and_earlier_calls_become_text() -> None:
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    messages, tools = conversation(history, (WEATHER,), "auto", takes_tools=False)
    assert tools == [] and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    assert "tool_calls" not in messages[2]
    untold, _ = conversation(history, (WEATHER,), "none", takes_tools=False)
    assert untold[0]["role"] == "user", "tool_choice none: the model is not told of tools"
    assert untold[1] == {"role": "assistant", "content": ""} and untold[2] == history[2], \
        "nor shown a call's format to copy into an answer that may not call"
    assert conversation(history, (), None, takes_tools=False)[0] == untold, "no tools: the same"
    native, given = conversation(history, (WEATHER,), "auto", takes_tools=True)
    assert given == [WEATHER] and native == history
