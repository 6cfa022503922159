"""The hot routes: each declaration (the document) and the handler that serves it cannot drift.

``gateway/api/sessions/router.py`` declares append, finish and the SSE events
for the OpenAPI document and marks each ``@served_by(handler)``; the app
serves the handler. These tests read both sides from the built app: every
marked route is served by its handler, and what the handler answers is what
the declaration documents (status codes and bodies).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from gateway.api.sessions import hot_routes
from gateway.runtime.app import create_app
from gateway.settings import Settings
from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import BASE, app_client, make_settings, parse_sse

#: The routes a streaming client calls many times a second: each must be served lean.
HOT = {("POST", BASE + "/{session_id}/chunks"), ("POST", BASE + "/{session_id}/finish"),
       ("GET", BASE + "/{session_id}/events")}


def _marked(app: FastAPI) -> dict[tuple[str, str], APIRoute]:
    return {(method, route.path): route for route in app.router.routes
            if isinstance(route, APIRoute) and hot_routes.handler_of(route) is not None
            for method in route.methods}


def test_every_hot_route_is_declared_and_served_by_the_handler_it_names() -> None:
    app = create_app(make_settings())
    marked = _marked(app)
    assert set(marked) == HOT
    for route in marked.values():
        assert route.app is hot_routes.handler_of(route), route.path


async def test_a_declaration_is_never_what_answers() -> None:
    for route in _marked(create_app(make_settings())).values():
        arguments = dict.fromkeys(inspect.signature(route.endpoint).parameters)
        with pytest.raises(RuntimeError, match="hot_routes.install"):
            await route.endpoint(**arguments)


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return make_settings(redis_url=redis_url, tend_interval_sec=0.05)


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(settings, ScriptedEngine()) as c:
        yield c


def _declared(app_spec: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    operation: dict[str, Any] = app_spec["paths"][path][method.lower()]
    return operation["responses"]


def _check(spec: dict[str, Any], method: str, path: str, response: httpx.Response) -> None:
    """The answer's status is declared for the route, and its JSON body has the declared schema's fields."""
    declared = _declared(spec, method, path)
    assert str(response.status_code) in declared, (path, response.status_code, sorted(declared))
    content = declared[str(response.status_code)].get("content", {})
    if "application/json" not in content:
        return
    schema = content["application/json"]["schema"]
    name = schema["$ref"].rsplit("/", 1)[-1]
    model = spec["components"]["schemas"][name]
    body = response.json()
    assert set(model.get("required", ())) <= set(body), (name, body)
    assert set(body) <= set(model["properties"]), (name, sorted(set(body) - set(model["properties"])))


async def test_what_the_handlers_answer_is_what_the_declarations_document(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    sid = (await client.post(BASE, json={"temperature": 0})).json()["session_id"]
    chunks, finish, events = (BASE + "/{session_id}/chunks", BASE + "/{session_id}/finish",
                              BASE + "/{session_id}/events")

    _check(spec, "POST", chunks, await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "hi"}))
    _check(spec, "POST", chunks, await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "hi"}))
    _check(spec, "POST", chunks, await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": "no"}))
    _check(spec, "POST", chunks, await client.post(f"{BASE}/{sid}/chunks", content=b"{", headers={
        "content-type": "application/json"}))
    _check(spec, "POST", finish, await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": 0}))
    _check(spec, "POST", finish, await client.post(f"{BASE}/{sid}/finish", json={"final_sequence_id": "x"}))
    _check(spec, "POST", finish, await client.post(f"{BASE}/missing/finish"))

    async with client.stream("GET", f"{BASE}/{sid}/events") as stream:
        _check(spec, "GET", events, stream)
        assert stream.headers["content-type"].startswith("text/event-stream")
        frames = parse_sse((await stream.aread()).decode())
    last = frames[-1].id
    assert last is not None
    _check(spec, "GET", events, await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": last}))  # 204
    _check(spec, "GET", events, await client.get(f"{BASE}/{sid}/events", headers={"Last-Event-ID": "nonsense"}))
