"""NDJSON records read from an ASGI request body as it arrives.

Linear in the body: the buffer is one ``bytearray`` read from an offset, so
taking a line off the front copies only that line, and a line still arriving
is searched for its end only in the bytes that are new. Cutting ``buffer[end
+ 1:]`` per line instead copied the whole rest of the buffer every time:
256 KiB of blank lines held the event loop for 1.2 s.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from gateway import errors

#: Blank lines in a row an upload may send (a client's keep-alive between
#: records, one a second, fits many times over); more is not a keep-alive.
MAX_BLANK_LINES = 1_000


class NdjsonReader:
    """One record (line) at a time; blank lines are skipped (at most ``MAX_BLANK_LINES`` in a row),
    each line is capped."""

    def __init__(self, receive: Receive, max_line_bytes: int) -> None:
        self._receive = receive
        self._max = max_line_bytes
        self._buffer = bytearray()
        #: Where the unread part of ``_buffer`` starts.
        self._start = 0
        #: How far past ``_start`` is known to hold no newline.
        self._scanned = 0
        self._blank_run = 0
        self.body_done = False
        #: The number of the last line returned (1-based), for error messages.
        self.line = 0

    async def next_line(self) -> bytes | None:
        """The next record, ``None`` at the end of the body; raises ClientDisconnect."""
        while True:
            line = self._take_line()
            if line is not None:
                if self._is_record(line):
                    return line
                continue
            if self.body_done:
                rest = bytes(self._buffer[self._start:])
                self._buffer.clear()
                self._start = self._scanned = 0
                if rest.strip():
                    self.line += 1
                    self._check_size(len(rest), self.line)
                    return rest
                return None
            await self._read_more()

    def _take_line(self) -> bytes | None:
        """The next complete line off the front of the buffer, without its newline."""
        end = self._buffer.find(b"\n", self._start + self._scanned)
        if end < 0:
            self._scanned = len(self._buffer) - self._start
            self._check_size(self._scanned, self.line + 1)  # a line that is still growing past the cap
            return None
        line = bytes(self._buffer[self._start:end])
        self._start, self._scanned = end + 1, 0
        self.line += 1
        return line

    def _is_record(self, line: bytes) -> bool:
        if line.strip():
            self._blank_run = 0
            self._check_size(len(line), self.line)
            return True
        self._blank_run += 1
        if self._blank_run > MAX_BLANK_LINES:
            raise errors.InvalidRequest(f"an upload may not send more than {MAX_BLANK_LINES} blank lines in a row",
                                        param=f"line {self.line}")
        return False

    async def _read_more(self) -> None:
        # Drop what was read before appending: the buffer holds only the unread part.
        del self._buffer[:self._start]
        self._start = 0
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        self._buffer += message.get("body", b"")
        self.body_done = not message.get("more_body", False)

    def _check_size(self, size: int, line: int) -> None:
        if size > self._max:
            raise errors.RequestTooLarge(f"an upload record may be at most {self._max} bytes", param=f"line {line}")
