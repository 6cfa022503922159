"""Any header value a client can send is a record or a clear 4xx, never a crash.

Headers reach code that parses numbers (``X-Sequence-Id``, ``X-Sample-Rate``,
``Last-Event-ID``); Python's ``str.isdigit`` and ``int`` accept far more than
ASCII digits, and Redis refuses stream ids past 2^64. Starlette decodes header
bytes as latin-1, so every byte value arrives as one of these characters.
"""

from __future__ import annotations

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.api.chunks import record_from_raw
from gateway.output.sse import parse_last_event_id

#: What a header value can be after Starlette's latin-1 decoding.
header_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=30)
numberish = st.one_of(header_text, st.integers(min_value=-(2**70), max_value=2**70).map(str),
                      st.sampled_from(["²", "١٢", "٣", "0x10", "1_000", "1e3", " 7", "7 ", "+7", "-0"]))


@settings(max_examples=400, deadline=None)
@given(seq=numberish, modality=st.one_of(header_text, st.sampled_from(["text", "audio"])),
       end=header_text, rate=st.one_of(st.none(), numberish), fmt=st.one_of(st.none(), header_text))
def test_raw_chunk_headers_never_crash(seq: str, modality: str, end: str, rate: str | None,
                                       fmt: str | None) -> None:
    headers = {"x-sequence-id": seq, "x-modality": modality, "x-end-of-input": end}
    if rate is not None:
        headers["x-sample-rate"] = rate
    if fmt is not None:
        headers["x-format"] = fmt
    try:
        record = record_from_raw(headers, b"\x00\x01" * 8, max_chunk_bytes=1024)
    except errors.GatewayError as exc:
        assert 400 <= exc.status_code < 500
        return
    assert record.sequence_id >= 0 and str(record.sequence_id) == seq
    assert record.sample_rate is None or record.sample_rate > 0


@settings(max_examples=400, deadline=None)
@given(value=st.one_of(numberish, st.tuples(numberish, numberish).map("-".join)))
def test_last_event_id_is_valid_for_redis_or_a_400(redis_server_url: str, value: str) -> None:
    try:
        after = parse_last_event_id(value)
    except errors.InvalidRequest:
        return
    # What we accept, Redis accepts: no error once the stream has started.
    client = redis.Redis.from_url(redis_server_url)
    try:
        client.xread({"header-fuzz:out": after}, count=1)
    finally:
        client.close()
