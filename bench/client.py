"""A lean session client for load generation (aiohttp: cheaper per request than httpx)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

SESSIONS = "/v1/streaming_input/sessions"


class SessionClient:
    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self._http = http
        self._base = base_url + SESSIONS

    async def create(self, **body: Any) -> str:
        async with self._http.post(self._base, json=body) as response:
            payload = await response.json()
            if response.status != 201:
                raise RuntimeError(f"create: {response.status} {payload}")
            return payload["session_id"]

    async def append(self, session_id: str, sequence_id: int, text: str, *, end: bool = False) -> dict:
        chunk = {"sequence_id": sequence_id, "text": text, "end_of_input": end}
        async with self._http.post(f"{self._base}/{session_id}/chunks", json=chunk) as response:
            payload = await response.json()
            if response.status not in (200, 202):
                raise RuntimeError(f"append: {response.status} {payload}")
            return payload

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
