#!/usr/bin/env bash
# Install what is needed (scripts/setup.sh test bench), then run every benchmark and
# write bench/results/latest.{json,md} and the TTFT CCDF plot.
# About 30 minutes on 2 cores; pass --quick for a 4-minute plumbing check,
# or a part name (ttft, floor, overhead, report). Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The benchmarks use the tests' helpers (redis-server, the NGINX edge) and their own tools.
./scripts/setup.sh test bench
exec .venv/bin/python -m bench "$@"
