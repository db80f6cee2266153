{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "kvi.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release and chart, unless overridden. */}}
{{- define "kvi.fullname" -}}
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

{{- define "kvi.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvi.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvi.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Secret holding the API token: the user's (auth.existingSecret), the chart's when
auth.token is set, or empty (no token: the mutating routes are open). */}}
{{- define "kvi.authSecret" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if .Values.auth.token }}
{{- include "kvi.fullname" . }}-auth
{{- end }}
{{- end }}

{{/* Names of the other objects: the full name shortened so that the suffix still fits the
63-character limit (a truncated suffix could collide with the full name itself). */}}
{{- define "kvi.peersName" -}}
{{- include "kvi.fullname" . | trunc 57 | trimSuffix "-" }}-peers
{{- end }}

{{- define "kvi.relayName" -}}
{{- include "kvi.fullname" . | trunc 57 | trimSuffix "-" }}-relay
{{- end }}

{{- define "kvi.stateClaim" -}}
{{- include "kvi.fullname" . | trunc 57 | trimSuffix "-" }}-state
{{- end }}

{{/* The relay's pods carry their own app.kubernetes.io/name: the indexer's selector (name and
instance, immutable in a Deployment) must not match them, or the Service, the PDB, the
NetworkPolicy and the peers' Service would count relays as replicas. */}}
{{- define "kvi.relaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvi.name" . | trunc 57 | trimSuffix "-" }}-relay
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: relay
{{- end }}

{{- define "kvi.relayLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvi.relaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Refuse values that would leak the token or lock everyone out. */}}
{{- define "kvi.validate" -}}
{{- if or (hasKey .Values.config "api_token") (hasKey .Values.config "api_token_file") }}
{{- fail "set the API token with auth.token or auth.existingSecret, not under config (the ConfigMap is not a Secret)" }}
{{- end }}
{{- if hasKey .Values.config "auth_reads" }}
{{- fail "set auth.authReads, not config.auth_reads (the ServiceMonitor needs to know)" }}
{{- end }}
{{- if and .Values.auth.token (lt (len .Values.auth.token) 16) }}
{{- fail "auth.token: at least 16 characters (the service refuses a shorter one at start)" }}
{{- end }}
{{- if and .Values.auth.authReads (not (include "kvi.authSecret" .)) }}
{{- fail "auth.authReads needs a token: set auth.token or auth.existingSecret" }}
{{- end }}
{{- range $key := list "state_dir" "snapshot_interval_s" "bootstrap_from" "nats_url" "nats_stream" "nats_subject" "nats_bucket" }}
{{- if hasKey $.Values.config $key }}
{{- fail (printf "set %s with the chart's persistence, bootstrap and nats values, not under config (the chart mounts the volume, renders the peers' Service and gives the relay the same names)" $key) }}
{{- end }}
{{- end }}
{{- with .Values.persistence }}
{{- if .enabled }}
{{- if not (or (eq .kind "pvc") (eq .kind "emptyDir")) }}
{{- fail (printf "persistence.kind: pvc or emptyDir, not %q" .kind) }}
{{- end }}
{{- if and (eq .kind "pvc") (gt (int $.Values.replicaCount) 1) }}
{{- fail "persistence.kind pvc needs replicaCount 1: a Deployment's replicas would share one claim and one snapshot file. With several replicas use persistence.kind emptyDir (per pod, survives container restarts) with bootstrap.enabled (a new pod copies a ready peer), or the relay and nats (snapshots in the object store); see docs/state.md" }}
{{- end }}
{{- if $.Values.nats.enabled }}
{{- fail "persistence with nats.enabled: in NATS mode the replicas keep their snapshots in the JetStream object store (nats.bucket); turn persistence off" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (or .Values.relay.enabled .Values.nats.enabled) (not .Values.nats.url) }}
{{- fail "nats.url is required with relay.enabled or nats.enabled: the NATS server with JetStream, e.g. nats://nats.nats.svc:4222 (install it with the nats-io/k8s chart, see docs/state.md)" }}
{{- end }}
{{- with .Values.nats.url }}
{{- if not (or (hasPrefix "nats://" .) (hasPrefix "tls://" .) (hasPrefix "ws://" .) (hasPrefix "wss://" .)) }}
{{- fail (printf "nats.url: a nats://, tls://, ws:// or wss:// URL, got %q" .) }}
{{- end }}
{{- end }}
{{- end }}
