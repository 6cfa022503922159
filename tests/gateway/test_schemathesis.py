"""Property-based API testing: schemathesis drives the live app from openapi/openapi.json.

The app runs under uvicorn on a loopback port with real Redis (and the
scripted engine: these requests exercise the HTTP contract, not the model).
Every generated request, valid or not, must get a documented status, a body
that matches the schema, and never a 5xx.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.runtime.app import create_app
from gateway.runtime.openapi_spec import SPEC_PATH
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import live_server, make_settings


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: object, value: object) -> bytes:
    """Mode A's body: the generated value as it is (a string), else as one JSON record."""
    return value.encode() if isinstance(value, str) else json.dumps(value).encode() + b"\n"


@schemathesis.serializer("application/sdp")
def sdp(ctx: object, value: object) -> bytes:
    """A WebRTC offer's body (``/v1/realtime/calls``): the generated text as it is."""
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()


schema = schemathesis.openapi.from_path(SPEC_PATH)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def live_url(redis_server_url: str) -> Iterator[str]:
    with live_server(create_app(make_settings(redis_url=redis_server_url), engine=ScriptedEngine())) as url:
        yield url


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case, live_url: str) -> None:
    # Every answer here takes well under a second, but an upload whose body ends without
    # end_of_input is a 200 stream kept open for Mode B calls: it is read until this timeout
    # (at 30 s, a generated `{}` upload took 30 s of the run).
    case.call_and_validate(base_url=live_url, checks=CHECKS, timeout=5)


@pytest.mark.parametrize(("path", "media_type", "body", "last"), [
    ("/v1/chat/completions", "application/json",
     {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}, "data: [DONE]"),
    ("/v1/streaming_input/upload", "application/x-ndjson",
     '{"model": "scripted"}\n{"sequence_id": 0, "text": "hi", "end_of_input": true}\n', "data: [DONE]"),
    ("/v1/responses", "application/json", {"model": "scripted", "input": "hi", "stream": True},
     "event: response.completed"),
    ("/v1/responses", "application/json", {"model": "scripted", "input": "hi"}, '"object":"response"'),
    ("/v1/completions", "application/json", {"model": "scripted", "prompt": "hi", "stream": True}, "data: [DONE]"),
    ("/v1/completions", "application/json", {"model": "scripted", "prompt": "hi"}, '"object":"text_completion"'),
])
def test_an_answer_conforms_whole_or_event_by_event(path: str, media_type: str, body: object, last: str,
                                                   live_url: str) -> None:
    # Generated requests rarely make a valid streamed call; schemathesis checks each SSE event
    # against the document's event schema when one does, so one is made here on purpose.
    case = schema[path]["POST"].Case(body=body, media_type=media_type)
    response = case.call_and_validate(base_url=live_url, checks=CHECKS, timeout=30)
    assert response.status_code == 200 and last in response.text
