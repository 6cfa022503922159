"""yamllint over the repository's YAML and over what the chart renders."""

from __future__ import annotations

from pathlib import Path

import pytest
from yamllint import linter
from yamllint.config import YamlLintConfig

from deploy import render_manifests

ROOT = render_manifests.ROOT
CONFIG = YamlLintConfig(file=str(ROOT / ".yamllint"))
SOURCES = sorted(
    p for pattern in ("*.yaml", "*.yml", ".yamllint", ".hadolint.yaml")
    for p in ROOT.rglob(pattern)
    if not CONFIG.is_file_ignored(str(p.relative_to(ROOT))) and ".venv" not in p.parts
)


def problems(text: str, name: str) -> list[str]:
    return [f"{name}:{p.line}:{p.column} {p.rule}: {p.desc}" for p in linter.run(text, CONFIG)]


def test_the_lint_covers_chart_values_and_deploy() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {".yamllint", ".hadolint.yaml", "helm/omni-gateway/Chart.yaml", "helm/omni-gateway/values.yaml",
            "helm/omni-gateway/ci/gpu-sidecar-values.yaml", "deploy/kubernetes/omni-gateway.yaml",
            "deploy/api-gateway/ingress-nginx.yaml"} <= names
    assert not any(name.startswith("helm/omni-gateway/templates/") for name in names)


@pytest.mark.parametrize("path", SOURCES, ids=[p.relative_to(ROOT).as_posix() for p in SOURCES])
def test_yaml_file_is_clean(path: Path) -> None:
    assert problems(path.read_text(), path.name) == []


@pytest.mark.parametrize("values", [
    None, "ci/gpu-sidecar-values.yaml",
    {"ingress": {"enabled": True, "tls": [{"secretName": "t", "hosts": ["a.example.com"]}]},
     "redis": {"bundled": {"password": "pw", "persistence": {"enabled": False}}},
     "metrics": {"serviceMonitor": {"enabled": True}}, "autoscaling": {"enabled": False}},
], ids=["default", "gpu-sidecar", "toggles"])
def test_rendered_manifests_are_clean(values: str | dict | None) -> None:
    resolved = values if isinstance(values, dict) else render_manifests.load_values(values)
    rendered = render_manifests.render(resolved)
    found = []
    for path, body in render_manifests.split_documents(rendered):
        found += problems(body + "\n", path)
    assert found == []
