"""The async client: sessions of the streaming-input API with retries and resumable answers.

Every call is independent of the replica that served the one before (no
cookies, no affinity): the session lives in the gateway's Redis, chunks are
deduplicated there and the answer resumes from its last event id, so the
client works the same against one gateway or a cluster behind a load balancer.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import httpx

from omni_client.answer import (
    AnswerEvent,
    Result,
    SseParser,
    TextDelta,
    events_of,
    result_of,
    resumable_end,
)
from omni_client.chunks import chunk_of
from omni_client.errors import APIError, OmniError, TransportFailed, api_error
from omni_client.retry import (
    Outage,
    RetryPolicy,
    describe,
    retry_after_of,
    retryable_error,
    retryable_status,
)

DEFAULT_URL = "http://127.0.0.1:8080"
SESSIONS = "/v1/streaming_input/sessions"
#: How long a long-poll of the result waits on the server, per request.
RESULT_POLL_SEC = 30.0
#: How long an answer stream may stay silent before it is reconnected (the gateway pings every 15 s).
STREAM_READ_TIMEOUT_SEC = 60.0


@dataclass(frozen=True)
class ChunkAck:
    """The gateway stored the chunk (``duplicate``: an earlier try already had)."""

    sequence_id: int
    duplicate: bool
    started: bool
    state: str
    next_sequence_id: int


@dataclass(frozen=True)
class FinishAck:
    state: str
    next_sequence_id: int
    missing_sequence_ids: list[int]


class AsyncClient:
    """``async with AsyncClient(url, api_key) as client: session = await client.create_session(...)``."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 30.0,
                 retry: RetryPolicy | None = None, http_client: httpx.AsyncClient | None = None) -> None:
        """``http_client``: an httpx client of your own (a transport, proxies), used as is:
        its base URL and headers, not ``base_url`` and ``api_key``."""
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def create_session(self, *, idempotency_key: str | None = None, **body: Any) -> AsyncSession:
        """A new session; ``body`` is the create body (``messages``, ``start_policy``,
        ``modalities``, ``max_tokens``, ``temperature``, ...), sent as is.

        Sent with an ``Idempotency-Key`` (``idempotency_key``, else a new UUID),
        so it is retried like any other call: a repeat the gateway already
        served returns the same session, never a second one."""
        key = idempotency_key or str(uuid.uuid4())
        response = await self.request("POST", SESSIONS, json=body, headers={"Idempotency-Key": key})
        first = (body.get("first_chunk") or {}).get("sequence_id")
        return AsyncSession(self, response.json()["session_id"], 0 if first is None else first + 1)

    async def session(self, session_id: str) -> AsyncSession:
        """An existing session (e.g. made by another process); chunks continue after its last."""
        view = await AsyncSession(self, session_id).view()
        return AsyncSession(self, session_id, int(view["next_sequence_id"]))

    def stream(self, method: str, path: str, **kwargs: Any) -> AbstractAsyncContextManager[httpx.Response]:
        """One streamed response, no retries (the caller resumes it: see ``AsyncSession.answer``)."""
        return self._http.stream(method, path, **kwargs)

    async def request(self, method: str, path: str, *, idempotent: bool = True,
                      **kwargs: Any) -> httpx.Response:
        """One API call with retries; a 2xx/3xx response, else a typed :class:`OmniError`."""
        attempt = 0
        outage = Outage()
        while True:
            error: OmniError
            retry_after = None
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error = TransportFailed(f"{method} {path}: {describe(exc)}", exc)
                retry = retryable_error(exc, idempotent)
            else:
                if response.status_code < 400:
                    return response
                retry_after = retry_after_of(response)
                error = api_error(response.status_code, response.content, retry_after)
                retry = retryable_status(response.status_code, idempotent, error.code)
            lasted = outage.seen(error.code if isinstance(error, APIError) else "", anyio.current_time())
            delay = self.retry.delay(attempt, retry_after, store_outage_for=lasted) if retry else None
            if delay is None:
                raise error
            attempt += 1
            await anyio.sleep(delay)


