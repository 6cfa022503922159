"""A real Chromium page on another origin calls the API (CORS), as a browser app beside its own site does.

The page comes from an app's own site (a server of the test's) on a loopback
origin other than the gateway's; its script is an app's ``fetch``
with an API key. The gateway allows the origins of ``allowed_origins`` only,
as vLLM's ``--allowed-origins``, and none by default.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from playwright.async_api import Page
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from omni_adapter.scripted import ScriptedEngine
from tests.gateway.client import live_app, make_settings, served
from tests.gateway.test_demo_page import chromium
from tests.redis_server import free_port

KEY = "sk-browser-app"

#: An app's call: a chat completion with the key, its answer, a header of it, or what the browser said.
CALL = """async ({url, key}) => {
    try {
        const answer = await fetch(`${url}/v1/chat/completions`, {
            method: "POST",
            headers: {"Authorization": `Bearer ${key}`, "Content-Type": "application/json"},
            body: JSON.stringify({model: "scripted", messages: [{role: "user", content: "hi"}]})});
        return {status: answer.status, body: await answer.json(), session: answer.headers.get("X-Session-Id")};
    } catch (error) {
        return {refused: String(error)};
    }
}"""


@asynccontextmanager
async def app_site() -> AsyncIterator[str]:
    """An app's own site, on a loopback origin that is not the gateway's: its origin."""
    site = Starlette(routes=[Route("/", lambda request: HTMLResponse("<!doctype html><title>an app</title>"))])
    port = free_port()
    async with served(uvicorn.Config(site, host="127.0.0.1", port=port, log_level="warning")):
        yield f"http://localhost:{port}"


@asynccontextmanager
async def page_at(origin: str) -> AsyncIterator[Page]:
    async with chromium(None, allow_mic=False) as browser:
        page = await browser.new_page()
        await page.goto(f"{origin}/")
        yield page


async def call(page: Page, url: str, key: str = KEY) -> Any:
    return await page.evaluate(CALL, {"url": url, "key": key})


async def test_a_page_on_an_allowed_origin_calls_the_api_and_reads_its_errors(redis_url: str) -> None:
    async with app_site() as origin:
        settings = make_settings(redis_url=redis_url, api_keys=KEY, allowed_origins=f"{origin}, https://else.example")
        async with live_app(settings, ScriptedEngine()) as url, page_at(origin) as page:
            answered = await call(page, url)
            assert answered.get("status") == 200, answered
            assert answered["body"]["choices"][0]["message"]["content"] == "echo: hi"
            assert answered["session"], "the session's id is a header the page may read"
            # An error is the page's to read too, not a failed fetch.
            refused = await call(page, url, key="sk-wrong")
            assert refused["status"] == 401 and refused["body"]["error"]["code"] == "invalid_api_key", refused


async def test_a_page_on_another_origin_is_refused_by_its_browser(redis_url: str) -> None:
    async with app_site() as origin, app_site() as other:
        allowed = make_settings(redis_url=redis_url, api_keys=KEY, allowed_origins=other)
        async with live_app(allowed, ScriptedEngine()) as url, page_at(origin) as page:
            assert "refused" in await call(page, url)
        # By default no origin is allowed, as vLLM's default.
        async with live_app(make_settings(redis_url=redis_url, api_keys=KEY), ScriptedEngine()) as url, \
                page_at(origin) as page:
            assert "refused" in await call(page, url)
