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

{{/*
The store has no default: each pod keeping its own maxima (the embedded file on an emptyDir)
fences nothing across replicas. Rendering the sidecar config without a store choice fails
with the choice explained.
*/}}
{{- define "fencegate.checkStore" -}}
{{- $store := .Values.sidecarConfig.store | default dict }}
{{- if not (kindIs "map" $store) }}
{{- fail "sidecarConfig.store must be a mapping, e.g. {kind: redis, url: ...}" }}
{{- end }}
{{- $kind := toString ($store.kind | default "") }}
{{- $examples := dict
  "redis" "redis://default:${REDIS_PASSWORD}@redis.redis.svc:6379/0"
  "postgres" "postgres://fencegate:${PG_PASSWORD}@postgres.db.svc:5432/fencegate"
  "etcd" "etcd://etcd.etcd.svc:2379" }}
{{- if not $kind }}
{{- fail (include "fencegate.storeChoice" .) }}
{{- else if hasKey $examples $kind }}
{{- if not $store.url }}
{{- fail (printf "sidecarConfig.store.url is required with sidecarConfig.store.kind=%s: the URL every sidecar shares, e.g. %s, its password a ${VARIABLE} from the Secret named by sidecar.envFromSecret" $kind (get $examples $kind)) }}
{{- end }}
{{- else if eq $kind "memory" }}
{{- fail "sidecarConfig.store.kind=memory forgets every maximum when a sidecar restarts and shares none between replicas (tests and demos only): choose redis, postgres or etcd, shared by the replicas of a Deployment, or embedded on a PersistentVolumeClaim for a StatefulSet whose pods own their shards" }}
{{- else if ne $kind "embedded" }}
{{- fail (printf "sidecarConfig.store.kind=%s: expected redis, postgres or etcd (shared by the replicas of a Deployment) or embedded (a StatefulSet's PersistentVolumeClaim)" $kind) }}
{{- end }}
{{- end }}

{{- define "fencegate.storeChoice" -}}
sidecarConfig.store is required: choose where the sidecars record the highest fencing token of each resource. There is no default, because a store of each pod's own would let a stale write through on every other replica, and a replaced pod would start from nothing.
- Deployments (replicas behind one Service): a store they all share, its password in an existing Secret whose keys become the sidecar's environment:
    --set sidecarConfig.store.kind=redis --set sidecarConfig.store.url='redis://default:${REDIS_PASSWORD}@redis.redis.svc:6379/0' --set sidecar.envFromSecret=fencegate-store
  or sidecarConfig.store.kind=postgres with sidecarConfig.store.url='postgres://fencegate:${PG_PASSWORD}@postgres.db.svc:5432/fencegate',
  or sidecarConfig.store.kind=etcd with sidecarConfig.store.url=etcd://etcd.etcd.svc:2379.
- A StatefulSet whose pods own their shards: the embedded file on a PersistentVolumeClaim:
    --set sidecarConfig.store.kind=embedded
  and a volumeClaimTemplate named fencegate-data in the StatefulSet.
Values files for each: charts/fencegate/ci/. The choice explained: docs/kubernetes.md, "Choosing the store".
{{- end }}

{{/* The webhook's copy of the sidecar config, in the release namespace. */}}
{{- define "fencegate.webhookSidecarConfig" -}}
{{- printf "%s-sidecar-config" (include "fencegate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
