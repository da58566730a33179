{{/* vim: set filetype=mustache: */}}

{{/* Chart name, truncated to a DNS label. */}}
{{- define "wavefront.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified app name. Truncated to 40 characters so that
"<fullname>-worker-<set>" stays short enough for StatefulSet pod labels
(controller-revision-hash adds a suffix; names must stay under 63).
*/}}
{{- define "wavefront.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "wavefront.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "wavefront.labels" -}}
helm.sh/chart: {{ include "wavefront.chart" . }}
{{ include "wavefront.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: wavefront
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select this release's pods (never change these on upgrade). */}}
{{- define "wavefront.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wavefront.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Router names and selector labels. */}}
{{- define "wavefront.router.fullname" -}}
{{- printf "%s-router" (include "wavefront.fullname" .) -}}
{{- end -}}

{{- define "wavefront.router.selectorLabels" -}}
{{ include "wavefront.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{/*
Worker set name. Call with (dict "root" $ "name" $w.name).
*/}}
{{- define "wavefront.worker.fullname" -}}
{{- printf "%s-worker-%s" (include "wavefront.fullname" .root) .name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "wavefront.worker.selectorLabels" -}}
{{ include "wavefront.selectorLabels" .root }}
app.kubernetes.io/component: worker
wavefront.dev/worker-set: {{ .name }}
{{- end -}}

{{- define "wavefront.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "wavefront.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference. Call with (dict "root" $ "image" $imageMap). */}}
{{- define "wavefront.image" -}}
{{- $img := .image -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The effective settings of one worker set: workerDefaults deep-merged with the
entry (the entry wins; empty values in the entry fall back to the defaults).
Call with (dict "root" $ "worker" $entry); returns YAML, read with fromYaml.
*/}}
{{- define "wavefront.worker.effective" -}}
{{- $w := mergeOverwrite (deepCopy .root.Values.workerDefaults) (deepCopy .worker) -}}
{{- if hasKey .worker "replicas" -}}
{{- $_ := set $w "replicas" .worker.replicas -}}
{{- end -}}
{{- $img := mergeOverwrite (deepCopy .root.Values.image) (default dict .worker.image) -}}
{{- $_ := set $w "image" $img -}}
{{- toYaml $w -}}
{{- end -}}

{{/* Settings shared by router and workers (ConfigMap data). */}}
{{- define "wavefront.common.env" -}}
RUST_LOG: {{ .Values.logging.filter | quote }}
WAVEFRONT_LOG_FORMAT: {{ .Values.logging.format | quote }}
{{- if .Values.tracing.otlpEndpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT: {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
WAVEFRONT_TRACE_SAMPLING_RATIO: {{ .Values.tracing.samplingRatio | toString | quote }}
{{- if .Values.metrics.enabled }}
WAVEFRONT_METRICS_LISTEN: {{ printf "%s:%d" .Values.listenHost (int .Values.metrics.port) | quote }}
{{- end }}
{{- end -}}

{{/* The router's --workers list: every worker set's headless Service, plus extras. */}}
{{- define "wavefront.router.workers" -}}
{{- $root := . -}}
{{- $targets := list -}}
{{- range .Values.workers -}}
{{- $w := fromYaml (include "wavefront.worker.effective" (dict "root" $root "worker" .)) -}}
{{- $svc := include "wavefront.worker.fullname" (dict "root" $root "name" $w.name) -}}
{{- $targets = append $targets (printf "%s.%s.svc.%s:%d" $svc $root.Release.Namespace $root.Values.clusterDomain (int $w.grpcPort)) -}}
{{- end -}}
{{- range .Values.router.extraWorkers -}}
{{- $targets = append $targets . -}}
{{- end -}}
{{- join "," $targets -}}
{{- end -}}

{{/* Router settings (ConfigMap data). */}}
{{- define "wavefront.router.env" -}}
WAVEFRONT_LISTEN: {{ printf "%s:%d" .Values.listenHost (int .Values.router.grpcPort) | quote }}
WAVEFRONT_WORKERS: {{ include "wavefront.router.workers" . | quote }}
WAVEFRONT_REFRESH_MS: {{ .Values.router.refreshMs | int64 | toString | quote }}
{{- if .Values.router.httpPort }}
WAVEFRONT_HTTP_LISTEN: {{ printf "%s:%d" .Values.listenHost (int .Values.router.httpPort) | quote }}
{{- end }}
{{- if .Values.tls.routerSecret }}
WAVEFRONT_TLS_CERT: "/etc/wavefront/tls/public/tls.crt"
WAVEFRONT_TLS_KEY: "/etc/wavefront/tls/public/tls.key"
{{- end }}
{{- if .Values.tls.workerSecret }}
WAVEFRONT_WORKER_TLS_CA: "/etc/wavefront/tls/workers/ca.crt"
WAVEFRONT_WORKER_TLS_CERT: "/etc/wavefront/tls/workers/tls.crt"
WAVEFRONT_WORKER_TLS_KEY: "/etc/wavefront/tls/workers/tls.key"
{{- end }}
{{- end -}}

{{/* Credentials from Secrets, as env entries. Call with (dict "root" $ "apiKeys" BOOL): the
router takes the API keys and the worker token, workers the worker token only. */}}
{{- define "wavefront.auth.env" -}}
{{- $a := .root.Values.auth -}}
{{- if and .apiKeys $a.apiKeySecret.name }}
- name: WAVEFRONT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $a.apiKeySecret.name | quote }}
      key: {{ $a.apiKeySecret.key | quote }}
{{- end }}
{{- if $a.workerTokenSecret.name }}
- name: WAVEFRONT_WORKER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $a.workerTokenSecret.name | quote }}
      key: {{ $a.workerTokenSecret.key | quote }}
{{- end }}
{{- end -}}

{{/* One worker set's settings (ConfigMap data). Call with (dict "root" $ "w" $effective). */}}
{{- define "wavefront.worker.env" -}}
{{- $w := .w -}}
WAVEFRONT_LISTEN: {{ printf "%s:%d" .root.Values.listenHost (int $w.grpcPort) | quote }}
{{- if and $w.model $w.model.path }}
WAVEFRONT_MODEL: {{ $w.model.path | quote }}
{{- end }}
{{- if $w.servedName }}
WAVEFRONT_MODEL_NAME: {{ $w.servedName | quote }}
{{- end }}
WAVEFRONT_DEVICE: {{ $w.device | quote }}
{{- if $w.dtype }}
WAVEFRONT_DTYPE: {{ $w.dtype | quote }}
{{- end }}
{{- if gt (int (default 1 $w.tensorParallel)) 1 }}
WAVEFRONT_TENSOR_PARALLEL: {{ $w.tensorParallel | int64 | toString | quote }}
{{- end }}
{{- if $w.collective }}
WAVEFRONT_COLLECTIVE: {{ $w.collective | quote }}
{{- end }}
{{- if $w.attention }}
WAVEFRONT_ATTENTION: {{ $w.attention | quote }}
{{- end }}
WAVEFRONT_MEMORY_BUDGET_MB: {{ $w.memoryBudgetMb | int64 | toString | quote }}
{{- if $w.kvCacheDtype }}
WAVEFRONT_KV_CACHE_DTYPE: {{ $w.kvCacheDtype | quote }}
{{- end }}
{{- if $w.kvReserve }}
WAVEFRONT_KV_RESERVE: {{ $w.kvReserve | quote }}
{{- end }}
{{- if not (kindIs "invalid" $w.maxBatchRows) }}
WAVEFRONT_MAX_BATCH_ROWS: {{ $w.maxBatchRows | int64 | toString | quote }}
{{- end }}
WAVEFRONT_QUEUE_CAPACITY: {{ $w.queueCapacity | int64 | toString | quote }}
WAVEFRONT_MAX_ACTIVE: {{ $w.maxActive | int64 | toString | quote }}
WAVEFRONT_DRAIN_TIMEOUT_S: {{ $w.drainTimeoutS | int64 | toString | quote }}
{{- if .root.Values.tls.workerSecret }}
WAVEFRONT_TLS_CERT: "/etc/wavefront/tls/workers/tls.crt"
WAVEFRONT_TLS_KEY: "/etc/wavefront/tls/workers/tls.key"
WAVEFRONT_TLS_CLIENT_CA: "/etc/wavefront/tls/workers/ca.crt"
{{- end }}
{{- end -}}

{{/*
A native gRPC probe. Call with (dict "port" N "service" "name" "timing" $map).
*/}}
{{- define "wavefront.grpcProbe" -}}
grpc:
  port: {{ int .port }}
  service: {{ .service | quote }}
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A probe that works whether the port speaks TLS or not: the gRPC health probe on a
plaintext port; over TLS (Kubernetes' gRPC probes cannot do TLS) an HTTPS GET when `https`
names a port serving /health, else a TCP check. Call with (dict "tls" BOOL "port" N "service"
S "https" PORTNAME-or-"" "timing" T). */}}
{{- define "wavefront.probe" -}}
{{- if not .tls -}}
{{ include "wavefront.grpcProbe" . }}
{{- else if .https -}}
httpGet:
  path: /health
  port: {{ .https }}
  scheme: HTTPS
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- else -}}
tcpSocket:
  port: {{ int .port }}
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* preStop hook: a short sleep so endpoints drop the pod before SIGTERM. */}}
{{- define "wavefront.preStop" -}}
{{- if gt (int .) 0 -}}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sleep", {{ . | int64 | toString | quote }}]
{{- end -}}
{{- end -}}
