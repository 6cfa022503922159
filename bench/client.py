"""A lean session client for load generation (aiohttp: cheaper per request than httpx)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

SESSIONS = "/v1/streaming_input/sessions"
OVERLOADED_TRIES = 50


class SessionClient:
    def __init__(self, http: aiohttp.ClientSession, base_url: str, *, patient: bool = False) -> None:
        """``patient``: appends refused with ``503 overloaded`` are sent again (creates always are);
        the append benchmarks count refusals themselves, the relay and memory parts just need the chunk in."""
        self._http = http
        self._base = base_url + SESSIONS
        self._patient = patient

    async def create(self, **body: Any) -> str:
        # A burst of creates (hundreds of sessions at once) can be refused with
        # 503 overloaded, which did nothing: it is sent again, as a client should.
        payload = await self._post(self._base, body, (201,), "create", patient=True)
        return payload["session_id"]

    async def append(self, session_id: str, sequence_id: int, text: str, *, end: bool = False) -> dict:
        chunk = {"sequence_id": sequence_id, "text": text, "end_of_input": end}
        return await self._post(f"{self._base}/{session_id}/chunks", chunk, (200, 202), "append", patient=self._patient)

    async def _post(self, url: str, body: dict, ok: tuple[int, ...], what: str, *, patient: bool) -> dict:
        for _ in range(OVERLOADED_TRIES if patient else 1):
            async with self._http.post(url, json=body) as response:
                payload = await response.json()
                if response.status in ok:
                    return payload
                if not patient or response.status != 503 or payload["error"]["code"] != "overloaded":
                    raise RuntimeError(f"{what}: {response.status} {payload}")
                # Spread the retries of a burst over the Retry-After the gateway asked for.
                await asyncio.sleep(min(float(response.headers.get("Retry-After", 1)), 1.0) * random.random())
        raise RuntimeError(f"{what}: still overloaded after {OVERLOADED_TRIES} tries")

    async def delete(self, session_id: str) -> None:
        async with self._http.delete(f"{self._base}/{session_id}"):
            pass

    async def content_deltas(self, session_id: str) -> AsyncIterator[tuple[float, str]]:
        """(arrival time, text) of each content delta on the session's SSE stream, until [DONE]."""
        async with self._http.get(f"{self._base}/{session_id}/events",
                                  timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as response:
            if response.status != 200:
                raise RuntimeError(f"events: {response.status} {await response.text()}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                arrived = time.time()
                frame = json.loads(data)
                if "error" in frame:
                    raise RuntimeError(f"session failed: {frame['error']}")
                for choice in frame.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield arrived, text


def http_session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=120))
