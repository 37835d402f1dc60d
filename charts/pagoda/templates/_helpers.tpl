{{/* The chart name, shortened to 63 characters (a DNS label). */}}
{{- define "pagoda.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: release + chart name, unless the release name already holds the chart name. */}}
{{- define "pagoda.fullname" -}}
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

{{- define "pagoda.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The two immutable selector labels. */}}
{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagoda.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagoda.labels" -}}
helm.sh/chart: {{ include "pagoda.chart" . }}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagoda
app.kubernetes.io/component: operator
{{- end }}

{{- define "pagoda.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagoda.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pagoda.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "pagoda.serverImage" -}}
{{- $image := .Values.inferenceDefaults.server.image }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}

{{/* The recording rule's series: DCGM engine activity per pod (prometheusrule.yaml, adapter-rules.yaml). */}}
{{- define "pagoda.dcgmRecord" -}}
namespace_pod:DCGM_FI_PROF_GR_ENGINE_ACTIVE:avg
{{- end }}

{{/* Whether to render a prometheus-operator object: `enabled` true, or "auto" and the cluster serves
its kind (monitoring.coreos.com/v1). Call with (list $ .Values.monitoring.<x>.enabled "Kind"). */}}
{{- define "pagoda.monitoringEnabled" -}}
{{- $root := index . 0 }}{{ $enabled := toString (index . 1) }}{{ $kind := index . 2 }}
{{- if or (eq $enabled "true") (and (eq $enabled "auto") ($root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind))) -}}
true
{{- end }}
{{- end }}

{{/* The namespaces whose server pods the monitors select: the operator's, or all. */}}
{{- define "pagoda.monitorNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
matchNames:
  {{- toYaml .Values.operator.watchNamespaces | nindent 2 }}
{{- else -}}
any: true
{{- end }}
{{- end }}
