"""A fault-injecting HTTP proxy: real sockets, one request per connection, faults by plan.

Faults are what a load balancer in front of a cluster does to a client:

- ``drop``: forward the request, let the gateway answer it in full, then
  close the client's connection without a byte (the work was done; the
  client cannot know);
- ``502_after``: the same, but answer 502 (the edge lost the reply);
- ``502``: answer 502 without forwarding;
- ``503``: answer 503 with ``Retry-After: 0`` without forwarding (an overloaded edge);
- ``cut:N``: forward and relay the response, but close it after N
  server-sent events (an answer stream broken mid-answer).

The proxy runs its own event loop in a thread, so a blocking client and the
tests' own loop can use it alike.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tests.redis_server import free_port

#: (method, path, headers with lower-case names) -> a fault name, or "pass".
Plan = Callable[[str, str, dict[str, str]], str]

BAD_GATEWAY = (b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: 23\r\n"
               b"Connection: close\r\n\r\n<h1>502 Bad Gateway</h1>")
UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n"
               b"Retry-After: 0\r\nConnection: close\r\n\r\nbusy")
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class FaultProxy:
    """``upstream_ports``: one gateway, or several taken in turn per connection (a round-robin
    load balancer with no affinity)."""

    def __init__(self, upstream_ports: int | list[int], plan: Plan) -> None:
        self.upstream_ports = itertools.cycle([upstream_ports] if isinstance(upstream_ports, int) else upstream_ports)
        self.plan = plan
        self.port = free_port()
        #: (method, path, fault) of every request, in arrival order.
        self.log: list[tuple[str, str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def faults(self, kind: str) -> int:
        return sum(1 for *_, fault in self.log if fault == kind)

    @contextmanager
    def running(self) -> Iterator[FaultProxy]:
        loop = asyncio.new_event_loop()
        started = threading.Event()
        server: asyncio.Server | None = None

        async def serve() -> None:
            nonlocal server
            server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            started.set()

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
        try:
            yield self
        finally:
            async def stop() -> None:
                assert server is not None
                server.close()
                for task in asyncio.all_tasks() - {asyncio.current_task()}:
                    task.cancel()

            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    async def _handle(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            head = await client_in.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = [line for line in lines[1:] if line and not line.lower().startswith("connection:")]
            length = next((int(line.split(":", 1)[1]) for line in headers
                           if line.lower().startswith("content-length:")), 0)
            body = await client_in.readexactly(length)
            named = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in headers)}
            fault = self.plan(method, path, named)
            self.log.append((method, path, fault))
            if fault in ("502", "503"):
                client_out.write(BAD_GATEWAY if fault == "502" else UNAVAILABLE)
                return
            up_in, up_out = await asyncio.open_connection("127.0.0.1", next(self.upstream_ports))
            try:
                # One request per connection: the gateway closes after answering, so EOF ends it.
                up_out.write("\r\n".join([lines[0], *headers, "Connection: close", "", ""]).encode("latin-1") + body)
                await up_out.drain()
                if fault in ("drop", "502_after"):
                    await up_in.read()  # the gateway did the work; the client never hears of it
                    if fault == "502_after":
                        client_out.write(BAD_GATEWAY)
                    return
                events_left = int(fault.split(":")[1]) if fault.startswith("cut:") else None
                await self._relay(up_in, client_out, events_left)
            finally:
                up_out.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            return  # the proxy is stopping: a connection torn down is the point
        finally:
            client_out.close()

    @staticmethod
    async def _relay(up_in: asyncio.StreamReader, client_out: asyncio.StreamWriter, events_left: int | None) -> None:
        """Copy the response; with ``events_left``, stop after that many events of its body."""
        pending = b""
        in_body = False
        while data := await up_in.read(65536):
            if events_left is None:
                client_out.write(data)
                await client_out.drain()
                continue
            pending += data
            if not in_body and b"\r\n\r\n" in pending:  # the response head passes whole
                head, _, pending = pending.partition(b"\r\n\r\n")
                client_out.write(head + b"\r\n\r\n")
                in_body = True
            while in_body and (match := EVENT_END.search(pending)):
                client_out.write(pending[:match.end()])
                pending = pending[match.end():]
                if (events_left := events_left - 1) == 0:
                    await client_out.drain()
                    return
            await client_out.drain()
