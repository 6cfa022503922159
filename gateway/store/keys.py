"""Every Redis key name the gateway uses, in one place.

All keys of one session share the hash tag ``{<session id>}`` so the
multi-key Lua scripts run on Redis Cluster (one slot per session). The
schedule is the only session index outside a session's slot; it is a hint
for the tenders, never the truth (the truth is ``expires_at``, ``owner`` and
``lease_until`` in the meta hash).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

PREFIX = "sis"

#: Sorted set: session id -> the time (ms) a tender should look at it again
#: (idle deadline, lease expiry, or now for engine work waiting for an owner).
SCHEDULE = f"{PREFIX}:schedule"


#: Hash: session id -> how many tender rounds in a row its script failed in
#: (``lua/quarantine.lua``). Its hash tag is the schedule's whole name, so it
#: shares the schedule's cluster slot.
SCHEDULE_FAILURES = "{" + SCHEDULE + "}:failures"
#: Hash: session id -> the error that took it out of the schedule for good.
DEAD_LETTERS = "{" + SCHEDULE + "}:dead-letters"


#: Counter: written after each acknowledged script with ``redis_durability=replica``, so the
#: connection's ``WAIT`` covers what the script stored, even a duplicate (store/durability.py).
DURABLE_MARK = f"{PREFIX}:durable-mark"


class Channels(NamedTuple):
    """The pub/sub channels every process of a deployment listens on.

    Redis's pub/sub spans the server, not a database: two deployments sharing one Redis server
    (databases 0 and 1) would hear each other's. Their names carry the database (but 0's), so an
    ask is answered only by processes that write the answer where the asker reads it.
    """

    #: Engine work was left waiting for an owner (an API worker, or a replica without room,
    #: started it). Tenders wake on it instead of waiting for their next round; the schedule
    #: stays the truth.
    work_waiting: str
    #: A hang-up of a WebRTC call that reached a process not holding it (the edge round robins);
    #: every process holding calls listens.
    call_hang_ups: str
    #: A backend's control socket (``?call_id=``) reached a process not holding the call; the
    #: holder relays the call through ``call_sideband`` channels.
    call_attaches: str


def channels(database: int) -> Channels:
    # Database 0 keeps the names of the releases before, so processes of both talk during a
    # rolling deploy (a hang-up reaching the other release's process is still heard).
    base = PREFIX if database == 0 else f"{PREFIX}:db{database}"
    return Channels(work_waiting=f"{base}:work-waiting", call_hang_ups=f"{base}:call-hang-ups",
                    call_attaches=f"{base}:call-attaches")


def call_hang_up_reply(nonce: str) -> str:
    """List (short-lived): where the process that held a call says it did what was asked."""
    return f"{PREFIX}:call-hang-up:{{{nonce}}}"


def call_sideband(attachment: str, direction: str) -> str:
    """Pub/sub channel of one control socket on another process's call: ``out`` carries the
    call's events to the socket, ``in`` the socket's client events to the call."""
    return f"{PREFIX}:call-sideband:{attachment}:{direction}"


def engine_card(replica: str) -> str:
    """String (JSON, with a TTL the engine process keeps renewing): what the
    replica's engine takes and produces, for its API workers, which open none."""
    return f"{PREFIX}:engine:{{{replica}}}"


#: Sorted set of every open session (global cap), scored like identity_sessions;
#: members are "<session id> <identity>" (so a sweep can free both slots).
OPEN_SESSIONS = f"{PREFIX}:open-sessions"


def identity_sessions(identity: str) -> str:
    """Sorted set: the open sessions of one identity, scored by when they stop counting."""
    return f"{PREFIX}:identity:{{{identity}}}:sessions"


def idempotency(identity: str, key_digest: str) -> str:
    """String: the session (and a digest of its request) an identity's ``Idempotency-Key`` made."""
    return f"{PREFIX}:identity:{{{identity}}}:idem:{key_digest}"


def identity_rate(identity: str) -> str:
    """Hash: the token bucket of one identity."""
    return f"{PREFIX}:identity:{{{identity}}}:rate"


def realtime_conversation(conversation_id: str) -> str:
    """String: a Realtime connection's state (settings, history, the open turn), for a reconnect."""
    return f"{PREFIX}:realtime:{{{conversation_id}}}"


def client_secret(digest: str) -> str:
    """String (JSON, expiring with the secret): who a Realtime client secret speaks for.

    Named by the secret's digest, so a dump of Redis holds no usable secret."""
    return f"{PREFIX}:client-secret:{{{digest}}}"


def reader_wake(reader_id: str) -> str:
    """Stream: wake-up marks for one replica's stream reader (store/stream_reader.py)."""
    return f"{PREFIX}:reader:{{{reader_id}}}:wake"


class SessionKeys(NamedTuple):
    #: Hash: state, counters, settings and the stored result.
    meta: str
    #: Hash: sequence id -> chunk record (header line + payload bytes).
    chunks: str
    #: Hash: sequence id -> "<sha256>:<bytes>:<audio ms>:<min tokens>" for dedupe and counting;
    #: and, once a chunk was replaced (update mode), "tokens:<sequence id>" -> that chunk's token
    #: mark, "<tokens before it>:<base64 pending bytes>" (service/token_marks.py, lua/mark_tokens.lua).
    digests: str
    #: Stream: newly contiguous sequence ids, then "end" or "abort", for the owner.
    input: str
    #: Stream: output frames; entry ids are the SSE event ids.
    output: str


@functools.lru_cache(maxsize=4096)  # every store call of a session names them: a publish per token
def session_keys(session_id: str) -> SessionKeys:
    base = f"{PREFIX}:{{{session_id}}}"
    return SessionKeys(
        meta=f"{base}:meta",
        chunks=f"{base}:chunks",
        digests=f"{base}:digests",
        input=f"{base}:in",
        output=f"{base}:out",
    )
