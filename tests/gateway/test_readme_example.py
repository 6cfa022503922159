"""The README's first example, as a new user runs it, gets a sensible answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from omni_adapter.vllm_engine import VllmEngine
from tests.gateway.client import BASE, app_client, make_settings

README = Path(__file__).parents[2] / "README.md"


def first_example() -> tuple[dict, str, str]:
    """The create body and the two chunks of the README's curl session."""
    text = README.read_text()
    body = json.loads(re.search(r"-d '(\{\"messages\".*?)' \\", text).group(1))
    first = json.loads(re.search(r"-d '(\{\"sequence_id\": 0.*?)'", text).group(1))["text"]
    second = re.search(r"--data-binary '(.*?)'", text).group(1)
    return body, first, second


@pytest.mark.engine
async def test_the_readme_curl_session_answers_sensibly(redis_url: str, vllm_engine: VllmEngine) -> None:
    body, first, second = first_example()
    assert "capital" in first + second
    async with app_client(make_settings(redis_url=redis_url), vllm_engine) as client:
        sid = (await client.post(BASE, json=body)).json()["session_id"]
        await client.post(f"{BASE}/{sid}/chunks", json={"sequence_id": 0, "text": first})
        await client.post(f"{BASE}/{sid}/chunks", content=second.encode(), headers={
            "Content-Type": "application/octet-stream", "X-Sequence-Id": "1", "X-End-Of-Input": "true"})
        result = (await client.get(f"{BASE}/{sid}/result", params={"wait": 30})).json()
    answer = result["completion"]["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
