"""The sockets a replica listens on, bound before anything loads.

uvicorn binds its socket only after the app's lifespan started, which for a
replica means after the model loaded (a minute or more): a port another
process holds would fail the replica that late, with uvicorn's bare errno.
So the replica binds every socket it needs first, and a conflict stops it in
its first second with a message naming the address and the setting that
moves it. uvicorn is then handed the bound sockets, and listens on them once
the app has started: until then a connection is refused, not held.

A replica needs one TCP port, the public one. With API workers the engine
process serves its own copy of the app (its probes, its metrics) on a Unix
socket in the replica's runtime folder (``ReplicaDir``), not on a second TCP
port, so replicas on adjacent ports never collide; ``--engine-port`` puts
it on a loopback port instead, for those who want one.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

#: Pending connections a socket holds while every process is busy.
BACKLOG = 2048
#: A Unix socket's path must fit in sockaddr_un (108 bytes on Linux, with its NUL):
#: a long replica id (a pod name, a hostname) is shortened to stay well inside.
MAX_DIR_NAME = 48


class ListenError(SystemExit):
    """A socket the replica needs cannot be bound: exits the process with the reason."""


def bind_tcp(host: str, port: int, setting: str) -> socket.socket:
    """A TCP socket bound to ``host:port``, inheritable by the API workers, not listening yet.

    uvicorn listens on it once the app has started (asyncio's ``create_server``
    calls ``listen``). A socket that listened from the start had the kernel accept
    every connection while the engine loaded and hold it until the app was up
    (~25 s): an edge without health checks (NGINX's round robin) sent requests to
    a restarting replica to wait there. Refused, they go to the next replica at once.

    ``setting`` is how the user moves it (``--port``), named in the error.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError as error:
        raise ListenError(_cannot_listen(f"{host}:{port}", error, setting)) from error
    try:
        # As socket.create_server does: a restart may bind beside its killed self's
        # TIME_WAIT connections, and an IPv6 address takes IPv6 only.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ListenError(_cannot_listen(f"{host}:{port}", error, setting)) from error
    listener.set_inheritable(True)
    return listener


def is_listening(listener: socket.socket) -> bool:
    return listener.fileno() != -1 and bool(listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def listen_failed(error: OSError, address: tuple[Any, ...]) -> str:
    """Why a bound socket could not listen: another process bound the port at the
    same time (SO_REUSEADDR lets two sockets bind one port while neither listens)
    and listened first."""
    return _cannot_listen(f"{address[0]}:{address[1]}", error, "--port")


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale file from a killed replica is replaced)."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(BACKLOG)
    except OSError as error:
        listener.close()
        # The folder is TMPDIR's, named after the replica.
        raise ListenError(_cannot_listen(str(path), error, "TMPDIR or OMNI_GATEWAY_REPLICA_ID")) from error
    return listener


def _cannot_listen(address: str, error: OSError, setting: str) -> str:
    reason = "another process is listening there" if error.errno == errno.EADDRINUSE else error.strerror
    return f"omni-gateway: cannot listen on {address}: {reason} ({error}); choose another with {setting}"


class ReplicaDir:
    """This replica's runtime folder: its processes' metrics files and the engine process's socket.

    Named after the replica and emptied first: a replica started again after
    a kill (in a pod, ``/tmp`` outlives the container) starts from zero and
    leaves no folder behind per restart.
    """

    def __init__(self, replica_id: str, root: Path | None = None) -> None:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", replica_id)
        if len(name) > MAX_DIR_NAME:
            digest = hashlib.sha256(replica_id.encode()).hexdigest()[:12]
            name = f"{name[:MAX_DIR_NAME - 13]}-{digest}"
        self.path = (root or Path(tempfile.gettempdir())) / f"omni-gateway-{name}"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics"

    @property
    def engine_socket(self) -> Path:
        return self.path / "engine.sock"

    def create(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.metrics.mkdir(parents=True)
        os.chmod(self.path, 0o700)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
