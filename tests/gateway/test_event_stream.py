"""The SSE response (gateway/web/event_stream.py) against a bare ASGI server side.

The routes' own tests (sessions, chat, uploads) run it through uvicorn and
real clients; these pin down how a stream ends: its events run out, the
client leaves, the client stops reading, the server stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sse_starlette import ServerSentEvent

from gateway.output.sse import FrameEvent
from gateway.web.event_stream import EventStream
from gateway.work.draining import Draining

HTTP_GET = {"type": "http", "method": "GET"}


class Client:
    """The ASGI side of one response: what it was sent; ``leave`` disconnects, ``stall`` stops reading."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.left = asyncio.Event()
        self.stalled = False

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.stalled:
            await asyncio.Event().wait()  # a full socket buffer that never drains
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    @property
    def ended(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.messages)


class Events:
    """An events generator that records whether its clean-up ran."""

    def __init__(self, count: int, *, then_wait: bool = False) -> None:
        self.count, self.then_wait, self.cleaned_up = count, then_wait, False

    async def __call__(self) -> AsyncIterator[ServerSentEvent]:
        try:
            for n in range(self.count):
                yield FrameEvent(data=f"frame {n}", id=f"1-{n}")
            if self.then_wait:
                await asyncio.Event().wait()
        finally:
            self.cleaned_up = True


def stream(events: Events, draining: Draining | None = None, **options: Any) -> EventStream:
    return EventStream(events(), ping_sec=options.pop("ping_sec", 60), draining=draining or Draining(), **options)


async def test_events_go_out_in_order_then_the_response_ends() -> None:
    client, events = Client(), Events(3)
    await stream(events, headers={"X-Session-Id": "s1"})(HTTP_GET, client.receive, client.send)
    start = client.messages[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-session-id"] == b"s1"
    assert client.body == b"".join(f"id: 1-{n}\ndata: frame {n}\n\n".encode() for n in range(3))
    assert client.ended and events.cleaned_up


async def test_a_client_that_leaves_ends_the_stream_and_its_generator_cleans_up() -> None:
    client, events = Client(), Events(1, then_wait=True)
    response = asyncio.create_task(stream(events)(HTTP_GET, client.receive, client.send))
    await asyncio.sleep(0.05)
    client.left.set()
    await asyncio.wait_for(response, 2)
    assert b"frame 0" in client.body and events.cleaned_up


@pytest.mark.parametrize("frames", [0, 1])
async def test_an_idle_stream_gets_keep_alives_that_no_parser_takes_for_an_event(frames: int) -> None:
    """Before any id (a stream of OpenAI's shape): empty lines. After one: comment lines with no
    blank line (the openai SDK takes a blank line after an id for an event)."""
    client, events = Client(), Events(frames, then_wait=True)
    response = asyncio.create_task(stream(events, ping_sec=0.1)(HTTP_GET, client.receive, client.send))
    await asyncio.sleep(0.35)
    if frames:
        after = client.body.split(b"frame 0\n\n", 1)[1]
        assert after.count(b": ping - ") >= 2 and b"\n\n" not in after
    else:
        assert client.body.count(b"\n") >= 2 and client.body.strip() == b""
    client.left.set()
    await asyncio.wait_for(response, 2)


async def test_a_client_that_stopped_reading_is_dropped_after_the_send_timeout() -> None:
    client, events = Client(), Events(1, then_wait=True)
    response = stream(events, ping_sec=0.05, send_timeout_sec=0.2)

    async def stalls_after_the_headers(message: dict[str, Any]) -> None:
        await client.send(message)
        client.stalled = True  # the first frame never goes out

    await asyncio.wait_for(response(HTTP_GET, client.receive, stalls_after_the_headers), 2)
    assert client.body == b"" and not client.ended
    assert events.cleaned_up, "the generator, suspended at its yield, was closed"


async def test_an_idle_client_that_stopped_reading_is_dropped_at_a_ping() -> None:
    client, events = Client(), Events(0, then_wait=True)
    response = stream(events, ping_sec=0.05, send_timeout_sec=0.2)
    task = asyncio.create_task(response(HTTP_GET, client.receive, client.send))
    await asyncio.sleep(0.01)
    client.stalled = True
    await asyncio.wait_for(task, 2)
    assert events.cleaned_up


async def test_a_stopping_server_ends_an_unfinished_stream_with_an_error_after_its_grace() -> None:
    client, events, draining = Client(), Events(2, then_wait=True), Draining(grace_sec=0.3)
    response = asyncio.create_task(stream(events, draining)(HTTP_GET, client.receive, client.send))
    await asyncio.sleep(0.05)
    draining.close()
    await asyncio.sleep(0.15)
    assert not response.done(), "a stream goes on for the grace period"
    await asyncio.wait_for(response, 2)
    assert client.body.count(b"data: frame") == 2
    # Never a bare end, which a client takes for a complete answer: an explicit error, then the end.
    tail = client.body.rsplit(b"data: frame", 1)[1]
    assert b"event: error" in tail and b"replica_stopping" in tail and b'"resumable": true' in tail
    assert client.ended
    assert events.cleaned_up


async def test_a_stream_that_ends_within_the_grace_period_ends_as_it_would() -> None:
    client, events, draining = Client(), Events(2), Draining(grace_sec=5)
    draining.close()
    await asyncio.wait_for(stream(events, draining)(HTTP_GET, client.receive, client.send), 2)
    assert client.body.count(b"data: frame") == 2 and b"replica_stopping" not in client.body and client.ended


async def test_head_sends_the_headers_only() -> None:
    client, events = Client(), Events(0, then_wait=True)
    await asyncio.wait_for(stream(events)({"type": "http", "method": "HEAD"}, client.receive, client.send), 2)
    assert client.messages[0]["status"] == 200 and client.body == b"" and client.ended


async def test_a_failing_generator_fails_the_response_after_its_other_parts_stop() -> None:
    async def failing() -> AsyncIterator[ServerSentEvent]:
        yield ServerSentEvent(data="one")
        raise RuntimeError("boom")

    client = Client()
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(EventStream(failing(), ping_sec=60, draining=Draining())(
            HTTP_GET, client.receive, client.send), 2)


@given(data=st.text(), event=st.one_of(st.none(), st.sampled_from(["transcript", "error", "a\nb"])),
       frame_id=st.one_of(st.none(), st.from_regex(r"\A[0-9]{1,13}-[0-9]{1,3}\Z")))
def test_a_stored_frame_encodes_as_server_sent_event_does(data: str, event: str | None,
                                                           frame_id: str | None) -> None:
    """The relay's lean encoding of a frame: byte for byte sse_starlette's with OpenAI's line ends
    (``\n``), line breaks in the data and all."""
    lean = FrameEvent(data=data, event=event, id=frame_id).encode()
    assert lean == ServerSentEvent(data=data, event=event, id=frame_id, sep="\n").encode()
