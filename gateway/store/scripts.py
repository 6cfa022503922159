"""Load the Lua scripts, each prefixed with the shared library.

The transition table of ``gateway.sessions.states`` is rendered into Lua
here, so the scripts enforce exactly the table the Python code documents.
"""

from __future__ import annotations

from importlib.resources import files

from gateway.sessions.states import TERMINAL_STATES, TRANSITIONS

SCRIPT_NAMES = ("create", "append", "finish", "cancel", "expire", "publish", "fail", "view")


def _lua_table() -> str:
    rows = []
    for state, targets in TRANSITIONS.items():
        allowed = ", ".join(f"{target.value} = true" for target in sorted(targets))
        rows.append(f"  {state.value} = {{{allowed}}},")
    terminal = ", ".join(f"{state.value} = true" for state in sorted(TERMINAL_STATES))
    return "local TRANSITIONS = {\n" + "\n".join(rows) + "\n}\n" + f"local TERMINAL = {{{terminal}}}\n"


def script_sources() -> dict[str, str]:
    folder = files("gateway.store") / "lua"
    library = _lua_table() + (folder / "lib.lua").read_text()
    return {name: library + (folder / f"{name}.lua").read_text() for name in SCRIPT_NAMES}
