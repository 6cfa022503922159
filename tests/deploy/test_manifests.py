"""deploy/: the plain manifests rendered from the chart, and the API-gateway example."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deploy import render_manifests
from tests.deploy import k8s

DEPLOY = render_manifests.ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))
EDGE = DEPLOY / "api-gateway" / "ingress-nginx.yaml"
MiB = 1024 * 1024


def test_plain_manifests_are_the_chart_rendered() -> None:
    for path, text in render_manifests.expected_files().items():
        assert path.exists() and path.read_text() == text, (
            f"{path.relative_to(render_manifests.ROOT)} is stale: run "
            "`.venv/bin/python deploy/render_manifests.py`")
    assert render_manifests.main(["--check"]) == 0


def test_deploy_holds_the_expected_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert names == {"kubernetes/omni-gateway.yaml", "kubernetes/omni-gateway-gpu-sidecar.yaml",
                     "api-gateway/ingress-nginx.yaml", "api-gateway/ingress-nginx-controller-config.yaml"}


@pytest.mark.parametrize("version", k8s.KUBE_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_manifest_matches_the_kubernetes_schema(path: Path, version: str) -> None:
    objs = k8s.documents(path.read_text())
    assert objs
    for obj in objs:
        k8s.validate(obj, version)


def test_edge_routes_to_the_gateway_service_of_the_plain_manifests() -> None:
    gateway = k8s.documents((DEPLOY / "kubernetes" / "omni-gateway.yaml").read_text())
    service = k8s.one(gateway, "Service", "omni-gateway")
    edge = k8s.documents(EDGE.read_text())
    ingress = k8s.one(edge, "Ingress")
    backends = [p["backend"]["service"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert backends == 9 * [{"name": service["metadata"]["name"], "port": {"name": service["spec"]["ports"][0]["name"]}}]
    paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == ["/v1/streaming_input", "/v1/chat/completions", "/v1/responses", "/v1/completions",
                     "/v1/audio",
                     "/v1/models", "/v1/realtime", "/v1/realtime/calls", "/v1/realtime/client_secrets"]
    policy = k8s.one(edge, "NetworkPolicy")
    pods = k8s.one(gateway, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert k8s.selects(policy["spec"]["podSelector"]["matchLabels"], pods)
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_edge_forwards_identity_and_sizes_sse_and_uploads() -> None:
    gateway = k8s.documents((DEPLOY / "kubernetes" / "omni-gateway-gpu-sidecar.yaml").read_text())
    settings = k8s.one(gateway, "ConfigMap", "omni-gateway")["data"]
    annotations = k8s.one(k8s.documents(EDGE.read_text()), "Ingress")["metadata"]["annotations"]
    nginx = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in annotations.items()}
    assert nginx["auth-url"].startswith("http")
    assert nginx["auth-response-headers"] == settings["OMNI_GATEWAY_IDENTITY_HEADER"]
    assert nginx["proxy-buffering"] == "off" and nginx["proxy-request-buffering"] == "off"
    session_timeout = int(settings["OMNI_GATEWAY_SESSION_TIMEOUT_SEC"])
    assert int(nginx["proxy-read-timeout"]) > session_timeout
    assert int(nginx["proxy-send-timeout"]) > session_timeout
    chunk = int(settings["OMNI_GATEWAY_MAX_CHUNK_BYTES"])
    assert nginx["proxy-body-size"].endswith("m")
    assert int(nginx["proxy-body-size"][:-1]) * MiB >= 4 * math.ceil(chunk / 3) + 64 * 1024
    controller = k8s.documents((DEPLOY / "api-gateway" / "ingress-nginx-controller-config.yaml").read_text())
    shutdown = k8s.one(controller, "ConfigMap")["data"]["worker-shutdown-timeout"]
    assert int(shutdown.removesuffix("s")) > session_timeout
