{{/* Names and labels. */}}
{{- define "swaserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "swaserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "swaserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "swaserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "swaserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "swaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The image of the swaserve containers: the CPU tag in the demo. */}}
{{- define "swaserve.image" -}}
{{- $tag := ternary .Values.demo.imageTag .Values.image.tag .Values.demo.enabled -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The model dir inside the containers ("" in the demo: the server makes the demo model). */}}
{{- define "swaserve.modelDir" -}}
{{- if not .Values.demo.enabled -}}
{{- $sub := .Values.model.subPath | default (ternary "model" "" (eq .Values.model.source "uri")) -}}
{{- if $sub -}}{{ printf "/models/%s" (trimPrefix "/" $sub) }}{{- else -}}/models{{- end -}}
{{- end -}}
{{- end -}}

{{- define "swaserve.modelCacheClaim" -}}
{{- .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "swaserve.fullname" .)) -}}
{{- end -}}

{{/* A number as Ray / argparse expect it: integral values without exponent or fraction
     (Helm reads every number of the values as float64, and 8e+10 is no int). */}}
{{- define "swaserve.scalar" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* The Serve app's args (ServeAppArgs), as a YAML mapping. */}}
{{- define "swaserve.serveArgs" -}}
{{- $args := dict "replicas" (int64 .Values.replicas) "tp_size" (int64 .Values.tensorParallelSize) "use_gpu" (not .Values.demo.enabled) "device" (ternary "cpu" "cuda" .Values.demo.enabled) "max_ongoing_requests" (int64 .Values.serve.maxOngoingRequests) "ingress_replicas" (int64 .Values.serve.ingressReplicas) "routing" .Values.serve.routing -}}
{{- $model := include "swaserve.modelDir" . -}}
{{- if $model }}{{ $_ := set $args "model" $model }}{{ end -}}
{{- if .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" .Values.model.servedModelName }}{{ end -}}
{{- range $k, $v := .Values.engine -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $args $k (ternary (include "swaserve.scalar" $v | int64) $v (and (kindIs "float64" $v) (eq $v (floor $v)))) -}}
{{- end -}}
{{- end -}}
{{- range $k, $v := .Values.router -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $args (printf "router_%s" $k) (ternary (include "swaserve.scalar" $v | int64) $v (and (kindIs "float64" $v) (eq $v (floor $v)))) -}}
{{- end -}}
{{- end -}}
{{- range $k, $v := .Values.limits -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $args (printf "limit_%s" $k) (ternary (include "swaserve.scalar" $v | int64) $v (and (kindIs "float64" $v) (eq $v (floor $v)))) -}}
{{- end -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* `swaserve serve` flags of the engine, router and limit knobs (mode plain). */}}
{{- define "swaserve.knobFlags" -}}
{{- range $k, $v := .Values.engine -}}
{{- if not (kindIs "invalid" $v) }} --{{ $k | replace "_" "-" }} {{ include "swaserve.scalar" $v | quote }}{{ end -}}
{{- end -}}
{{- range $k, $v := .Values.router -}}
{{- if not (kindIs "invalid" $v) }} --router-{{ $k | replace "_" "-" }} {{ include "swaserve.scalar" $v | quote }}{{ end -}}
{{- end -}}
{{- range $k, $v := .Values.limits -}}
{{- if not (kindIs "invalid" $v) }} --limit-{{ $k | replace "_" "-" }} {{ include "swaserve.scalar" $v | quote }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* nodeSelector of the worker pods: the GPU product pin merged in. */}}
{{- define "swaserve.workerNodeSelector" -}}
{{- $sel := deepCopy .Values.worker.nodeSelector -}}
{{- if and (not .Values.demo.enabled) .Values.gpu.product -}}
{{- $_ := set $sel .Values.gpu.productLabel .Values.gpu.product -}}
{{- end -}}
{{- if $sel }}{{ toYaml $sel }}{{ end -}}
{{- end -}}

{{/* Resources of a worker pod: CPU / memory from values, tensorParallelSize GPUs. */}}
{{- define "swaserve.workerResources" -}}
{{- if .Values.demo.enabled -}}
{{- toYaml .Values.demo.resources -}}
{{- else -}}
{{- $r := deepCopy .Values.worker.resources -}}
{{- $limits := get $r "limits" | default dict -}}
{{- $requests := get $r "requests" | default dict -}}
{{- $_ := set $limits .Values.gpu.resourceName (int64 .Values.tensorParallelSize) -}}
{{- $_ := set $requests .Values.gpu.resourceName (int64 .Values.tensorParallelSize) -}}
{{- $_ := set $r "limits" $limits -}}
{{- $_ := set $r "requests" $requests -}}
{{- toYaml $r -}}
{{- end -}}
{{- end -}}

{{- define "swaserve.headResources" -}}
{{- toYaml (ternary .Values.demo.resources .Values.head.resources .Values.demo.enabled) -}}
{{- end -}}

{{/* Volumes holding the model (pod spec level) and their mounts. */}}
{{- define "swaserve.modelVolumes" -}}
{{- if not .Values.demo.enabled }}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "swaserve.modelCacheClaim" . }}
{{- end }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.worker.shmSize }}
- name: cache
  emptyDir: {}
{{- if and .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required with tls.enabled" .Values.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "swaserve.modelMounts" -}}
{{- if not .Values.demo.enabled }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
- name: dshm
  mountPath: /dev/shm
- name: cache
  mountPath: /var/cache/swaserve
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/swaserve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The init container that copies model.uri into the model cache once per cache. */}}
{{- define "swaserve.downloadInit" -}}
{{- if and (not .Values.demo.enabled) (eq .Values.model.source "uri") }}
- name: model-download
  image: {{ printf "%s:%s" .Values.model.download.image.repository .Values.model.download.image.tag }}
  command: ["/bin/sh", "-ec"]
  args:
    - |
      dest="{{ include "swaserve.modelDir" . }}"
      if [ -f "$dest/config.json" ]; then echo "model cached in $dest"; exit 0; fi
      tmp="$dest.partial-$HOSTNAME"
      rm -rf "$tmp"
      rclone copy --checkers 16 --transfers 8 "$MODEL_URI" "$tmp"
      mv "$tmp" "$dest" || test -f "$dest/config.json"
  env:
    - name: MODEL_URI
      value: {{ required "model.uri is required with model.source=uri" .Values.model.uri | quote }}
  {{- with .Values.model.download.envFromSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  {{- with .Values.model.download.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: /models
{{- end }}
{{- end -}}

{{/* Env of every swaserve container. */}}
{{- define "swaserve.env" -}}
- name: SWASERVE_CACHE_DIR
  value: /var/cache/swaserve
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- with .Values.auth.tokenSecret.name }}
- name: SWASERVE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.tokenSecret.key }}
{{- end }}
{{- with .Values.auth.apiKeySecret.name }}
- name: SWASERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.apiKeySecret.key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "swaserve.probeKind" -}}
{{- if and .Values.tls.enabled .Values.tls.mutual -}}
exec
{{- else -}}
{{- ternary "http" .Values.probes.kind .Values.tls.enabled -}}
{{- end -}}
{{- end -}}

