"""The checked-in OpenAPI document must match the app."""

from __future__ import annotations

from gateway.runtime.openapi_spec import SPEC_PATH, current_spec, render


def test_openapi_json_is_up_to_date() -> None:
    assert SPEC_PATH.read_text() == render(current_spec()), (
        "openapi/openapi.json is stale: run `python -m gateway.runtime.openapi_spec`")


def test_every_session_route_documents_the_error_envelope() -> None:
    spec = current_spec()
    for path, methods in spec["paths"].items():
        if not path.startswith("/v1/streaming_input"):
            continue
        for method, operation in methods.items():
            errors = [code for code in operation["responses"] if code.startswith(("4", "5"))]
            assert errors, f"{method.upper()} {path} declares no error responses"
            for code in errors:
                schema = operation["responses"][code]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorEnvelope"}, (method, path, code)
