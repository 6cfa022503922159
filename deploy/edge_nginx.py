"""An NGINX edge for the local cluster and the tests, made from the production Ingress.

    .venv/bin/python deploy/edge_nginx.py --listen 8080 --upstream 127.0.0.1:8081 \\
        --upstream 127.0.0.1:8082 --prefix /tmp/edge > /tmp/edge/nginx.conf
    nginx -p /tmp/edge -c /tmp/edge/nginx.conf

Not a hand-written twin: the paths and the ``nginx.ingress.kubernetes.io/*``
annotations of ``deploy/api-gateway/ingress-nginx.yaml`` (the edge the chart's
Ingress mirrors) are turned into the directives ingress-nginx generates for
them, plus what ingress-nginx does on every location (WebSocket upgrade
headers, ``X-Request-ID``). Upstreams are plain round robin, no stickiness.
The external-auth annotations (``auth-*``) need the auth service and are left
out here; the gateway's own API keys or identity header still apply. The
tests in ``tests/edge/`` prove each setting through this file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

INGRESS = Path(__file__).resolve().parent / "api-gateway" / "ingress-nginx.yaml"
ANNOTATION = "nginx.ingress.kubernetes.io/"


def ingress_settings(path: Path = INGRESS) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The Ingress's nginx annotations (without the prefix) and its (path, pathType)s."""
    ingress = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "Ingress")
    annotations = {k[len(ANNOTATION):]: str(v) for k, v in ingress["metadata"]["annotations"].items()
                   if k.startswith(ANNOTATION)}
    paths = [(p["path"], p["pathType"]) for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    return annotations, paths


def _location_directives(a: dict[str, Any]) -> list[str]:
    on_off = {"on": "on", "off": "off"}
    lines = [
        # ingress-nginx on every location: WebSockets pass, the request id goes through.
        "proxy_set_header Upgrade $http_upgrade;",
        "proxy_set_header Connection $connection_upgrade;",
        "proxy_set_header X-Request-ID $req_id;",
        "proxy_set_header Host $host;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_set_header X-Forwarded-Proto $scheme;",
        "proxy_redirect off;",  # ingress-nginx's default: Location (a call's) passes as the gateway wrote it
        f"proxy_http_version {a.get('proxy-http-version', '1.1')};",
        f"proxy_buffering {on_off[a.get('proxy-buffering', 'on')]};",
        f"proxy_request_buffering {on_off[a.get('proxy-request-buffering', 'on')]};",
        f"proxy_read_timeout {a.get('proxy-read-timeout', '60')}s;",
        f"proxy_send_timeout {a.get('proxy-send-timeout', '60')}s;",
        f"client_max_body_size {a.get('proxy-body-size', '1m')};",
        "proxy_pass http://omni_gateway;",
    ]
    if "limit-rps" in a:
        burst = int(a["limit-rps"]) * int(a.get("limit-burst-multiplier", "5"))
        lines.append(f"limit_req zone=per_client burst={burst} nodelay;")
        lines.append("limit_req_status 429;  # ingress-nginx: limit-req-status-code (controller config)")
    return lines


def render(upstreams: list[str], listen: int, prefix: Path, ingress: Path = INGRESS) -> str:
    annotations, paths = ingress_settings(ingress)
    directives = "\n".join(f"            {d}" for d in _location_directives(annotations))
    locations = "\n".join(
        f"        location {'= ' if kind == 'Exact' else ''}{path} {{\n{directives}\n        }}"
        for path, kind in paths)
    rate = f"    limit_req_zone $binary_remote_addr zone=per_client:10m rate={annotations['limit-rps']}r/s;\n" \
        if "limit-rps" in annotations else ""
    servers = "\n".join(f"        server {u};" for u in upstreams)
    return f"""# Rendered by deploy/edge_nginx.py from {ingress.name}; do not edit.
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    map $http_upgrade $connection_upgrade {{ default upgrade; "" ""; }}
    map $http_x_request_id $req_id {{ default $http_x_request_id; "" $request_id; }}
{rate}    upstream omni_gateway {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{listen};
        # Where the edge answers itself, it answers in the gateway's envelope.
        error_page 413 = @too_large;
        error_page 429 = @too_many;
        location @too_many {{
            default_type application/json;
            add_header Retry-After 1 always;
            return 429 '{{"error":{{"message":"too many requests from this address; slow down","type":"rate_limit_error","code":"rate_limit_exceeded","param":null}}}}';
        }}
        location @too_large {{
            default_type application/json;
            return 413 '{{"error":{{"message":"request body exceeds the edge limit of {annotations.get("proxy-body-size", "1m")}","type":"invalid_request_error","code":"request_too_large","param":null}}}}';
        }}
{locations}
        location / {{ default_type application/json; return 404 '{{"error":{{"message":"not routed by the edge","type":"invalid_request_error","code":"not_found","param":null}}}}'; }}
    }}
}}
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True, help="host:port of a gateway replica")
    parser.add_argument("--prefix", type=Path, required=True, help="nginx's working directory (logs, temp)")
    args = parser.parse_args(argv)
    print(render(args.upstream, args.listen, args.prefix.resolve()), end="")


if __name__ == "__main__":
    main()
