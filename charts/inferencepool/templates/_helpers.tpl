{{/* The InferencePool is named after the release; the EPP and its objects are "<release>-epp". */}}
{{- define "inferencepool.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "epp.name" -}}
{{- printf "%s-epp" (include "inferencepool.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.labels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "inferencepool.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "epp.labels" -}}
{{ include "inferencepool.labels" . }}
app.kubernetes.io/name: epp
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "epp.selectorLabels" -}}
app.kubernetes.io/name: epp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "epp.image" -}}
{{- $img := .Values.inferenceExtension.image -}}
{{- $tag := $img.tag | default .Chart.AppVersion -}}
{{- if $img.registry -}}
{{- printf "%s/%s:%s" $img.registry $img.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Leader election follows replicas > 1, as the reference chart; a flag can also ask for it. */}}
{{- define "epp.ha" -}}
{{- $flag := index .Values.inferenceExtension.flags "ha-enable-leader-election" | default false -}}
{{- $several := and (gt (int .Values.inferenceExtension.replicas) 1) (not .Values.inferenceExtension.activeActive.enabled) -}}
{{- if or $several (eq (toString $flag) "true") -}}true{{- end -}}
{{- end -}}

{{- /* The bundled Valkey's labels: its own name, so no EPP selector ever matches it. */ -}}
{{- define "epp.storeLabels" -}}
app.kubernetes.io/name: epp-valkey
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: replica-store
{{- end -}}

{{- /* The Redis/Valkey URL of active-active replicas, as the EPP_REPLICAS_URL env entry. */ -}}
{{- define "epp.replicasUrlEnv" -}}
{{- $aa := .Values.inferenceExtension.activeActive -}}
- name: EPP_REPLICAS_URL
{{- if $aa.urlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ $aa.urlSecret.name }}
      key: {{ $aa.urlSecret.key | default "url" }}
{{- else if $aa.url }}
  value: {{ $aa.url | quote }}
{{- else if $aa.bundled.enabled }}
  value: {{ printf "redis://%s-valkey.%s.svc:6379/0" (include "epp.name" .) .Release.Namespace | quote }}
{{- else }}
{{- fail "inferenceExtension.activeActive needs url, urlSecret.name or bundled.enabled" }}
{{- end }}
{{- end -}}

{{- define "inferencepool.group" -}}
{{- (split "/" .Values.inferencePool.apiVersion)._0 -}}
{{- end -}}

{{- define "epp.serviceHost" -}}
{{- printf "%s.%s.svc.cluster.local" (include "epp.name" .) .Release.Namespace -}}
{{- end -}}
