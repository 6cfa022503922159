"""Update mode counts tokens from a mark before the replaced chunk, not over the whole input.

Against SmolLM2's real tokenizer (the engine's, loaded without the engine):
counting from marks gives exactly what tokenizing the whole old and new input
gives, for random chunkings that split words, whitespace runs and characters;
and through the app (real Redis) a PUT tokenizes the replaced chunk and what
follows it, however long the input before it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.service.token_marks import START, TokenMark, count_update, marks_along
from gateway.store.records import ChunkRecord
from omni_adapter.model_bootstrap import ensure_default_model
from omni_adapter.port import EngineRequest
from omni_adapter.scripted import ScriptedEngine, text_capabilities
from omni_adapter.vllm_engine import TokenizerChecks, load_tokenizer_checks
from tests.gateway.client import BASE, app_client, make_settings
from tests.omni_adapter.test_text_stream import FRAGMENTS, split_at


@pytest.fixture(scope="module")
def checks() -> TokenizerChecks:
    return load_tokenizer_checks(str(ensure_default_model()), 8192, text_capabilities())


def test_text_too_long_to_fit_is_counted_without_tokenizing_it(checks: TokenizerChecks,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB chunk took 20 s of a core to tokenize before its 413: a bound says so at once."""
    monkeypatch.setattr(checks._streaming, "encode_plain", None)  # tokenizing would fail the test
    assert checks.input_tokens_at_least("a b " * (4 * 1024 * 1024)) > checks.max_input_tokens
    monkeypatch.undo()
    assert 0 < checks.input_tokens_at_least("a b " * 100) < checks.max_input_tokens


def whole_count(checks: TokenizerChecks, old: list[bytes], new: list[bytes]) -> tuple[int, int]:
    """Today's reference: the whole old and new input tokenized."""
    return checks.common_prefix_tokens(b"".join(old).decode(errors="replace"),
                                       b"".join(new).decode(errors="replace"))


texts = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=40).map("".join)
cut_lists = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, cuts=cut_lists, replacement=texts, at=st.integers(min_value=0, max_value=100),
       keep=st.integers(min_value=0, max_value=100))
def test_counting_from_a_mark_equals_tokenizing_the_whole_input(
        checks: TokenizerChecks, text: str, cuts: list[int], replacement: str, at: int, keep: int) -> None:
    # Byte cuts: chunks end inside words, whitespace runs and characters.
    old = split_at(text.encode(), cuts)
    at %= len(old)
    # The new chunk often starts like the old one, so the kept prefix ends inside it.
    new_chunk = old[at][:keep % (len(old[at]) + 1)] + replacement.encode()
    new = [new_chunk if i == at else c for i, c in enumerate(old)]
    stored = [ChunkRecord(i, "text", c) for i, c in enumerate(old)]
    marks = [START, *marks_along(checks, START, old)]
    whole = tokens(checks, b"".join(old))
    for j, mark in enumerate(marks):  # a mark's tokens, then its pending bytes and the rest: the whole
        assert mark.tokens + tokens(checks, mark.pending + b"".join(old[j:])) == whole
        assert TokenMark.from_field(mark.to_field()) == mark
    # From the mark of the replaced chunk, as a PUT counts with marks kept...
    kept, total, new_marks = count_update(checks, marks[at], stored[at:], ChunkRecord(at, "text", new_chunk))
    assert (kept, total) == whole_count(checks, old, new)
    # ...and from the start, as the first PUT of a session counts; both mark the new input alike.
    assert count_update(checks, START, stored, ChunkRecord(at, "text", new_chunk))[:2] == (kept, total)
    assert [m for _, m in new_marks] == marks_along(checks, START, new)[at:]
    assert new_marks[-1][1].tokens + tokens(checks, new_marks[-1][1].pending) == total


def tokens(checks: TokenizerChecks, text: bytes) -> int:
    decoded = text.decode(errors="replace")
    return checks.common_prefix_tokens(decoded, decoded)[1]


@dataclass
class CountingEngine(ScriptedEngine):
    """The scripted engine with the real tokenizer's checks, counting the characters they tokenize."""

    checks: TokenizerChecks | None = None
    tokenized_chars: int = field(default=0)

    @property
    def max_input_tokens(self) -> int:
        assert self.checks is not None
        return self.checks.max_input_tokens

    def check_request(self, request: EngineRequest) -> int:
        assert self.checks is not None
        return self.checks.check_request(request)

    def input_tokens_at_least(self, text: str) -> int:
        assert self.checks is not None
        return self.checks.input_tokens_at_least(text)

    def common_prefix_tokens(self, old: str, new: str) -> tuple[int, int]:
        assert self.checks is not None
        self.tokenized_chars += len(old) + len(new)
        return self.checks.common_prefix_tokens(old, new)

    def settled_tokens(self, text: str) -> tuple[int, int]:
        assert self.checks is not None
        self.tokenized_chars += len(text)
        return self.checks.settled_tokens(text)


@pytest.fixture
async def counted(redis_url: str, checks: TokenizerChecks) -> AsyncIterator[tuple[httpx.AsyncClient, CountingEngine]]:
    engine = CountingEngine(checks=checks)
    async with app_client(make_settings(redis_url=redis_url), engine) as http:
        yield http, engine


def sentence(i: int) -> str:
    return f"Retrieved passage {i} says the answer may be {i * 7}; "


async def put_cost(http: httpx.AsyncClient, engine: CountingEngine, sid: str, texts: list[str], seq: int,
                   text: str) -> int:
    """Characters tokenized by one PUT; its counts are those of tokenizing the whole input."""
    engine.tokenized_chars = 0
    response = await http.put(f"{BASE}/{sid}/chunks/{seq}", json={"sequence_id": seq, "text": text})
    assert response.status_code == 200, response.text
    cost = engine.tokenized_chars
    assert engine.checks is not None
    old = "".join(texts)
    texts[seq] = text
    assert (response.json()["kept_tokens"], response.json()["input_tokens"]) == \
        engine.checks.common_prefix_tokens(old, "".join(texts))
    return cost


async def test_a_put_tokenizes_the_replaced_chunk_and_what_follows_not_the_input_before_it(
        counted: tuple[httpx.AsyncClient, CountingEngine]) -> None:
    http, engine = counted
    first_puts, later_puts = [], []
    for length in (10, 100):  # chunks before the updates
        texts = [sentence(i) for i in range(length)]
        sid = (await http.post(BASE, json={"start_policy": "on_end_only", "first_chunk": {
            "sequence_id": 0, "text": texts[0]}})).json()["session_id"]
        for seq in range(1, length):
            assert (await http.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": texts[seq]})
                    ).status_code == 202
        # A live last chunk: revised, then the next one appended and revised, and so on.
        first_puts.append(await put_cost(http, engine, sid, texts, length - 1, "Retrieved passage revised once; "))
        costs = []
        for seq in range(length, length + 5):
            texts.append(sentence(seq))
            await http.post(f"{BASE}/{sid}/chunks", json={"sequence_id": seq, "text": texts[seq]})
            costs.append(await put_cost(http, engine, sid, texts, seq, f"Passage {seq} revised; "))
        later_puts.append(max(costs))
    # The first PUT of a session marks its input: it counts the whole input once.
    assert first_puts[1] > 5 * first_puts[0]
    # From then on a PUT costs the same at 100 chunks as at 10: a chunk or two, old and new.
    assert later_puts[1] < 1.2 * later_puts[0] and later_puts[1] < 4 * len(sentence(100))
