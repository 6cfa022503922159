"""Render the chart with Helm and check objects against the Kubernetes schemas.

Helm is the real engine (Helm v4 as a library from ``helm-python-sdk``), and
the schemas are the ones ``kubernetes-validate`` ships inside its package, so
everything here runs offline.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import yaml

from deploy import render_manifests

#: The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native
#: sidecars) and the version Helm renders for by default.
KUBE_VERSIONS = ("1.29.0", "1.36.0")

Obj = dict[str, Any]


def render(values: dict[str, Any] | None = None) -> list[Obj]:
    return render_manifests.objects(render_manifests.render(values))


def render_values_file(name: str | None) -> list[Obj]:
    return render(render_manifests.load_values(name))


def validate(obj: Obj, version: str) -> None:
    """Strict schema validation: unknown fields fail too."""
    if obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "ServiceMonitor":
        validate_service_monitor(obj)
        return
    kubernetes_validate.validate(obj, version, strict=True)


def validate_service_monitor(obj: Obj) -> None:
    """The Prometheus Operator CRD is not a built-in schema: use its generated models.

    The models (``cloudcoil-models-prometheus-operator``, generated from the
    operator's CRDs) check types and patterns but drop unknown fields, so the
    round trip must give back exactly the input.
    """
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    model = ServiceMonitor.model_validate(obj)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj, (
        "ServiceMonitor has fields its CRD does not define")


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objs if obj["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [obj for obj in of_kind(objs, kind) if name is None or obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def containers(workload: Obj) -> Iterator[Obj]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(workload: Obj, name: str) -> Obj:
    (found,) = [c for c in containers(workload) if c["name"] == name]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def secret_data(secret: Obj) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in secret.get("data", {}).items()}


def probe_window(probe: Obj) -> int:
    """The longest time a probe tolerates failure before acting."""
    return probe["periodSeconds"] * probe["failureThreshold"]


def documents(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]
