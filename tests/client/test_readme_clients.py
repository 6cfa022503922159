"""The README's client examples, as written, against a real gateway (scripted engine) and Redis."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.client.conftest import LiveGateway
from tests.client.helpers import omni_gateway

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "README.md").read_text().split("## Clients", 1)[1].split("\n## ", 1)[0]


def test_the_library_example_prints_the_answer(gateway: LiveGateway) -> None:
    code = re.search(r"```python\n(.*?)```", SECTION, re.S)
    assert code is not None
    example = code[1].replace("http://127.0.0.1:8080", gateway.url)
    done = subprocess.run([sys.executable, "-c", example], env=os.environ | {"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "echo: What is the capital of France?\n"
    assert [c.data for c in gateway.engine.sessions[0].fed] == [b"What is ", b"the capital ", b"of France?"]


def test_the_cli_example_streams_the_text_file(gateway: LiveGateway, tmp_path: Path) -> None:
    shell = re.search(r"```bash\n(.*?)```", SECTION, re.S)
    assert shell is not None
    lines = shell[1].replace("\\\n", " ").splitlines()
    question = re.fullmatch(r'echo "(.*)" > question.txt', lines[0])
    assert question is not None
    (tmp_path / "question.txt").write_text(question[1] + "\n")
    args = shlex.split(lines[1])
    assert args[:2] == [".venv/bin/omni-gateway", "stream"]
    done = omni_gateway(*args[1:], "--url", gateway.url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "echo: What is the capital of France?\n\n"
