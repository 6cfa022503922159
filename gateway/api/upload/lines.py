"""NDJSON records read from an ASGI request body as it arrives."""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from gateway import errors


class NdjsonReader:
    """One record (line) at a time; blank lines are skipped, each line is capped."""

    def __init__(self, receive: Receive, max_line_bytes: int) -> None:
        self._receive = receive
        self._max = max_line_bytes
        self._buffer = b""
        self.body_done = False
        #: The number of the last line returned (1-based), for error messages.
        self.line = 0

    async def next_line(self) -> bytes | None:
        """The next record, ``None`` at the end of the body; raises ClientDisconnect."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line, self._buffer = self._buffer[:end], self._buffer[end + 1:]
                self.line += 1
                if line.strip():
                    return self._capped(line)
                continue
            if self.body_done:
                line, self._buffer = self._buffer, b""
                if line.strip():
                    self.line += 1
                    return self._capped(line)
                return None
            self._capped(self._buffer)  # a line that is still growing past the cap
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            self._buffer += message.get("body", b"")
            self.body_done = not message.get("more_body", False)

    def _capped(self, line: bytes) -> bytes:
        if len(line) > self._max:
            raise errors.RequestTooLarge(f"an upload record may be at most {self._max} bytes", param=f"line {self.line + 1}")
        return line
