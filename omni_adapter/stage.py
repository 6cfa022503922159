"""A stage in front of or behind a Thinker engine (the CPU Listener, the CPU Talker).

A stage changes what the engine takes or produces and wraps its sessions;
everything else (health, closing, the request checks of
``port.RequestChecks``) is the Thinker's, so a stage is an engine like any
other to the gateway.
"""

from __future__ import annotations

from typing import Any

from omni_adapter.port import Capabilities, Engine


class EngineStage:
    def __init__(self, thinker: Engine, capabilities: Capabilities) -> None:
        self._thinker = thinker
        self.capabilities = capabilities

    async def check_health(self) -> None:
        await self._thinker.check_health()

    async def aclose(self) -> None:
        await self._thinker.aclose()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks: the Thinker's other offers.
        return getattr(self._thinker, name)
