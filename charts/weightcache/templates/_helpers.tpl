{{/* Names and labels shared by every object of the chart. */}}

{{- define "weightcache.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weightcache.serviceAccountName" -}}
{{- default (include "weightcache.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "weightcache.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "weightcache.labels" -}}
{{ include "weightcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
Rules the operator needs in each namespace it handles (a ClusterRole when it
handles all of them). Least privilege: no delete anywhere (children go through
owner-reference garbage collection), no secrets, no pods/exec.
*/}}
{{- define "weightcache.namespacedRules" -}}
# The WeightCaches themselves: kopf watches them and keeps its bookkeeping
# (finalizer, last-handled spec) in their metadata.
- apiGroups: ["weightcache.io"]
  resources: ["weightcaches"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["weightcache.io"]
  resources: ["weightcaches/status"]
  verbs: ["get", "patch"]
# Setting blockOwnerDeletion on children needs update on the owner's finalizers
# where the OwnerReferencesPermissionEnforcement admission plugin is on.
- apiGroups: ["weightcache.io"]
  resources: ["weightcaches/finalizers"]
  verbs: ["update"]
# The agent DaemonSets, and the ConfigMaps with explicit sharding rules.
- apiGroups: ["apps"]
  resources: ["daemonsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Agent pods: their IPs, to read each agent's /status.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Events on condition transitions.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/*
"true" where the cluster serves ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1,
Kubernetes 1.30 and later), else empty. Without it the chart renders no policy, and
nothing that only a policy would make safe: agents get no right to write (the operator
alone labels pods) and the operator's reach is what RBAC alone gives it.
*/}}
{{- define "weightcache.hasAdmissionPolicies" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}true{{- end -}}
{{- end -}}

{{/* "true" where agents may label promoted pods themselves: asked for, and a policy can bound it. */}}
{{- define "weightcache.agentWrites" -}}
{{- if and .Values.agentPolicy.enabled (include "weightcache.hasAdmissionPolicies" .) -}}true{{- end -}}
{{- end -}}

{{/* The agent images a WeightCache may name: the default and the allowlist, as a JSON list. */}}
{{- define "weightcache.agentImages" -}}
{{- prepend (.Values.agent.allowedImages | default list) .Values.agent.image | uniq | toJson -}}
{{- end -}}
