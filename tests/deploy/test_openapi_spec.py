"""openapi/openapi.json is a valid OpenAPI document (openapi-spec-validator).

API gateways and client generators read the checked-in file, so it is the
file that is validated (tests/gateway/test_openapi.py keeps it equal to the app's).
"""

from __future__ import annotations

import json

from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from deploy import render_manifests
from gateway.web.middleware.admission import OPS_PATHS
from tests.deploy import k8s

SPEC_PATH = render_manifests.ROOT / "openapi" / "openapi.json"


def load_spec() -> dict:
    return json.loads(SPEC_PATH.read_text())


def test_spec_is_valid_openapi() -> None:
    spec = load_spec()
    assert spec["openapi"].startswith("3.1")
    problems = [f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
                for error in OpenAPIV31SpecValidator(spec).iter_errors()]
    # E.g. a Media Type Object holds only schema, example(s) and encoding in
    # OpenAPI 3.1: a description goes on its schema or on the requestBody.
    assert problems == [], "\n".join(problems)
    validate(spec)


def test_the_deployment_relies_only_on_documented_routes() -> None:
    paths = load_spec()["paths"]
    # Probes and the ServiceMonitor.
    assert {"get"} <= set(paths["/healthz"]) and {"get"} <= set(paths["/readyz"])
    assert {"get"} <= set(paths["/metrics"])
    # Everything a client needs is routed by the Ingress: the session API
    # under its prefix, the OpenAI front door by exact path.
    objs = k8s.render({"ingress": {"enabled": True}})
    routed = [(p["path"], p["pathType"]) for rule in k8s.one(objs, "Ingress")["spec"]["rules"]
              for p in rule["http"]["paths"]]
    api = [path for path in paths if path not in OPS_PATHS]  # probes reach the pods, not the Ingress
    # An Exact path routes itself alone: /v1/models/{model} needs /v1/models as a Prefix.
    unrouted = [path for path in api if not any(path == r or (kind == "Prefix" and path.startswith(r + "/"))
                                                for r, kind in routed)]
    assert api and not unrouted, (unrouted, routed)
    # The Ingress body limit is sized for both encodings of a chunk.
    chunks = paths["/v1/streaming_input/sessions/{session_id}/chunks"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/octet-stream"} <= set(chunks)
