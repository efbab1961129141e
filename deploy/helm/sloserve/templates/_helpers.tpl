{{/* The release's name for every object, at most 63 characters. */}}
{{- define "sloserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sloserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sloserve.labels" -}}
{{ include "sloserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sloserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
The server config: the values' config with the settings the chart owns laid
over it, so ports, paths and the shutdown timing always match the pod spec.
*/}}
{{- define "sloserve.config" -}}
{{- $owned := dict
  "listen" (dict
    "http" (printf ":%d" (int .Values.ports.http))
    "grpc" (printf ":%d" (int .Values.ports.grpc))
    "metrics" (printf ":%d" (int .Values.ports.metrics)))
  "repositories" (list "/models")
  "limits" (dict
    "shutdown_delay" (printf "%ds" (int .Values.shutdownDelaySeconds))
    "grace_period" (printf "%ds" (int .Values.gracePeriodSeconds)))
  "control" (dict "profile" (dict "cache_dir" "/var/cache/sloserve/profiles"))
-}}
{{- mustMergeOverwrite (deepCopy (.Values.config | default dict)) $owned | toYaml -}}
{{- end -}}

{{- define "sloserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "sloserve.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}