class AsyncSession:
    """One session: ``send`` numbers chunks 0, 1, 2, ...; ``answer()`` streams the reply."""

    def __init__(self, client: AsyncClient, session_id: str, next_sequence_id: int = 0) -> None:
        self.client = client
        self.id = session_id
        #: The sequence id the next ``send`` takes.
        self.next_sequence_id = next_sequence_id
        self._path = f"{SESSIONS}/{session_id}"

    async def send(self, data: Any, *, end_of_input: bool = False, sample_rate: int | None = None,
                   sequence_id: int | None = None) -> ChunkAck:
        """Append one chunk (text, pcm16 bytes, a numpy array, WAV bytes or path).

        The id is taken when the call starts, so sends may run concurrently.
        Each retry repeats the same id and bytes: the gateway stores it once.
        If it still fails the error carries ``sequence_id``; send the same
        data again with that ``sequence_id`` to fill the gap.
        """
        chunk = chunk_of(data, sample_rate)
        if sequence_id is None:
            sequence_id = self.next_sequence_id
            self.next_sequence_id += 1
        try:
            response = await self.client.request("POST", f"{self._path}/chunks", content=chunk.body,
                                                 headers=chunk.headers(sequence_id, end_of_input))
        except OmniError as exc:
            exc.sequence_id = sequence_id
            raise
        body = response.json()
        return ChunkAck(sequence_id, body["duplicate"], body["started"], body["state"], body["next_sequence_id"])

    async def finish(self, final_sequence_id: int | None = None) -> FinishAck:
        """End of input (idempotent); by default the last id this session object sent."""
        final = self.next_sequence_id - 1 if final_sequence_id is None else final_sequence_id
        response = await self.client.request("POST", f"{self._path}/finish",
                                             json={"final_sequence_id": final} if final >= 0 else {})
        body = response.json()
        return FinishAck(body["state"], body["next_sequence_id"], body["missing_sequence_ids"])

    async def answer(self, last_event_id: str | None = None) -> AsyncGenerator[AnswerEvent, None]:
        """The answer's events as they stream; a broken stream is resumed from its last event id.

        Ends after the final frame; an ``error`` event raises :class:`SessionFailed`, but for
        one that ends the stream and not the session (``resumable``: the replica serving it
        stopped, or the gateway's Redis stayed away too long), which is read on from the last
        event id like a stream that broke.
        Gives up (the last error) after ``retry.attempts`` reconnects in a row without a frame,
        or, while the gateway says its store is unavailable, after ``retry.store_outage_sec``.
        """
        failures = 0
        outage = Outage()
        while True:
            error: OmniError | None = None
            retry_after = None
            headers = {"Accept": "text/event-stream"} | ({"Last-Event-ID": last_event_id} if last_event_id else {})
            try:
                async with self.client.stream(
                        "GET", f"{self._path}/events", headers=headers,
                        timeout=httpx.Timeout(self.client.timeout, read=STREAM_READ_TIMEOUT_SEC)) as response:
                    if response.status_code == 204:  # the final frame was the last one we saw
                        return
                    if response.status_code >= 400:
                        await response.aread()
                        retry_after = retry_after_of(response)
                        error = api_error(response.status_code, response.content, retry_after)
                        if not retryable_status(response.status_code, idempotent=True):
                            raise error
                    else:
                        parser = SseParser()
                        async for line in response.aiter_lines():
                            if (event := parser.line(line)) is None:
                                continue
                            if (ended := resumable_end(event)) is not None:
                                # The session goes on (elsewhere, or once Redis is back): read on from the last id.
                                error = ended
                                break
                            if event.id:
                                last_event_id, failures, outage.since = event.id, 0, None
                            for item in events_of(event):
                                yield item
                            if event.data == "[DONE]":
                                return
            except httpx.TransportError as exc:
                error = TransportFailed(f"GET {self._path}/events: {describe(exc)}", exc)
            lasted = outage.seen(error.code if isinstance(error, APIError) else "", anyio.current_time())
            delay = self.client.retry.delay(failures, retry_after, store_outage_for=lasted)
            if delay is None:
                raise error or TransportFailed(f"GET {self._path}/events: the stream kept ending early")
            failures += 1
            await anyio.sleep(delay)

    async def text(self) -> str:
        """The answer's text, once it is complete (read from the stream)."""
        return "".join([event.text async for event in self.answer() if isinstance(event, TextDelta)])

    async def result(self, wait: float | None = None) -> Result:
        """The outcome once the session ends, waiting up to ``wait`` seconds (``None``: as long
        as it takes) in long polls; a failed session raises ``SessionFailed``."""
        deadline = None if wait is None else anyio.current_time() + wait
        while True:
            poll = RESULT_POLL_SEC if deadline is None else max(0.0, min(RESULT_POLL_SEC, deadline - anyio.current_time()))
            response = await self.client.request("GET", f"{self._path}/result", params={"wait": round(poll, 3)},
                                                 timeout=self.client.timeout + poll)
            if response.status_code == 200:
                return result_of(response.json())
            if deadline is not None and anyio.current_time() >= deadline:
                raise OmniError(f"session {self.id} is still {response.json().get('state')} after {wait} s")

    async def view(self) -> dict[str, Any]:
        """The session's state and counters (``GET .../{id}``)."""
        response = await self.client.request("GET", self._path)
        view: dict[str, Any] = response.json()
        return view

    async def cancel(self) -> None:
        """Abort the session (its engine work stops); cancelling an ended session is a no-op."""
        try:
            await self.client.request("DELETE", self._path)
        except APIError as exc:
            if exc.status != 409:
                raise
