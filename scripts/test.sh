#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests, store tests
# against a real redis-server and fakeredis, and integration tests against
# the real vLLM engine. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test command's setup: serving's, plus NGINX, Chromium and the test tools.
./scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/mypy  # packages and strictness: [tool.mypy] in pyproject.toml
exec .venv/bin/python -m pytest "$@"
