"""The relay's two hot calls, written below redis-py's command layer.

redis-py encodes every argument through its Encoder and does bookkeeping
per command and per pipeline (reply callbacks, observability, field-set
imports). For most calls that is noise; for the relay it was a third of the
replica's CPU (bench/README.md, section 2, "Issue #17, third pass"): the
stream reader's XREAD names every followed stream (400 arguments at 200
sessions) and runs several times per engine step, and the publish pipeline
holds one EVALSHA per streaming session. Here those commands are written as
RESP directly (a quarter of redis-py's packing time per command, measured here),
and their replies taken as the parser (hiredis) gives them, without redis-py's
reply callbacks: maps and lists of bytes, as RESP3 (redis-py's default
protocol, which ``connection.store_url`` keeps) has them.

A call takes a connection from the client's pool and gives it back. A call
that fails or is cancelled mid-way closes the connection first, since a
reply may be left unread on it (redis-py does the same).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

#: One or more commands, RESP-encoded, as text (encoded once, when sent).
Packed = list[str]


def arg(value: str | int) -> str:
    """One argument as a RESP bulk string (its length counted in UTF-8 bytes)."""
    text = value if isinstance(value, str) else str(value)
    size = len(text) if text.isascii() else len(text.encode())
    return f"${size}\r\n{text}\r\n"


def command(args: Iterable[str]) -> Packed:
    """A command from arguments already encoded by ``arg``."""
    packed = list(args)
    return [f"*{len(packed)}\r\n", *packed]


async def call(client: aioredis.Redis, commands: Packed, replies: int) -> list[Any]:
    """Send ``commands`` (one or more, packed) in one write; their ``replies``, in order.

    An error reply (a script's error, NOSCRIPT) is returned in its place as
    the ``ResponseError`` redis-py would raise, so one failing command of a
    pipeline does not fail the others.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
    try:
        # One buffer, encoded once: the transport writes a list piece by piece
        # (hundreds of pieces per XREAD), and text formats faster than bytes.
        # The health check is redis-py's: a PING first on a connection idle 30 s.
        await connection.send_packed_command("".join(commands).encode())
        out: list[Any] = []
        for _ in range(replies):
            try:
                out.append(await connection.read_response())
            except ResponseError as exc:
                out.append(exc)
        return out
    except BaseException:
        await connection.disconnect(nowait=True)  # replies may be left unread on it
        raise
    finally:
        await pool.release(connection)
