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
{{- end }}