{{/* One probe: {{ include "swaserve.probe" (list $ .Values.probes.readiness) }} */}}
{{- define "swaserve.probe" -}}
{{- $root := index . 0 -}}
{{- $p := index . 1 -}}
{{- $kind := include "swaserve.probeKind" $root -}}
{{- if eq $kind "grpc" }}
grpc:
  port: {{ $root.Values.ports.grpc }}
{{- else if eq $kind "exec" }}
exec:
  command:
    - swaserve
    - client
    - --server
    - 127.0.0.1:{{ $root.Values.ports.grpc }}
    - --health
    - --timeout-s
    - {{ max 1 (sub $p.timeoutSeconds 1) | quote }}
    - --tls-ca-file
    - /etc/swaserve/tls/ca.crt
    - --tls-cert-file
    - /etc/swaserve/tls/tls.crt
    - --tls-key-file
    - /etc/swaserve/tls/tls.key
    - --tls-server-name
    - {{ $root.Values.tls.serverName | default (printf "%s.%s.svc" (include "swaserve.fullname" $root) $root.Release.Namespace) }}
{{- else }}
httpGet:
  path: /health
  port: http
  {{- if $root.Values.tls.enabled }}
  scheme: HTTPS
  {{- end }}
{{- end }}
periodSeconds: {{ $p.periodSeconds }}
failureThreshold: {{ $p.failureThreshold }}
timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end -}}
