{{- define "nixl-twisted.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nixl-twisted.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "nixl-twisted.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "nixl-twisted.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "nixl-twisted.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nixl-twisted.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nixl-twisted.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "nixl-twisted.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "nixl-twisted.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nixl-twisted.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret the environment's secrets come from: the one named, else the chart's
own (made when a secret is given as a value; each reference is optional, so a
pod starts without it, and a Secret of that name made later is read). */}}
{{- define "nixl-twisted.secretName" -}}
{{- default (include "nixl-twisted.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{- define "nixl-twisted.makesSecret" -}}
{{- $s := .Values.secrets }}
{{- if and (not $s.existingSecret) (or $s.apiKeys $s.backendApiKey $s.adminToken $s.limitsRedis $s.replicasRedis) }}true{{ end }}
{{- end }}

{{/* Whether discovery by selector is on (in the top-level pools or a model's). */}}
{{- define "nixl-twisted.selects" -}}
{{- $c := .Values.config }}
{{- if or (index $c "prefill-selector") (index $c "decode-selector") }}true{{- end }}
{{- end }}

{{/* Seconds SIGTERM may take: the delay, the drain, 5 s to close connections, a margin. */}}
{{- define "nixl-twisted.grace" -}}
{{- add .Values.shutdownDelay .Values.drainTimeout 5 .Values.graceMargin }}
{{- end }}

{{/*
The configuration as TOML. Helm's toToml writes every number as a float (YAML's
numbers reach a template as float64), which counts such as max-in-flight
refuse: whole numbers are written here as integers. Tables nest as
[a."b c"]; a table inside a list is not a setting of the proxy's.
*/}}
{{- define "nixl-twisted.toml" -}}
{{- $table := .table }}
{{- $values := list }}
{{- range $key, $value := $table }}
{{- if not (kindIs "map" $value) }}
{{- $values = append $values (printf "%s = %s" (include "nixl-twisted.tomlKey" $key) (include "nixl-twisted.tomlValue" $value)) }}
{{- end }}
{{- end }}
{{- if and $values .path }}
[{{ join "." .path }}]
{{- end }}
{{- range $values }}
{{ . }}
{{- end }}
{{- range $key, $value := $table }}
{{- if kindIs "map" $value }}
{{- include "nixl-twisted.toml" (dict "table" $value "path" (append $.path (include "nixl-twisted.tomlKey" $key))) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "nixl-twisted.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{- define "nixl-twisted.tomlValue" -}}
{{- if kindIs "slice" . }}
{{- $items := list }}
{{- range . }}{{ $items = append $items (include "nixl-twisted.tomlValue" .) }}{{ end }}
{{- printf "[%s]" (join ", " $items) }}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- int64 . }}
{{- else }}
{{- toJson . }}
{{- end }}
{{- end }}

{{/* The chart's Redis (redis.enabled): its name, labels (not the proxy's: the proxy's
Service and PodDisruptionBudget must not select it) and Secret. */}}
{{- define "nixl-twisted.redisName" -}}
{{- printf "%s-redis" (include "nixl-twisted.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "nixl-twisted.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "nixl-twisted.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "nixl-twisted.redisLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "nixl-twisted.redisSelectorLabels" . }}
app.kubernetes.io/component: redis
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "nixl-twisted.redisSecretName" -}}
{{- default (include "nixl-twisted.redisName" .) .Values.redis.existingSecret }}
{{- end }}

{{/* The password of the chart's Redis: the value given, else the one its Secret
holds already (kept across upgrades), else a new random one. */}}
{{- define "nixl-twisted.redisPassword" -}}
{{- $password := .Values.redis.password }}
{{- if not $password }}
{{- $found := lookup "v1" "Secret" .Release.Namespace (include "nixl-twisted.redisName" .) }}
{{- if and $found $found.data (index $found.data "redis-password") }}
{{- $password = index $found.data "redis-password" | b64dec }}
{{- else }}
{{- $password = randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- $password }}
{{- end }}

{{/* Whether the replicas share a Redis: the chart's, or one given as a secret (an
existing Secret may hold replicas-redis: the notes say so rather than guess). */}}
{{- define "nixl-twisted.sharesState" -}}
{{- if or .Values.redis.enabled .Values.secrets.replicasRedis }}true{{ end }}
{{- end }}
