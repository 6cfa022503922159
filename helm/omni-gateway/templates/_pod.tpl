{{/* Writable paths under a read-only root filesystem, shared by both containers. */}}
{{- define "omni-gateway.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/omni/.cache
- name: dshm
  mountPath: /dev/shm
{{- if .Values.modelVolume.enabled }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
{{- end }}
{{- end }}

{{/*
The vLLM-Omni engine sidecar: `vllm serve <model> [--omni]` on the pod's
loopback only, so nothing outside the pod reaches it past the gateway. The
probes are exec probes for that reason (kubelet HTTP probes use the pod IP).
native=true: an init container with restartPolicy Always (started and probed
before the gateway, stopped after it). native=false: a plain container whose
preStop outlasts the gateway's drain.
*/}}
{{- define "omni-gateway.engineContainer" -}}
{{- $root := .root -}}
{{- $s := $root.Values.engine.sidecar -}}
{{- $health := printf "import urllib.request as u; u.urlopen('http://127.0.0.1:%d/health', timeout=4)" (int64 $s.port) -}}
- name: engine
  image: {{ include "omni-gateway.engineImage" $root }}
  imagePullPolicy: {{ $s.image.pullPolicy }}
  {{- if .native }}
  restartPolicy: Always
  {{- end }}
  command: ["vllm", "serve"]
  args:
    - {{ $s.model | quote }}
    - --host
    - 127.0.0.1
    - --port
    - {{ $s.port | quote }}
    - --served-model-name
    {{- /* vLLM takes several names as separate arguments; the gateway's setting, comma-separated */}}
    {{- range splitList "," (include "omni-gateway.engineServedName" $root) }}
    - {{ trim . | quote }}
    {{- end }}
    {{- if $s.omni }}
    - --omni
    {{- end }}
    {{- with $s.toolCallParser }}
    - --enable-auto-tool-choice
    - --tool-call-parser
    - {{ . | quote }}
    {{- end }}
    {{- range $s.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: VLLM_NO_USAGE_STATS
      value: "1"
    - name: DO_NOT_TRACK
      value: "1"
    {{- if $root.Values.modelVolume.enabled }}
    - name: HF_HOME
      value: {{ printf "%s/huggingface" $root.Values.modelVolume.mountPath | quote }}
    {{- end }}
    {{- with $root.Values.engine.hfTokenSecret }}
    {{- if .name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ .name }}
          key: {{ .key }}
    {{- end }}
    {{- end }}
    {{- with $s.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  startupProbe:
    exec:
      command:
        - python3
        - -c
        - {{ $health | quote }}
    {{- toYaml $s.startupProbe | nindent 4 }}
  livenessProbe:
    exec:
      command:
        - python3
        - -c
        - {{ $health | quote }}
    {{- toYaml $s.livenessProbe | nindent 4 }}
  readinessProbe:
    exec:
      command:
        - python3
        - -c
        - {{ $health | quote }}
    {{- toYaml $s.readinessProbe | nindent 4 }}
  {{- if not .native }}
  lifecycle:
    preStop:
      exec:
        command: ["sleep", {{ add (int64 $root.Values.gracefulShutdown.preStopSleepSeconds) (int64 $root.Values.gracefulShutdown.drainSeconds) | quote }}]
  {{- end }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "omni-gateway.volumeMounts" $root | nindent 4 }}
{{- end }}
