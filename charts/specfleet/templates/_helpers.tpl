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
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if or (include "specfleet.redis.builtin" .) .Values.redis.external.url }}
{{- /* Each fleet's Redis user, in an immutable Secret the operator creates and never reads, edits or
deletes (a new one on new credentials; docs/redis.md, "Credentials"). No other verb on Secrets, ever:
a `get`, `patch` or `update` answer carries the Secret's data. The admission policy
(admission-policy.yaml) holds `create` to those Secrets. */}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- end }}
{{- end }}

{{/* The built-in Redis: deployed unless redis.enabled is false or redis.external.url is set. */}}
{{- define "specfleet.redis.builtin" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) }}true{{ end }}
{{- end }}

{{/* The name of every built-in Redis object, at most 52 characters: the StatefulSet's pods carry
the label controller-revision-hash=<name>-<10 characters>, which must fit in 63, or the controller
never creates them. */}}
{{- define "specfleet.redis.fullname" -}}
{{- include "specfleet.fullname" . | trunc 46 | trimSuffix "-" }}-redis
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

{{/* The built-in Redis' redis.conf. */}}
{{- define "specfleet.redis.conf" -}}
bind * -::*
port 6379
dir /data
# the password: the entrypoint writes it from the mounted Secret (never in a command line)
include /run/redis/auth.conf
maxmemory {{ .Values.redis.maxMemory }}
# Past maxmemory only keys with a TTL are evicted (windows, worker summaries, cluster windows, drift
# counts: each written again within its period); the fleets' live state has none and stays.
maxmemory-policy volatile-lru
{{- if .Values.redis.persistence.enabled }}
appendonly yes
{{- else }}
save ""
appendonly no
{{- end }}
{{- end }}

{{/* What a running Redis pod cannot pick up without a restart: its redis.conf and entrypoint. */}}
{{- define "specfleet.redis.configChecksum" -}}
{{- printf "%s\n%s" (include "specfleet.redis.conf" .) (.Files.Get "files/redis-entrypoint.sh") | sha256sum | trunc 16 }}
{{- end }}

{{/* A storage quantity in bytes when it is a whole number with a binary suffix (as the schema asks
and the API server writes back), else the quantity as written: "1024Mi" and "1Gi" compare equal. */}}
{{- define "specfleet.redis.sizeBytes" -}}
{{- $q := toString . }}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 }}
{{- if regexMatch "^[0-9]+(Ki|Mi|Gi|Ti|Pi)?$" $q }}
{{- mul (regexFind "^[0-9]+" $q | atoi) (get $units (regexReplaceAll "^[0-9]+" $q "")) }}
{{- else }}
{{- $q }}
{{- end }}
{{- end }}

{{/* redis.persistence as the values ask and as the live StatefulSet has it, in words. */}}
{{- define "specfleet.redis.persistenceWords" -}}
{{- if .enabled }}
{{- printf "a claim of %s in %s" .size (ternary (printf "StorageClass %q" .storageClass) "the default StorageClass" (ne .storageClass "")) }}
{{- else }}
{{- print "no claim (persistence off)" }}
{{- end }}
{{- end }}

{{/* Refuses a change of redis.persistence that the live StatefulSet cannot take (volumeClaimTemplates
are immutable: the upgrade would fail half-way), saying what to do instead (docs/redis.md,
"Changing persistence"). On install and under `helm template` there is nothing to look up: no
refusal. */}}
{{- define "specfleet.redis.persistenceGuard" -}}
{{- $name := include "specfleet.redis.fullname" . }}
{{- $ns := .Release.Namespace }}
{{- $p := .Values.redis.persistence }}
{{- $want := dict "enabled" $p.enabled "size" $p.size "storageClass" (default "" $p.storageClass) }}
{{- with lookup "apps/v1" "StatefulSet" $ns $name }}
{{- $live := dict "enabled" false "size" "" "storageClass" "" }}
{{- range .spec.volumeClaimTemplates | default list }}
{{- if eq .metadata.name "data" }}
{{- $_ := set $live "enabled" true }}
{{- $_ = set $live "size" (toString .spec.resources.requests.storage) }}
{{- $_ = set $live "storageClass" (default "" .spec.storageClassName) }}
{{- end }}
{{- end }}
{{- $claim := printf "data-%s-0" $name }}
{{- $head := printf "redis.persistence cannot change in place: the StatefulSet %s/%s has %s, the values ask for %s, and a StatefulSet's volumeClaimTemplates are immutable." $ns $name (include "specfleet.redis.persistenceWords" $live) (include "specfleet.redis.persistenceWords" $want) }}
{{- if or (ne $live.enabled $want.enabled) (and $want.enabled (ne $live.storageClass $want.storageClass)) }}
{{- fail (printf "%s Delete the StatefulSet, keeping its pod until the new one replaces it: `kubectl -n %s delete statefulset %s --cascade=orphan`; when turning persistence off or changing storageClass, also `kubectl -n %s delete pvc %s` (Redis holds nothing the fleets do not write again); then run helm upgrade again (docs/redis.md, \"Changing persistence\")." $head $ns $name $ns $claim) }}
{{- else if and $want.enabled (ne (include "specfleet.redis.sizeBytes" $live.size) (include "specfleet.redis.sizeBytes" $want.size)) }}
{{- fail (printf "%s To grow the claim (its StorageClass must allow volume expansion): `kubectl -n %s patch pvc %s -p '{\"spec\":{\"resources\":{\"requests\":{\"storage\":\"%s\"}}}}'`, then `kubectl -n %s delete statefulset %s --cascade=orphan` (the pod keeps running), then run helm upgrade again; a claim cannot shrink (docs/redis.md, \"Changing persistence\")." $head $ns $claim $want.size $ns $name) }}
{{- end }}
{{- end }}
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
