{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "specfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "specfleet.fullname" -}}
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

{{- define "specfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "specfleet.labels" -}}
helm.sh/chart: {{ include "specfleet.chart" . }}
{{ include "specfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specfleet
{{- end }}

{{/* The ServiceAccount's name, truncated to 63 characters. */}}
{{- define "specfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specfleet.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Lease the operator's replicas elect their leader on (in the release namespace, their
POD_NAMESPACE): the deployment's --lease-name and NOTES.txt both name it from here. */}}
{{- define "specfleet.leaseName" -}}
{{- include "specfleet.fullname" . }}
{{- end }}

{{/* An image reference: "ref" (repository[:tag]) pinned by "digest" (sha256:...) when one is
given, as repository@digest: the tag is dropped, the digest alone says what runs. */}}
{{- define "specfleet.imageRef" -}}
{{- if .digest }}
{{- printf "%s@%s" (regexReplaceAll ":[^:/]*$" (regexReplaceAll "@.*$" .ref "") "") .digest }}
{{- else }}
{{- .ref }}
{{- end }}
{{- end }}

{{- define "specfleet.image" -}}
{{- include "specfleet.imageRef" (dict "ref" (printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag)) "digest" .Values.image.digest) }}
{{- end }}

{{- define "specfleet.workerImage" -}}
{{- include "specfleet.imageRef" (dict "ref" .Values.worker.image "digest" .Values.worker.digest) }}
{{- end }}

{{- define "specfleet.routerImage" -}}
{{- include "specfleet.imageRef" (dict "ref" .Values.router.image "digest" .Values.router.digest) }}
{{- end }}

{{/* What kopf needs to watch every namespace: the CRDs, to notice ours appear or change. */}}
{{- define "specfleet.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}

{{/* What the operator does in the namespaces it watches (same as deploy/base/rbac.yaml). */}}
{{- define "specfleet.namespacedRules" -}}
- apiGroups: [serving.specfleet.dev]
  resources: [specdecodedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.specfleet.dev]
  resources: [specdecodedeployments/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if or (include "specfleet.redis.builtin" .) .Values.redis.external.url }}
{{- /* each fleet's Redis user, in a Secret of the fleet's that the operator writes and never reads */}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch]
{{- end }}
{{- if .Values.router.readRedisSecrets }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end }}

{{/* The built-in Redis: deployed unless redis.enabled is false or redis.external.url is set. */}}
{{- define "specfleet.redis.builtin" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) }}true{{ end }}
{{- end }}

{{- define "specfleet.redis.fullname" -}}
{{- include "specfleet.fullname" . | trunc 57 | trimSuffix "-" }}-redis
{{- end }}

{{- define "specfleet.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "specfleet.redis.labels" -}}
helm.sh/chart: {{ include "specfleet.chart" . }}
{{ include "specfleet.redis.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specfleet
{{- end }}

{{/* The Redis URL the operator is given: no password in it, ever (that comes from a Secret). */}}
{{- define "specfleet.redis.url" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else }}
{{- printf "redis://%s.%s.svc:6379/0" (include "specfleet.redis.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* The Secret holding the Redis password and its key; empty name: no password (external only). */}}
{{- define "specfleet.redis.secretName" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- default (include "specfleet.redis.fullname" .) .Values.redis.auth.existingSecret }}
{{- end }}
{{- end }}

{{- define "specfleet.redis.secretKey" -}}
{{- if .Values.redis.external.url }}
{{- .Values.redis.external.key }}
{{- else }}
{{- .Values.redis.auth.key }}
{{- end }}
{{- end }}

{{- define "specfleet.redis.image" -}}
{{- $i := .Values.redis.image }}
{{- include "specfleet.imageRef" (dict "ref" (printf "%s:%s" $i.repository $i.tag) "digest" $i.digest) }}
{{- end }}

{{/* The Secret holding the Alertmanager receiver's bearer token: the one named, else the one the
chart generates when the receiver is enabled; empty: the receiver is off. */}}
{{- define "specfleet.alertmanager.secretName" -}}
{{- if .Values.alertmanager.tokenSecret.name }}
{{- .Values.alertmanager.tokenSecret.name }}
{{- else if .Values.alertmanager.enabled }}
{{- include "specfleet.fullname" . | trunc 50 | trimSuffix "-" }}-alertmanager
{{- end }}
{{- end }}
