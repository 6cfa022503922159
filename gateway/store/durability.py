"""What an acknowledged write survives, by ``redis_durability``.

``everysec`` and ``always`` are Redis's own AOF settings (``appendfsync``):
the deployment sets them on the server, and ``check`` only warns at start
when the server says otherwise (a managed Redis may refuse ``CONFIG GET``).
With ``everysec`` a crash of Redis can take the last second or two of
acknowledged writes (more when a slow disk made Redis postpone its AOF
write); with ``always`` every write is on disk before Redis answers.

``replica`` is the gateway's: each input script is followed, on the same
connection, by ``WAIT 1``, and the 2xx goes out only once a replica has the
write (else 503, and the client's retry is a duplicate). Between the two, a
small write of the same connection moves its replication offset past the
script's even when the script wrote nothing (a duplicate of a chunk stored
earlier, perhaps by a call whose answer was lost), so the replica's
acknowledgement covers the stored chunk either way: replication keeps
order. Sentinel promotes the replica when the primary dies, and the client
(``connection.open_redis``) asks the Sentinels for the new primary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from gateway import errors
from gateway.store.keys import DURABLE_MARK
from gateway.store.scripts import LuaScripts

logger = logging.getLogger(__name__)

Durability = Literal["everysec", "always", "replica"]
#: The scripts whose 2xx a client is told is durable (input and state changes).
ACKNOWLEDGED = frozenset({"create", "append", "finish", "replace", "cancel"})


async def check(client: aioredis.Redis, level: Durability) -> list[str]:
    """What the Redis server says that does not match ``level`` (logged as warnings)."""
    problems: list[str] = []
    try:
        if level == "replica":
            info: Any = await client.info("replication")
            if int(info.get("connected_slaves", 0)) < 1:
                problems.append("redis_durability=replica, but the Redis primary has no replica connected")
        else:
            config: Any = await client.config_get("append*")
            if config.get("appendonly") != "yes" or config.get("appendfsync") != level:
                problems.append(f"redis_durability={level}, but Redis has appendonly {config.get('appendonly')} "
                                f"and appendfsync {config.get('appendfsync')}")
    except ResponseError as exc:  # CONFIG / INFO refused (a managed Redis): nothing to check
        logger.info("durability: Redis's settings cannot be read (%s); not checked", exc)
    for problem in problems:
        logger.warning("durability: %s", problem)
    return problems


async def run_replicated(client: aioredis.Redis, scripts: LuaScripts, name: str, keys: Sequence[str],
                         args: Sequence[Any], wait_ms: int) -> Any:
    """Run a script, then wait until a replica has its write (``WAIT 1``), on one connection."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(scripts.sha(name), len(keys), *keys, *args)
        pipe.incr(DURABLE_MARK)
        pipe.wait(1, wait_ms)
        reply, _, acknowledged = await pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError) and attempt == 0:
            await scripts.load(name)  # Redis lost its scripts (a restart, a failover)
            continue
        for result in (reply, acknowledged):
            if isinstance(result, Exception):
                raise result
        if int(acknowledged) < 1:
            raise errors.StoreUnavailable(
                f"no replica acknowledged the write within {wait_ms} ms; retry (a repeat is safe)")
        return reply
    raise AssertionError("unreachable")
