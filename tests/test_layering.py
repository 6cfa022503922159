"""The package layering, read from the imports: arrows only point down.

    routers (sessions/router, chat/router, ops)  ─►  services (sessions/service, chat/service)
      ─►  work/ (engine work)  ─►  output/  ─►  store/  ─►  domain/ (a leaf)

``gateway`` never imports vLLM; ``omni_adapter`` never imports ``gateway``;
the client ``omni_client`` imports nothing of the server (its users install no server).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUTERS_AND_SERVICES = ("gateway.sessions", "gateway.chat", "gateway.realtime", "gateway.upload", "gateway.ops", "gateway.demo",
                        "gateway.app",
                        "gateway.dependencies")

#: Every gateway module or package but the domain itself.
NOT_DOMAIN = tuple(sorted(f"gateway.{p.stem}" for p in (ROOT / "gateway").iterdir()
                          if p.name not in ("domain", "__init__.py") and (p.suffix == ".py" or (p / "__init__.py").exists())))

#: package -> the gateway modules it must never import.
FORBIDDEN = {
    "gateway/domain": NOT_DOMAIN,
    "gateway/store": (*ROUTERS_AND_SERVICES, "gateway.work", "gateway.output", "gateway.metrics"),
    "gateway/output": (*ROUTERS_AND_SERVICES, "gateway.work"),
    "gateway/work": ROUTERS_AND_SERVICES,
    "omni_adapter": ("gateway",),
    "omni_client": ("gateway", "omni_adapter", "vllm", "fastapi", "starlette", "uvicorn", "redis", "fakeredis",
                    "sse_starlette", "pydantic"),
}
#: Modules a client process must not end up holding, directly or through a dependency.
SERVER_MODULES = ("gateway", "omni_adapter", "vllm", "fastapi", "starlette", "redis", "uvicorn")


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_arrows_point_down(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module in sorted(imported_modules(path))
        if any(module == f or module.startswith(f if f.endswith(".") else f + ".") for f in FORBIDDEN[package])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_domain_is_a_leaf_the_others_build_on() -> None:
    users = {path.parent.name for path in (ROOT / "gateway").rglob("*.py")
             if any(m.startswith("gateway.domain") for m in imported_modules(path))}
    assert {"store", "work", "sessions"} <= users


def test_the_gateway_never_imports_vllm() -> None:
    wrong = [f"{path.relative_to(ROOT)}: {module}" for path in sorted((ROOT / "gateway").rglob("*.py"))
             for module in imported_modules(path) if module.split(".")[0] in ("vllm", "vllm_omni", "torch")]
    assert not wrong, wrong


def test_the_client_loads_no_server_module() -> None:
    probe = "import json, sys, omni_client; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout)
    wrong = [m for m in loaded if m.split(".")[0] in SERVER_MODULES]
    assert not wrong, wrong
