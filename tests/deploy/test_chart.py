"""The Helm chart, rendered by Helm itself, for the default and the GPU+sidecar values."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import helm_python
import pytest
import redis
from pydantic import TypeAdapter

from deploy import render_manifests
from gateway.domain.policies import StartPolicy
from gateway.settings import IceServer, Settings
from tests.deploy import k8s
from tests.deploy.gateway_cli import captured_cli_call
from tests.redis_server import free_port

CHART = render_manifests.CHART_DIR
GPU_VALUES = "ci/gpu-sidecar-values.yaml"
VALUE_SETS = {"default": None, "gpu-sidecar": GPU_VALUES}
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def default_objs() -> list[k8s.Obj]:
    return k8s.render_values_file(None)


@pytest.fixture(scope="module")
def gpu_objs() -> list[k8s.Obj]:
    return k8s.render_values_file(GPU_VALUES)


def deployment(objs: list[k8s.Obj]) -> k8s.Obj:
    return k8s.one(objs, "Deployment")


def settings_env(objs: list[k8s.Obj]) -> dict[str, str]:
    """What the gateway container sees: the ConfigMap plus the chart's Secret."""
    env = dict(k8s.one(objs, "ConfigMap", render_manifests.RELEASE)["data"])
    for secret in k8s.of_kind(objs, "Secret"):
        env.update({k: v for k, v in k8s.secret_data(secret).items() if k.startswith("OMNI_GATEWAY_")})
    return env


# --- Helm's own checks ------------------------------------------------------

