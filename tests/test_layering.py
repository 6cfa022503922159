"""The package layering, read from the imports: arrows only point down.

    runtime/  the process's life: cli, processes, the app factory and its lifespan
      ─►  api/      front doors, one package per transport (they never import each other)
      ─►  web/      the HTTP shell they share: resources, identity, validation, SSE, middleware
      ─►  service/  the session use cases
      ─►  work/  ─►  output/  ─►  store/  ─►  domain/ (a leaf)

    settings, errors, metrics: leaves beside the layers (they import only the domain)

``gateway`` never imports vLLM; ``omni_adapter`` never imports ``gateway``;
the client ``omni_client`` imports nothing of the server (its users install no
server), and the server imports the client only in its command line.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "gateway"

#: The layers, top to bottom: a module imports from its own layer and those below.
LAYERS = ("runtime", "api", "web", "service", "work", "output", "store", "domain")
#: Modules beside the layers: every layer may use them; they use only the domain.
LEAVES = ("settings", "errors", "metrics")
#: What the front doors share (a chunk from any wire format, the languages heard); not transports.
SHARED_FRONT = ("chunks", "languages")
#: The only place the server may import the client: the CLI registers its commands.
CLIENT_IMPORTER = GATEWAY / "runtime" / "cli.py"


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _gateway_imports(path: Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if _under(m, "gateway") and m != "gateway")


def _top(module: str) -> str:
    """``gateway.api.chat.router`` -> ``api``; ``gateway.errors`` -> ``errors``."""
    return module.split(".")[1]


def test_the_listing_is_the_layers_and_the_leaves() -> None:
    """A new top-level module or package must take a place in the layering first."""
    listed = {p.stem for p in GATEWAY.iterdir()
              if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert listed == set(LAYERS) | set(LEAVES)


@pytest.mark.parametrize("layer", LAYERS)
def test_arrows_point_down(layer: str) -> None:
    above = LAYERS[:LAYERS.index(layer)]
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sorted((GATEWAY / layer).rglob("*.py"))
             for module in _gateway_imports(path) if _top(module) in above]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_leaves_use_only_the_domain(leaf: str) -> None:
    wrong = [m for m in _gateway_imports(GATEWAY / f"{leaf}.py") if _top(m) not in ("domain", *LEAVES)]
    assert not wrong, wrong


def test_front_doors_never_import_each_other() -> None:
    """Transports translate; what they share lives below them (or in ``api/chunks.py``, ``api/languages.py``)."""
    doors = {p.stem for p in (GATEWAY / "api").iterdir()
             if p.name != "__init__.py" and p.stem not in SHARED_FRONT and (p.suffix == ".py" or p.is_dir())}
    wrong = []
    for door in sorted(doors):
        own = GATEWAY / "api" / door
        for path in sorted(own.rglob("*.py") if own.is_dir() else [own.with_suffix(".py")]):
            wrong += [f"{path.relative_to(ROOT)} imports {m}" for m in _gateway_imports(path)
                      if _under(m, "gateway.api") and len(m.split(".")) > 2
                      and m.split(".")[2] not in (door, *SHARED_FRONT)]
    assert not wrong, "\n".join(wrong)


def test_the_domain_is_a_leaf_the_others_build_on() -> None:
    users = {path.relative_to(GATEWAY).parts[0] for path in GATEWAY.rglob("*.py")
             if any(_under(m, "gateway.domain") for m in imported_modules(path))}
    assert {"store", "work", "service"} <= users


#: package -> what it must never import (outside the gateway's own layering).
FORBIDDEN = {
    "gateway": ("vllm", "vllm_omni", "torch"),
    "omni_adapter": ("gateway", "omni_client"),
    "omni_client": ("gateway", "omni_adapter", "vllm", "fastapi", "starlette", "uvicorn", "redis", "fakeredis",
                    "sse_starlette", "pydantic"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_keep_to_their_side(package: str) -> None:
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for module in sorted(imported_modules(path))
             if any(_under(module, f) for f in FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_the_server_imports_the_client_only_in_its_command_line() -> None:
    wrong = [str(path.relative_to(ROOT)) for path in sorted(GATEWAY.rglob("*.py"))
             if path != CLIENT_IMPORTER and any(_under(m, "omni_client") for m in imported_modules(path))]
    assert not wrong, wrong


#: Modules a client process must not end up holding, directly or through a dependency.
SERVER_MODULES = ("gateway", "omni_adapter", "vllm", "fastapi", "starlette", "redis", "uvicorn")


def test_the_client_loads_no_server_module() -> None:
    probe = "import json, sys, omni_client; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout)
    wrong = [m for m in loaded if m.split(".")[0] in SERVER_MODULES]
    assert not wrong, wrong
