"""A one-line progress bar of chunks sent and acknowledged, on stderr, only on a terminal."""

from __future__ import annotations

import time
from typing import TextIO

WIDTH = 30
#: Redraw at most this often: a fast stream of acks must not flood the terminal.
REDRAW_SEC = 0.1


class Progress:
    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.sent, self.acked = total, 0, 0
        self._out, self._enabled = out, enabled
        self._drawn_at = 0.0

    def on_sent(self) -> None:
        self.sent += 1
        self._draw()

    def on_acked(self) -> None:
        self.acked += 1
        self._draw(force=self.acked == self.total)

    def close(self) -> None:
        if self._enabled:
            self._draw(force=True)
            self._out.write("\n")
            self._out.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._enabled or (not force and now - self._drawn_at < REDRAW_SEC):
            return
        self._drawn_at = now
        acked = WIDTH * self.acked // max(1, self.total)
        in_flight = WIDTH * self.sent // max(1, self.total) - acked
        bar = "█" * acked + "▒" * in_flight + "·" * (WIDTH - acked - in_flight)
        self._out.write(f"\r\033[Kinput [{bar}] sent {self.sent}/{self.total}  acked {self.acked}/{self.total}")
        self._out.flush()
