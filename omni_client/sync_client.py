"""The blocking client: the async client run on a private event loop thread.

One implementation of the protocol, not two: every method hands the async
one to an anyio blocking portal (a loop in a thread of this client's own)
and waits for it, so retries, dedupe and stream resumption behave exactly
alike in both. Not for use from inside a running event loop: use
:class:`~omni_client.AsyncClient` there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from omni_client.answer import AnswerEvent, Result
from omni_client.async_client import DEFAULT_URL, AsyncClient, AsyncSession, ChunkAck, FinishAck
from omni_client.retry import RetryPolicy


class Client:
    """``with Client(url, api_key) as client: session = client.create_session(...)``."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *, timeout: float = 30.0,
                 retry: RetryPolicy | None = None) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()

        async def make() -> AsyncClient:  # httpx's async client belongs to the portal's loop
            return AsyncClient(base_url, api_key, timeout=timeout, retry=retry)

        self._client = self._portal.call(make)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._portal.call(self._client.aclose)
        self._portal_cm.__exit__(None, None, None)

    def create_session(self, **body: Any) -> Session:
        return Session(self._portal, self._portal.call(lambda: self._client.create_session(**body)))

    def session(self, session_id: str) -> Session:
        return Session(self._portal, self._portal.call(self._client.session, session_id))


class Session:
    """The blocking twin of :class:`~omni_client.AsyncSession` (same methods, same semantics)."""

    def __init__(self, portal: BlockingPortal, session: AsyncSession) -> None:
        self._portal = portal
        self._session = session

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def next_sequence_id(self) -> int:
        return self._session.next_sequence_id

    def send(self, data: Any, *, end_of_input: bool = False, sample_rate: int | None = None,
             sequence_id: int | None = None) -> ChunkAck:
        return self._portal.call(lambda: self._session.send(
            data, end_of_input=end_of_input, sample_rate=sample_rate, sequence_id=sequence_id))

    def finish(self, final_sequence_id: int | None = None) -> FinishAck:
        return self._portal.call(self._session.finish, final_sequence_id)

    def answer(self, last_event_id: str | None = None) -> Iterator[AnswerEvent]:
        stream = self._session.answer(last_event_id)
        try:
            while True:
                try:
                    yield self._portal.call(stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            # A loop left unfinished closes its stream; after Client.close the portal is gone,
            # and so is the stream with it.
            with contextlib.suppress(RuntimeError):
                self._portal.call(stream.aclose)

    def text(self) -> str:
        return self._portal.call(self._session.text)

    def result(self, wait: float | None = None) -> Result:
        return self._portal.call(self._session.result, wait)

    def view(self) -> dict[str, Any]:
        return self._portal.call(self._session.view)

    def cancel(self) -> None:
        self._portal.call(self._session.cancel)
