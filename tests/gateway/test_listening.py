"""A replica's port: bound at once, refusing connections while the app starts, served once it is up.

The real ``DrainingServer`` (uvicorn) on a socket from ``bind_tcp``, with an app
whose start the test holds, as a model loading holds a replica's.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.runtime.listeners import ListenError, bind_tcp
from gateway.runtime.processes import DrainingServer
from gateway.work.draining import Draining


class HeldStart:
    """An ASGI app whose lifespan start waits for ``release``; it answers ``up`` after."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await asyncio.to_thread(self.release.wait)
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"up"})


@contextmanager
def serving(app: HeldStart, listener: socket.socket) -> Iterator[dict[str, BaseException]]:
    """The server in a thread of its own; what it raised, once it has stopped."""
    server = DrainingServer(uvicorn.Config(app, lifespan="on", log_level="warning"), Draining(1.0), drain_sec=0)
    raised: dict[str, BaseException] = {}

    def run() -> None:
        try:
            server.run(sockets=[listener])
        except BaseException as exc:  # SystemExit included: the test reads it
            raised["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield raised
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            assert httpx.get(url, timeout=1).text == "up"
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "never served after its start"
            time.sleep(0.05)


def test_connections_are_refused_while_the_app_starts_and_served_after() -> None:
    listener = bind_tcp("127.0.0.1", 0, "--port")
    port = listener.getsockname()[1]
    app = HeldStart()
    with serving(app, listener):
        for _ in range(5):  # refused at once, not accepted and held until the start ends
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            time.sleep(0.05)
        app.release.set()
        wait_up(f"http://127.0.0.1:{port}/")


def test_a_port_two_replicas_bound_while_starting_goes_to_the_first_up_and_the_other_says_why() -> None:
    first = bind_tcp("127.0.0.1", 0, "--port")
    port = first.getsockname()[1]
    second = bind_tcp("127.0.0.1", port, "--port")  # neither listens yet: the kernel lets both bind
    first_app, second_app = HeldStart(), HeldStart()
    with serving(first_app, first):
        first_app.release.set()
        wait_up(f"http://127.0.0.1:{port}/")
        with serving(second_app, second) as second_raised:
            second_app.release.set()
            deadline = time.monotonic() + 10
            while "error" not in second_raised:
                assert time.monotonic() < deadline, "the second replica neither failed nor stopped"
                time.sleep(0.05)
        error = second_raised["error"]
        assert isinstance(error, ListenError), error
        assert f"cannot listen on 127.0.0.1:{port}: another process is listening there" in str(error.code)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=2).text == "up", "the first one serves on"
