{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "fencegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name prefix: fullnameOverride, else <release>-<chart> (just <release> when the
release name already contains the chart name). Truncated to 63 characters for DNS names.
*/}}
{{- define "fencegate.fullname" -}}
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

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "fencegate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object; each adds its app.kubernetes.io/component. */}}
{{- define "fencegate.commonLabels" -}}
helm.sh/chart: {{ include "fencegate.chart" . }}
app.kubernetes.io/name: {{ include "fencegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fencegate
{{- end }}

{{/* Labels of the injector's objects. */}}
{{- define "fencegate.labels" -}}
{{ include "fencegate.commonLabels" . }}
app.kubernetes.io/component: injector
{{- end }}

{{/* The webhook pods' selector: stable across upgrades, so never add to it. */}}
{{- define "fencegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fencegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: injector
{{- end }}

{{/* The ServiceAccount the webhook runs as. */}}
{{- define "fencegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fencegate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The webhook Service, which is also the name in its certificate. */}}
{{- define "fencegate.webhookService" -}}
{{- printf "%s-webhook" (include "fencegate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "fencegate.webhookTLSSecret" -}}
{{- printf "%s-webhook-tls" (include "fencegate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The DNS names the API server may use to reach the webhook Service. */}}
{{- define "fencegate.webhookDNSNames" -}}
{{- $svc := include "fencegate.webhookService" . }}
{{- $ns := .Release.Namespace }}
- {{ $svc }}
- {{ printf "%s.%s" $svc $ns }}
- {{ printf "%s.%s.svc" $svc $ns }}
- {{ printf "%s.%s.svc.cluster.local" $svc $ns }}
{{- end }}

{{/* The webhook image. */}}
{{- define "fencegate.webhookImage" -}}
{{- printf "%s:%s" .Values.webhook.image.repository (default .Chart.AppVersion .Values.webhook.image.tag) }}
{{- end }}

{{/* The image the webhook injects as the sidecar. */}}
{{- define "fencegate.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) }}
{{- end }}

{{/*
Native sidecars need Kubernetes 1.29: on 1.28 and older the API server drops
`restartPolicy: Always` from init containers, and the proxy would block the pod in Init forever.
*/}}
{{- define "fencegate.checkKubeVersion" -}}
{{- if and .Values.sidecar.native (semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "sidecar.native=true needs Kubernetes 1.29 or later (this cluster: %s); set sidecar.native=false for the classic sidecar" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- end }}
