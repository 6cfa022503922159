#!/usr/bin/env bash
# Set up (if needed) and run the service on its embedded default:
# in-process vLLM on the CPU with SmolLM2-135M-Instruct, in-process store.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The local default serves the voice page at /demo (production leaves it off).
export OMNI_GATEWAY_DEMO="${OMNI_GATEWAY_DEMO:-true}"
exec .venv/bin/omni-gateway serve "$@"