@pytest.mark.parametrize("values_file", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_is_clean_in_strict_mode(values_file: str | None) -> None:
    report = helm_python.lint(CHART, render_manifests.load_values(values_file), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("version", k8s.KUBE_VERSIONS)
@pytest.mark.parametrize("values_file", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_matches_the_kubernetes_schema(values_file: str | None, version: str) -> None:
    objs = k8s.render_values_file(values_file)
    assert objs
    for obj in objs:
        k8s.validate(obj, version)


def test_default_values_render_the_cpu_stack(default_objs: list[k8s.Obj]) -> None:
    kinds = sorted(obj["kind"] for obj in default_objs)
    assert kinds == sorted([
        "ServiceAccount", "Secret", "ConfigMap", "ConfigMap", "Service", "Service", "Deployment",
        "StatefulSet", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"])
    pod = k8s.pod_spec(deployment(default_objs))
    assert [c["name"] for c in k8s.containers(deployment(default_objs))] == ["gateway"]
    assert k8s.container(deployment(default_objs), "gateway")["image"] == "omni-gateway:0.1.0-cpu"
    assert "initContainers" not in pod


def test_the_sidecar_serves_every_name_the_gateway_is_told() -> None:
    values = render_manifests.load_values(GPU_VALUES)
    values["engine"]["sidecar"]["servedModelName"] = "qwen2.5-omni-3b, gpt-realtime"
    objs = k8s.render(values)
    args = k8s.container(deployment(objs), "engine")["args"]
    at = args.index("--served-model-name")
    assert args[at + 1:at + 3] == ["qwen2.5-omni-3b", "gpt-realtime"], "vLLM takes each name as an argument"
    assert settings_env(objs)["OMNI_GATEWAY_SERVED_MODEL_NAME"] == "qwen2.5-omni-3b, gpt-realtime"


def test_the_sidecar_parses_function_calls_with_the_gateways_parser() -> None:
    """tool_choice auto needs vLLM's flags (required and a named function do not); without a
    parser the sidecar gets neither flag (and refuses auto with a 400)."""
    objs = k8s.render(render_manifests.load_values(GPU_VALUES))
    args = k8s.container(deployment(objs), "engine")["args"]
    at = args.index("--tool-call-parser")
    assert args[at - 1] == "--enable-auto-tool-choice"
    assert args[at + 1] == settings_env(objs)["OMNI_GATEWAY_TOOL_CALL_PARSER"] == "hermes", "Qwen2.5's call format"
    values = render_manifests.load_values(GPU_VALUES)
    values["engine"]["sidecar"]["toolCallParser"] = ""
    objs = k8s.render(values)
    args = k8s.container(deployment(objs), "engine")["args"]
    assert "--enable-auto-tool-choice" not in args and "--tool-call-parser" not in args
    assert "OMNI_GATEWAY_TOOL_CALL_PARSER" not in settings_env(objs)


def test_gpu_values_render_the_sidecar_stack(gpu_objs: list[k8s.Obj]) -> None:
    kinds = {obj["kind"] for obj in gpu_objs}
    assert {"Ingress", "ServiceMonitor", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds
    assert "StatefulSet" not in kinds, "external Redis: no bundled one"
    dep = deployment(gpu_objs)
    engine = k8s.container(dep, "engine")
    assert engine in k8s.pod_spec(dep)["initContainers"] and engine["restartPolicy"] == "Always"
    assert engine["command"] == ["vllm", "serve"]
    assert engine["args"][0] == "Qwen/Qwen2.5-Omni-3B" and "--omni" in engine["args"]
    # Loopback only: nothing outside the pod reaches the engine past the gateway.
    assert engine["args"][engine["args"].index("--host") + 1] == "127.0.0.1"
    port = engine["args"][engine["args"].index("--port") + 1]
    assert f"127.0.0.1:{port}/health" in engine["startupProbe"]["exec"]["command"][-1]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in k8s.container(dep, "gateway")["resources"].get("limits", {})
    env = settings_env(gpu_objs)
    assert env["OMNI_GATEWAY_ENGINE"] == "openai-http"
    assert env["OMNI_GATEWAY_ENGINE_URL"] == f"http://127.0.0.1:{port}"
    for name in ("gateway", "engine"):
        mounts = {m["name"]: m["mountPath"] for m in k8s.container(dep, name)["volumeMounts"]}
        assert mounts["models"] == "/models"
    volumes = {v["name"]: v for v in k8s.pod_spec(dep)["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "omni-models"
    assert {"name": "HF_HOME", "value": "/models/huggingface"} in engine["env"]


def test_the_cpu_image_runs_eager_unless_asked_and_a_gpu_keeps_vllm_s_default() -> None:
    """Not auto in a pod: its compile cache is an emptyDir, so the background compile
    auto starts would be thrown away with the pod, at every start."""
    assert settings_env(k8s.render_values_file(None))["OMNI_GATEWAY_ENGINE_COMPILE"] == "false"
    compiled = k8s.render({"settings": {"engineCompile": "true"}})
    assert settings_env(compiled)["OMNI_GATEWAY_ENGINE_COMPILE"] == "true"
    gpu_in_process = k8s.render({"image": {"variant": "gpu"}})
    assert "OMNI_GATEWAY_ENGINE_COMPILE" not in settings_env(gpu_in_process)


# --- wiring between objects ---------------------------------------------------

@pytest.mark.parametrize("values_file", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_selectors_pick_exactly_their_own_pods(values_file: str | None) -> None:
    objs = k8s.render_values_file(values_file)
    workloads = k8s.of_kind(objs, "Deployment") + k8s.of_kind(objs, "StatefulSet")
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert k8s.selects(workload["spec"]["selector"]["matchLabels"], labels)
    for service in k8s.of_kind(objs, "Service"):
        matched = [w for w in workloads
                   if k8s.selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1, service["metadata"]["name"]
        ports = {p["name"] for c in k8s.containers(matched[0]) for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    dep = deployment(objs)
    gateway_labels = dep["spec"]["template"]["metadata"]["labels"]
    for pdb in k8s.of_kind(objs, "PodDisruptionBudget"):
        assert k8s.selects(pdb["spec"]["selector"]["matchLabels"], gateway_labels)
    for hpa in k8s.of_kind(objs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
        assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    gateway_service = k8s.one(objs, "Service", dep["metadata"]["name"])
    for monitor in k8s.of_kind(objs, "ServiceMonitor"):
        assert k8s.selects(monitor["spec"]["selector"]["matchLabels"], gateway_service["metadata"]["labels"])
        others = [s for s in k8s.of_kind(objs, "Service") if s is not gateway_service]
        assert not any(k8s.selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
                       for s in others)
        assert monitor["spec"]["endpoints"] == [
            {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}]
    for ingress in k8s.of_kind(objs, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": gateway_service["metadata"]["name"],
                                                      "port": {"name": "http"}}


def test_bundled_redis_is_reachable_only_from_the_gateway(default_objs: list[k8s.Obj]) -> None:
    policy = k8s.one(default_objs, "NetworkPolicy")
    redis_pods = k8s.one(default_objs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    gateway_pods = deployment(default_objs)["spec"]["template"]["metadata"]["labels"]
    assert k8s.selects(policy["spec"]["podSelector"]["matchLabels"], redis_pods)
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert k8s.selects(peer["podSelector"]["matchLabels"], gateway_pods)
    assert not k8s.selects(peer["podSelector"]["matchLabels"], redis_pods)
    url = k8s.secret_data(k8s.one(default_objs, "Secret"))["OMNI_GATEWAY_REDIS_URL"]
    assert url == f"redis://{k8s.one(default_objs, 'Service', 'omni-gateway-redis')['metadata']['name']}:6379/0"


# --- settings -----------------------------------------------------------------

def test_default_settings_load_into_the_gateway_settings(default_objs: list[k8s.Obj],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    env = settings_env(default_objs)
    fields = {name.upper() for name in Settings.model_fields}
    unknown = {key.removeprefix("OMNI_GATEWAY_") for key in env} - fields
    assert not unknown, f"the chart sets settings the gateway does not have: {unknown}"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMNI_GATEWAY_REPLICA_ID", "omni-gateway-7d9f-abcde")
    settings = Settings()
    assert settings.redis_url == "redis://omni-gateway-redis:6379/0"
    assert settings.session_timeout_sec == 300 and settings.max_chunk_bytes == 16 * MiB
    assert settings.start_policy is StartPolicy.ON_FIRST_CHUNK and settings.engine == "vllm"
    assert settings.replica_id == "omni-gateway-7d9f-abcde"


def test_chart_defaults_are_the_gateways_defaults(default_objs: list[k8s.Obj]) -> None:
    env = settings_env(default_objs)
    compared = []
    for name, field in Settings.model_fields.items():
        key = f"OMNI_GATEWAY_{name.upper()}"
        if key in env and field.default_factory is None and field.default is not None:
            assert TypeAdapter(field.annotation).validate_python(env[key]) == field.default, key
            compared.append(name)
    assert len(compared) >= 10, compared


def test_gpu_settings_name_only_known_keys(gpu_objs: list[k8s.Obj]) -> None:
    fields = {name.upper() for name in Settings.model_fields}
    env = settings_env(gpu_objs)
    assert {key.removeprefix("OMNI_GATEWAY_") for key in env} <= fields
    env_vars = {e["name"]: e for e in k8s.container(deployment(gpu_objs), "gateway")["env"]}
    assert env_vars["OMNI_GATEWAY_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "omni-gateway-redis", "key": "url"}
    assert env_vars["OMNI_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "omni-gateway", "key": "OMNI_GATEWAY_API_KEYS", "optional": True}
    assert env_vars["OMNI_GATEWAY_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_api_keys_and_extra_settings_reach_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = k8s.render({"auth": {"apiKeys": ["k1", "sha256:" + "ab" * 32]},
                       "settings": {"extra": {"tend_interval_sec": 2.5}, "rateLimitRps": 0.5}})
    env = settings_env(objs)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.api_keys == "k1,sha256:" + "ab" * 32
    assert settings.tend_interval_sec == 2.5 and settings.rate_limit_rps == 0.5
    assert "OMNI_GATEWAY_API_KEYS" not in k8s.one(objs, "ConfigMap", "omni-gateway")["data"], "keys stay secret"


def test_an_existing_api_key_secret_is_referenced_not_created() -> None:
    objs = k8s.render({"auth": {"existingSecret": "my-keys", "apiKeys": ["ignored"]}})
    assert "OMNI_GATEWAY_API_KEYS" not in k8s.secret_data(k8s.one(objs, "Secret"))
    env = {e["name"]: e for e in k8s.container(deployment(objs), "gateway")["env"]}
    assert env["OMNI_GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "my-keys"


def ice_env_ref(objs: list[k8s.Obj]) -> dict[str, Any]:
    env = {e["name"]: e for e in k8s.container(deployment(objs), "gateway")["env"]}
    return dict(env["OMNI_GATEWAY_WEBRTC_ICE_SERVERS"]["valueFrom"]["secretKeyRef"])


def test_turn_credentials_reach_the_gateway_through_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [{"urls": ["turn:turn.example.com:3478?transport=udp", "turn:turn.example.com:3478?transport=tcp"],
                "username": "omni", "credential": "s3cret"},
               {"urls": "stun:stun.example.com:3478"}]
    objs = k8s.render({"settings": {"webrtcIceServers": servers}})
    assert "OMNI_GATEWAY_WEBRTC_ICE_SERVERS" not in k8s.one(objs, "ConfigMap", "omni-gateway")["data"], \
        "a TURN credential stays secret"
    assert ice_env_ref(objs) == {"name": "omni-gateway", "key": "OMNI_GATEWAY_WEBRTC_ICE_SERVERS", "optional": True}
    for key, value in settings_env(objs).items():
        monkeypatch.setenv(key, value)
    assert Settings().webrtc_ice_servers == [
        IceServer(urls=servers[0]["urls"], username="omni", credential="s3cret"),
        IceServer(urls=["stun:stun.example.com:3478"])]


def test_stun_urls_as_a_string_and_ice_servers_in_a_secret_of_ones_own(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = k8s.render({"settings": {"webrtcIceServers": "stun:a.example:3478, stun:b.example:3478"}})
    monkeypatch.setenv("OMNI_GATEWAY_WEBRTC_ICE_SERVERS", settings_env(objs)["OMNI_GATEWAY_WEBRTC_ICE_SERVERS"])
    assert [s.urls for s in Settings().webrtc_ice_servers] == [["stun:a.example:3478"], ["stun:b.example:3478"]]
    objs = k8s.render({"settings": {"webrtcIceServersSecret": "my-turn",
                                    "webrtcIceServers": [{"urls": "stun:ignored:3478"}]}})
    assert "OMNI_GATEWAY_WEBRTC_ICE_SERVERS" not in settings_env(objs)
    assert ice_env_ref(objs)["name"] == "my-turn"
    assert "OMNI_GATEWAY_WEBRTC_ICE_SERVERS" not in settings_env(k8s.render()), "none by default"


def test_trusting_the_identity_header_can_be_limited_to_the_edge(gpu_objs: list[k8s.Obj]) -> None:
    assert settings_env(gpu_objs)["OMNI_GATEWAY_IDENTITY_HEADER"] == "X-Auth-Request-User"
    policy = k8s.one(gpu_objs, "NetworkPolicy")
    pods = deployment(gpu_objs)["spec"]["template"]["metadata"]["labels"]
    assert k8s.selects(policy["spec"]["podSelector"]["matchLabels"], pods)
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in rule["from"]] == [
        "ingress-nginx", "monitoring"]
    assert "OMNI_GATEWAY_IDENTITY_HEADER" not in settings_env(k8s.render()), "the default trusts no header"


def test_schema_start_policies_are_the_gateways() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = schema["properties"]["settings"]["properties"]["startPolicy"]["enum"]
    assert sorted(allowed) == sorted(policy.value for policy in StartPolicy)


@pytest.mark.parametrize(("values", "message"), [
    ({"settings": {"startPolicy": "eager"}}, "startPolicy"),
    ({"settings": {"sessionTimeoutSec": 0}}, "sessionTimeoutSec"),
    ({"setings": {}}, "setings"),
    ({"image": {"variant": "tpu"}}, "variant"),
    ({"redis": {"external": {"url": "localhost:6379"}, "bundled": {"enabled": False}}}, "url"),
    ({"engine": {"sidecar": {"port": 70000}}}, "port"),
    ({"settings": {"webrtcIceServers": [{"urls": "http://turn.example"}]}}, "webrtcIceServers"),
    ({"settings": {"webrtcIceServers": [{"url": "turn:turn.example", "username": "u"}]}}, "webrtcIceServers"),
])
def test_values_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        k8s.render(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"bundled": {"enabled": False}}}, "must share one Redis"),
    ({"redis": {"external": {"url": "redis://r:6379/0"}}}, "not both"),
    ({"modelVolume": {"enabled": True, "existingClaim": "a", "hostPath": "/b"}}, "at most one"),
    ({"ingress": {"enabled": True, "auth": {"url": "http://auth/verify"}}}, "identityHeader"),
    ({"networkPolicy": {"enabled": True}}, "networkPolicy.from"),
])
def test_inconsistent_values_fail_to_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        k8s.render(values)


def test_external_redis_url_goes_to_the_secret_only() -> None:
    url = "rediss://:s3cret@redis.example.internal:6380/2"
    objs = k8s.render({"redis": {"bundled": {"enabled": False}, "external": {"url": url}}})
    assert k8s.secret_data(k8s.one(objs, "Secret"))["OMNI_GATEWAY_REDIS_URL"] == url
    assert not k8s.of_kind(objs, "StatefulSet") and not k8s.of_kind(objs, "NetworkPolicy")
    assert "s3cret" not in json.dumps(k8s.of_kind(objs, "ConfigMap") + k8s.of_kind(objs, "Deployment"))


def test_bundled_redis_password_is_in_the_url_and_the_server_args() -> None:
    objs = k8s.render({"redis": {"bundled": {"password": "p@ss/word"}}})
    data = k8s.secret_data(k8s.one(objs, "Secret"))
    assert data["OMNI_GATEWAY_REDIS_URL"] == "redis://:p%40ss%2Fword@omni-gateway-redis:6379/0"
    assert data["REDIS_PASSWORD"] == "p@ss/word"
    server = k8s.container(k8s.one(objs, "StatefulSet"), "redis")
    assert server["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert {e["name"] for e in server["env"]} == {"REDIS_PASSWORD", "REDISCLI_AUTH"}


def test_bundled_redis_config_runs_on_a_real_redis_server(default_objs: list[k8s.Obj]) -> None:
    conf = k8s.one(default_objs, "ConfigMap", "omni-gateway-redis")["data"]["redis.conf"]
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run scripts/setup.sh"
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        conf_path = Path(workdir) / "redis.conf"
        conf_path.write_text(conf)
        # The file as the chart ships it; only where to listen and write differs here.
        proc = subprocess.Popen([binary, str(conf_path), "--port", str(port), "--bind", "127.0.0.1",
                                 "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port, socket_timeout=2)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    assert proc.poll() is None and time.monotonic() < deadline, "redis-server refused the config"
                    time.sleep(0.05)
            config = client.config_get("*")
            assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
            assert config["maxmemory-policy"] == "noeviction" and config["save"] == ""
            client.set("sis:{probe}:meta", "1")
            assert (Path(workdir) / config["appenddirname"]).is_dir()
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


# --- the edge: SSE, uploads, auth -----------------------------------------------

def nginx_annotations(objs: list[k8s.Obj]) -> dict[str, str]:
    annotations = k8s.one(objs, "Ingress")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    return {key.removeprefix(prefix): value for key, value in annotations.items() if key.startswith(prefix)}


def size_bytes(value: str) -> int:
    units = {"k": 1024, "m": MiB, "g": 1024 * MiB}
    return int(value[:-1]) * units[value[-1].lower()] if value[-1].isalpha() else int(value)


@pytest.mark.parametrize(("chunk", "timeout"), [(16 * MiB, 300), (48 * MiB + 5, 1200), (1000, 30)])
def test_ingress_keeps_sse_streaming_and_admits_the_largest_chunk(chunk: int, timeout: int) -> None:
    objs = k8s.render({"ingress": {"enabled": True},
                       "settings": {"maxChunkBytes": chunk, "sessionTimeoutSec": timeout}})
    nginx = nginx_annotations(objs)
    assert nginx["proxy-buffering"] == "off", "SSE frames must not wait in a proxy buffer"
    assert nginx["proxy-request-buffering"] == "off", "uploads stream to the gateway"
    for key in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(nginx[key]) > timeout
    base64_json = 4 * math.ceil(chunk / 3) + 64 * 1024
    assert size_bytes(nginx["proxy-body-size"]) >= base64_json
    # The largest body the gateway itself accepts passes the edge.
    assert size_bytes(nginx["proxy-body-size"]) >= Settings(max_chunk_bytes=chunk).max_request_bytes
    assert size_bytes(nginx["proxy-body-size"]) <= base64_json + 3 * MiB, "a limit, not a hole"


def test_ingress_forwards_the_identity_header_from_the_auth_service(gpu_objs: list[k8s.Obj]) -> None:
    nginx = nginx_annotations(gpu_objs)
    header = settings_env(gpu_objs)["OMNI_GATEWAY_IDENTITY_HEADER"]
    assert nginx["auth-url"].startswith("http")
    assert nginx["auth-response-headers"] == header
    ingress = k8s.one(gpu_objs, "Ingress")
    paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == ["/v1/streaming_input", "/v1/chat/completions", "/v1/responses", "/v1/completions",
                     "/v1/audio",
                     "/v1/models", "/v1/realtime", "/v1/realtime/calls", "/v1/realtime/client_secrets"], (
        "metrics and probes stay inside the cluster")
    assert ingress["spec"]["tls"]


def test_user_annotations_override_and_other_controllers_get_none_of_nginx() -> None:
    objs = k8s.render({"ingress": {"enabled": True, "annotations": {
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"}}})
    assert nginx_annotations(objs)["proxy-read-timeout"] == "3600"
    objs = k8s.render({"ingress": {"enabled": True, "nginx": False, "className": "kong"}})
    assert "annotations" not in k8s.one(objs, "Ingress")["metadata"]


# --- lifecycle: probes, shutdown, security --------------------------------------

@pytest.mark.parametrize("values_file", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_termination_grace_covers_the_gateways_drain(values_file: str | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    values = render_manifests.load_values(values_file)
    objs = k8s.render(values)
    dep = deployment(objs)
    gateway = k8s.container(dep, "gateway")
    call = captured_cli_call(monkeypatch, gateway["args"])
    assert call["host"] == "0.0.0.0"
    assert call["port"] == gateway["ports"][0]["containerPort"] == 8080
    merged = helm_python.Chart.load(CHART).merge_values(values)["gracefulShutdown"]
    assert merged["drainSeconds"] == call["timeout_graceful_shutdown"], (
        "gracefulShutdown.drainSeconds must equal the uvicorn drain in gateway/runtime/cli.py")
    pre_stop = int(gateway["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = k8s.pod_spec(dep)["terminationGracePeriodSeconds"]
    assert grace == pre_stop + call["timeout_graceful_shutdown"] + merged["engineStopSeconds"]
    assert grace >= pre_stop + call["timeout_graceful_shutdown"] + 10


def test_a_plain_sidecar_outlives_the_gateways_drain() -> None:
    values = render_manifests.load_values(GPU_VALUES)
    values["engine"]["sidecar"]["native"] = False
    objs = k8s.render(values)
    for version in k8s.KUBE_VERSIONS:
        for obj in objs:
            k8s.validate(obj, version)
    dep = deployment(objs)
    assert "initContainers" not in k8s.pod_spec(dep)
    engine_stop = int(k8s.container(dep, "engine")["lifecycle"]["preStop"]["exec"]["command"][-1])
    gateway_stop = int(k8s.container(dep, "gateway")["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert engine_stop >= gateway_stop + 30


def test_in_process_gpu_engine_puts_the_gpu_on_the_gateway() -> None:
    objs = k8s.render({"image": {"variant": "gpu"}, "engine": {"kind": "omni", "gpu": {"enabled": True}}})
    dep = deployment(objs)
    assert [c["name"] for c in k8s.containers(dep)] == ["gateway"]
    assert k8s.container(dep, "gateway")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert settings_env(objs)["OMNI_GATEWAY_ENGINE"] == "omni"


def test_probe_windows_are_sized_for_model_load(default_objs: list[k8s.Obj], gpu_objs: list[k8s.Obj]) -> None:
    gateway = k8s.container(deployment(default_objs), "gateway")
    # In-process engine: /healthz answers only after the model loaded and compiled.
    assert k8s.probe_window(gateway["startupProbe"]) >= 300
    assert gateway["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    engine = k8s.container(deployment(gpu_objs), "engine")
    assert k8s.probe_window(engine["startupProbe"]) >= 1800, "download + load of a multi-GB model"


@pytest.mark.parametrize("values_file", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_pods_run_as_non_root_with_a_read_only_root(values_file: str | None) -> None:
    objs = k8s.render_values_file(values_file)
    for workload in k8s.of_kind(objs, "Deployment") + k8s.of_kind(objs, "StatefulSet"):
        pod = k8s.pod_spec(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in k8s.containers(workload):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    dep = deployment(objs)
    volumes = {v["name"]: v for v in k8s.pod_spec(dep)["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    for c in k8s.containers(dep):
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/home/omni/.cache", "/dev/shm"} <= mounts


def test_notes_say_how_the_gateway_reaches_the_sidecar() -> None:
    notes = render_manifests.render(render_manifests.load_values(GPU_VALUES))["omni-gateway/templates/NOTES.txt"]
    assert "OMNI_GATEWAY_ENGINE=openai-http" in notes and "127.0.0.1:8091" in notes
    assert "OMNI_GATEWAY_LEASE_TTL_SEC=10" in notes


# --- durability -------------------------------------------------------------------

REPLICA = {"redis": {"durability": "replica", "bundled": {"password": "pw"}}}


@pytest.mark.parametrize("version", k8s.KUBE_VERSIONS)
def test_durability_replica_adds_a_replica_and_a_sentinel_the_gateway_follows(version: str) -> None:
    objs = k8s.render(REPLICA)
    for obj in objs:
        k8s.validate(obj, version)
    env = settings_env(objs)
    settings = Settings(**{k.removeprefix("OMNI_GATEWAY_").lower(): v for k, v in env.items()})
    assert settings.redis_durability == "replica"
    assert settings.redis_sentinels == "omni-gateway-redis-sentinel:26379"
    replica = k8s.container(k8s.one(objs, "StatefulSet", "omni-gateway-redis-replica"), "redis")
    args = " ".join(replica["args"])
    assert "--replicaof omni-gateway-redis 6379" in args and "--masterauth $(REDIS_PASSWORD)" in args
    # The primary's Service picks the primary alone; the replica and Sentinel may reach it.
    service = k8s.one(objs, "Service", "omni-gateway-redis")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "redis"
    allowed = json.dumps(k8s.one(objs, "NetworkPolicy", "omni-gateway-redis")["spec"]["ingress"])
    assert "redis-replica" in allowed and "redis-sentinel" in allowed


def test_durability_sets_the_bundled_redis_fsync() -> None:
    for level, fsync in (("everysec", "everysec"), ("always", "always"), ("replica", "everysec")):
        conf = k8s.one(k8s.render({"redis": {"durability": level}}), "ConfigMap", "omni-gateway-redis")
        assert f"appendfsync {fsync}\n" in conf["data"]["redis.conf"]
        assert settings_env(k8s.render({"redis": {"durability": level}}))["OMNI_GATEWAY_REDIS_DURABILITY"] == level


def test_durability_replica_with_an_external_redis_names_its_sentinels() -> None:
    external = {"bundled": {"enabled": False}, "external": {"url": "redis://r:6379/0"}, "durability": "replica"}
    with pytest.raises(helm_python.HelmRenderError, match="redis.sentinels"):
        k8s.render({"redis": external})
    env = settings_env(k8s.render({"redis": {**external, "sentinels": "s1:26379,s2:26379"}}))
    assert env["OMNI_GATEWAY_REDIS_SENTINELS"] == "s1:26379,s2:26379"


def test_the_sentinel_config_runs_on_a_real_sentinel() -> None:
    """The file as the chart ships it, the primary's Service name replaced by a local Redis."""
    conf = k8s.one(k8s.render(REPLICA), "ConfigMap", "omni-gateway-redis-sentinel")["data"]["sentinel.conf"]
    from tests.redis_server import redis_process

    with redis_process() as primary, tempfile.TemporaryDirectory() as workdir:
        port = free_port()
        local = conf.replace("omni-gateway-redis 6379", f"127.0.0.1 {primary.port}").replace("port 26379", f"port {port}")
        path = Path(workdir) / "sentinel.conf"
        path.write_text(local)
        proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(path), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with redis.Redis(port=port, socket_timeout=2) as sentinel:
                        address = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", "omni-gateway")
                    break
                except redis.ConnectionError:
                    assert proc.poll() is None and time.monotonic() < deadline, "Sentinel refused the config"
                    time.sleep(0.05)
            assert [part.decode() for part in address] == ["127.0.0.1", str(primary.port)]
        finally:
            proc.terminate()
            proc.wait(timeout=10)
