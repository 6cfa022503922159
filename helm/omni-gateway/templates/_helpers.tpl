{{/* Names */}}
{{- define "omni-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "omni-gateway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "omni-gateway.redisName" -}}
{{- printf "%s-redis" (include "omni-gateway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "omni-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels. The component label keeps the gateway and Redis selectors apart. */}}
{{- define "omni-gateway.commonLabels" -}}
helm.sh/chart: {{ include "omni-gateway.chart" . }}
app.kubernetes.io/name: {{ include "omni-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "omni-gateway.labels" -}}
{{ include "omni-gateway.commonLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "omni-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omni-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "omni-gateway.redisLabels" -}}
{{ include "omni-gateway.commonLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "omni-gateway.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "omni-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "omni-gateway.redisReplicaName" -}}
{{- printf "%s-redis-replica" (include "omni-gateway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "omni-gateway.redisSentinelName" -}}
{{- printf "%s-redis-sentinel" (include "omni-gateway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The bundled Redis's replica and Sentinel (durability replica): labels of their own, so the
primary's Service never routes to them. */}}
{{- define "omni-gateway.redisPartSelectorLabels" -}}
app.kubernetes.io/name: {{ include "omni-gateway.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .part }}
{{- end }}

{{/* The Sentinels the gateway asks for the primary (durability replica). */}}
{{- define "omni-gateway.redisSentinels" -}}
{{- if .Values.redis.bundled.enabled }}{{ printf "%s:26379" (include "omni-gateway.redisSentinelName" .) }}{{ else }}{{ .Values.redis.sentinels }}{{ end }}
{{- end }}

{{/* Sentinel's own file: it rewrites it as it learns, so it is copied to a writable place at start. */}}
{{- define "omni-gateway.sentinelConf" -}}
port 26379
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel monitor {{ .Values.redis.sentinelMaster }} {{ include "omni-gateway.redisName" . }} 6379 1
sentinel down-after-milliseconds {{ .Values.redis.sentinelMaster }} 5000
sentinel failover-timeout {{ .Values.redis.sentinelMaster }} 30000
{{- end }}

{{- define "omni-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omni-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Images */}}
{{- define "omni-gateway.image" -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "omni-gateway.engineImage" -}}
{{- $s := .Values.engine.sidecar.image }}
{{- if $s.repository }}
{{- printf "%s:%s" $s.repository (default .Chart.AppVersion $s.tag) }}
{{- else }}
{{- include "omni-gateway.image" . }}
{{- end }}
{{- end }}

{{/* Engine wiring */}}
{{- define "omni-gateway.engineKind" -}}
{{- if .Values.engine.sidecar.enabled }}openai-http{{ else }}{{ .Values.engine.kind }}{{ end }}
{{- end }}

{{- define "omni-gateway.engineServedName" -}}
{{- default (.Values.engine.sidecar.model | splitList "/" | last) .Values.engine.sidecar.servedModelName }}
{{- end }}

{{/* Secrets */}}
{{- define "omni-gateway.secretName" -}}
{{- include "omni-gateway.fullname" . }}
{{- end }}

{{- define "omni-gateway.redisSecretName" -}}
{{- default (include "omni-gateway.secretName" .) .Values.redis.external.existingSecret }}
{{- end }}

{{- define "omni-gateway.redisSecretKey" -}}
{{- if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}OMNI_GATEWAY_REDIS_URL{{ end }}
{{- end }}

{{- define "omni-gateway.apiKeysSecretName" -}}
{{- default (include "omni-gateway.secretName" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "omni-gateway.redisUrl" -}}
{{- if .Values.redis.bundled.enabled }}
{{- $auth := "" }}
{{- if .Values.redis.bundled.password }}{{ $auth = printf ":%s@" (.Values.redis.bundled.password | urlquery) }}{{ end }}
{{- printf "redis://%s%s:6379/0" $auth (include "omni-gateway.redisName" .) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* Edge limits derived from the settings */}}
{{- define "omni-gateway.proxyTimeoutSeconds" -}}
{{- if .Values.ingress.proxyTimeoutSeconds }}{{ int64 .Values.ingress.proxyTimeoutSeconds }}{{ else }}{{ add (int64 .Values.settings.sessionTimeoutSec) 60 }}{{ end }}
{{- end }}

{{/* A JSON chunk carries base64 (4/3 of the raw cap) plus up to 64 KiB of fields; +1 MiB margin. */}}
{{- define "omni-gateway.maxBodySize" -}}
{{- if .Values.ingress.maxBodySize }}{{ .Values.ingress.maxBodySize }}{{ else }}
{{- $raw := int64 .Values.settings.maxChunkBytes }}
{{- $json := add (mul (div (add $raw 2) 3) 4) 65536 }}
{{- $mib := div (add $json 1048575) 1048576 }}
{{- printf "%dm" (add $mib 1) }}
{{- end }}
{{- end }}

{{- define "omni-gateway.terminationGracePeriodSeconds" -}}
{{- $g := .Values.gracefulShutdown }}
{{- add (int64 $g.preStopSleepSeconds) (int64 $g.drainSeconds) (int64 $g.engineStopSeconds) }}
{{- end }}

{{/* Configuration errors the schema cannot express */}}
{{- define "omni-gateway.validate" -}}
{{- $external := or .Values.redis.external.url .Values.redis.external.existingSecret }}
{{- if and .Values.redis.bundled.enabled $external }}
{{- fail "redis: set either redis.bundled.enabled or redis.external.url/existingSecret, not both" }}
{{- end }}
{{- if not (or .Values.redis.bundled.enabled $external) }}
{{- fail "redis: every replica must share one Redis; enable redis.bundled or set redis.external.url / existingSecret" }}
{{- end }}
{{- if and (eq .Values.redis.durability "replica") (not .Values.redis.bundled.enabled) (not .Values.redis.sentinels) }}
{{- fail "redis.durability replica with an external Redis needs redis.sentinels: the Sentinels that name its primary" }}
{{- end }}
{{- if and .Values.ingress.enabled .Values.ingress.auth.url (not .Values.settings.identityHeader) }}
{{- fail "ingress.auth.url needs settings.identityHeader: the header that carries the authenticated identity" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.from) }}
{{- fail "networkPolicy.from: list the peers (the API gateway, Prometheus) allowed to reach the gateway" }}
{{- end }}
{{- $volumes := 0 }}
{{- if .Values.modelVolume.existingClaim }}{{ $volumes = add1 $volumes }}{{ end }}
{{- if .Values.modelVolume.hostPath }}{{ $volumes = add1 $volumes }}{{ end }}
{{- if gt (int $volumes) 1 }}
{{- fail "modelVolume: set at most one of existingClaim and hostPath" }}
{{- end }}
{{- end }}

{{/* The bundled Redis: every acknowledged chunk must survive a restart (AOF),
and no key may ever be evicted (sessions expire by their own TTLs). */}}
{{- define "omni-gateway.redisConf" -}}
port 6379
bind * -::*
protected-mode no
appendonly yes
appendfsync {{ if eq .Values.redis.durability "always" }}always{{ else }}everysec{{ end }}
save ""
maxmemory-policy noeviction
{{- end }}
