"""Load the Lua scripts, each prefixed with the shared library.

The transition table of ``gateway.domain.states`` is rendered into Lua
here, so the scripts enforce exactly the table the Python code documents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from gateway.domain.states import TERMINAL_STATES, TRANSITIONS

#: Scripts on the five keys of one session, prefixed with lib.lua.
SESSION_SCRIPTS = ("create", "append", "finish", "cancel", "tend", "renew", "release", "publish", "fail",
                   "view", "claim", "park", "replace", "mark_tokens")
#: Scripts on keys of their own (limits), standing alone.
STANDALONE_SCRIPTS = ("admit", "rate", "rescore", "quarantine")


def _lua_table() -> str:
    rows = []
    for state, targets in TRANSITIONS.items():
        allowed = ", ".join(f"{target.value} = true" for target in sorted(targets))
        rows.append(f"  {state.value} = {{{allowed}}},")
    terminal = ", ".join(f"{state.value} = true" for state in sorted(TERMINAL_STATES))
    return "local TRANSITIONS = {\n" + "\n".join(rows) + "\n}\n" + f"local TERMINAL = {{{terminal}}}\n"


#: Every script's "now" is Redis's clock. Callers still pass their own now as
#: ARGV[1] (the scripts ignore it): leases, expiry and rate limits then never
#: depend on a replica's clock, so one that is off by seconds neither steals
#: leases nor loses its own.
_SERVER_NOW = """local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


def script_sources() -> dict[str, str]:
    folder = files("gateway.store") / "lua"
    library = _SERVER_NOW + _lua_table() + (folder / "lib.lua").read_text()
    sources = {name: library + (folder / f"{name}.lua").read_text() for name in SESSION_SCRIPTS}
    sources.update({name: _SERVER_NOW + (folder / f"{name}.lua").read_text() for name in STANDALONE_SCRIPTS})
    return sources


class LuaScripts:
    """The scripts by name, run with EVALSHA; one that Redis lost (a restart, a failover) is loaded again.

    What redis-py's ``register_script`` objects do, without their per-call
    ``isinstance`` check against a typing Protocol: py-spy put that at 5% of
    the gateway's CPU while relaying tokens, and every append and published
    frame is one script call.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._sources = script_sources()
        self._shas = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in self._sources.items()}

    def sha(self, name: str) -> str:
        return self._shas[name]

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self._client.evalsha(self._shas[name], len(keys), *keys, *args)
        except NoScriptError:
            await self.load(name)
            return await self._client.evalsha(self._shas[name], len(keys), *keys, *args)

    async def load(self, name: str) -> None:
        await self._client.script_load(self._sources[name])
