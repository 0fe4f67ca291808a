{{/*
Names, labels and the pieces every pod of the chart shares. The pods are assembled from these
so that the security settings, the scratch volumes and the settings' environment are written
once.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "syshax.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object's name: fullnameOverride, else "<release>-<name>", or the release
name alone when it already holds the name. At most 40 characters, so that the longest suffix
("-test-gateway") still leaves a DNS label of 63.
*/}}
{{- define "syshax.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "syshax.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* One component's object name: (dict "root" $ "component" "web"). */}}
{{- define "syshax.componentName" -}}
{{- printf "%s-%s" (include "syshax.fullname" .root) .component -}}
{{- end -}}

{{/* Labels that select one component's pods: (dict "root" $ "component" "web"). */}}
{{- define "syshax.selectorLabels" -}}
app.kubernetes.io/name: {{ include "syshax.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every label of one component's objects: (dict "root" $ "component" "web"). */}}
{{- define "syshax.labels" -}}
{{ include "syshax.selectorLabels" . }}
app.kubernetes.io/part-of: syshax
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The project image, by digest when one is given. */}}
{{- define "syshax.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Service URLs inside the cluster. */}}
{{- define "syshax.webUrl" -}}
{{- printf "http://%s:%d" (include "syshax.componentName" (dict "root" . "component" "web")) (int .Values.web.service.port) -}}
{{- end -}}

{{- define "syshax.gatewayUrl" -}}
{{- printf "http://%s:%d" (include "syshax.componentName" (dict "root" . "component" "gateway")) (int .Values.gateway.service.port) -}}
{{- end -}}

{{/* The router Service's URL, which is also what each router pod advertises. */}}
{{- define "syshax.routerUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "syshax.componentName" (dict "root" . "component" "router")) .Release.Namespace (int .Values.router.port) -}}
{{- end -}}

{{/* ROUTER_URLS: the operator's list, else this release's router Service. */}}
{{- define "syshax.routerUrls" -}}
{{- if .Values.settings.routerUrls -}}
{{- join "," .Values.settings.routerUrls -}}
{{- else if .Values.router.enabled -}}
{{- include "syshax.routerUrl" . -}}
{{- end -}}
{{- end -}}

{{/*
ALLOWED_HOSTS: the operator's names, the Services' own names (routers reach the gateway by its
Service name, the gateway passes requests on to web, `helm test` calls both) and localhost,
which the probes send as their Host.
*/}}
{{- define "syshax.allowedHosts" -}}
{{- $hosts := list "localhost" "127.0.0.1" -}}
{{- range $component := list "web" "gateway" -}}
{{- $name := include "syshax.componentName" (dict "root" $ "component" $component) -}}
{{- $hosts = append $hosts $name -}}
{{- $hosts = append $hosts (printf "%s.%s.svc" $name $.Release.Namespace) -}}
{{- end -}}
{{- if .Values.web.ingress.enabled -}}
{{- $hosts = append $hosts .Values.web.ingress.host -}}
{{- end -}}
{{- join "," (uniq (concat $hosts .Values.settings.allowedHosts)) -}}
{{- end -}}

{{/* Where each secret setting comes from: the Secret's name. */}}
{{- define "syshax.appSecretName" -}}
{{- if .Values.secrets.generate -}}
{{- include "syshax.componentName" (dict "root" . "component" "app") -}}
{{- else -}}
{{- .Values.secrets.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "syshax.databaseSecretName" -}}
{{- if eq .Values.postgresql.mode "bundled" -}}
{{- include "syshax.componentName" (dict "root" . "component" "postgresql") -}}
{{- else -}}
{{- .Values.postgresql.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "syshax.databaseSecretKey" -}}
{{- if eq .Values.postgresql.mode "bundled" -}}DATABASE_URL{{- else -}}{{- .Values.postgresql.external.key -}}{{- end -}}
{{- end -}}

{{- define "syshax.redisSecretName" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- include "syshax.componentName" (dict "root" . "component" "redis") -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "syshax.redisSecretKey" -}}
{{- if eq .Values.redis.mode "bundled" -}}REDIS_URL{{- else -}}{{- .Values.redis.external.key -}}{{- end -}}
{{- end -}}

{{/* One env entry read from a Secret: (dict "name" "SECRET_KEY" "secret" "x" "key" "y"). */}}
{{- define "syshax.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
{{- end -}}

{{/*
A value kept from the Secret the release already has, else a new random one, so that an upgrade
keeps the trial's passwords: (dict "root" $ "secret" NAME "key" KEY "length" N). Under
`helm template` there is no cluster, and every render draws new values.
*/}}
{{- define "syshax.keptOrRandom" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum (int .length) -}}
{{- end -}}
{{- end -}}

{{/*
The control plane's environment: settings in clear, keys from Secrets. routerKeys adds the
routers' keys, which only web (the playground) and the workers send:
(dict "root" $ "routerKeys" true).
*/}}
{{- define "syshax.controlPlaneEnv" -}}
{{- $root := .root -}}
{{- $settings := $root.Values.settings -}}
- name: DJANGO_SETTINGS_MODULE
  value: controlplane.settings.production
- name: SYSHAX_VAR_DIR
  value: /var/lib/syshax
# Whatever the uid, home is the writable state directory (gunicorn's control socket).
- name: HOME
  value: /var/lib/syshax
- name: ALLOWED_HOSTS
  value: {{ include "syshax.allowedHosts" $root | quote }}
- name: CSRF_TRUSTED_ORIGINS
  value: {{ join "," $settings.csrfTrustedOrigins | quote }}
- name: SECURE_SSL_REDIRECT
  value: {{ $settings.secureSslRedirect | toString | quote }}
- name: TRUST_X_FORWARDED_PROTO
  value: {{ $settings.trustXForwardedProto | toString | quote }}
- name: LOG_LEVEL
  value: {{ $settings.logLevel | quote }}
- name: TIME_ZONE
  value: {{ $settings.timeZone | quote }}
- name: HEARTBEAT_INTERVAL_SECONDS
  value: {{ $settings.heartbeatIntervalSeconds | toString | quote }}
- name: HEARTBEAT_TOLERANCE
  value: {{ $settings.heartbeatTolerance | toString | quote }}
- name: ROUTER_URLS
  value: {{ include "syshax.routerUrls" $root | quote }}
{{- range $name, $value := $settings.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{ include "syshax.secretEnv" (dict "name" "SECRET_KEY" "secret" (include "syshax.appSecretName" $root) "key" $root.Values.secrets.keys.secretKey) }}
{{ include "syshax.secretEnv" (dict "name" "DATABASE_URL" "secret" (include "syshax.databaseSecretName" $root) "key" (include "syshax.databaseSecretKey" $root)) }}
{{ include "syshax.secretEnv" (dict "name" "REDIS_URL" "secret" (include "syshax.redisSecretName" $root) "key" (include "syshax.redisSecretKey" $root)) }}
{{- if .routerKeys }}
{{ include "syshax.secretEnv" (dict "name" "ROUTER_API_KEY" "secret" (include "syshax.appSecretName" $root) "key" $root.Values.secrets.keys.routerApiKey) }}
{{ include "syshax.secretEnv" (dict "name" "ROUTER_BENCHMARK_KEY" "secret" (include "syshax.appSecretName" $root) "key" $root.Values.secrets.keys.routerBenchmarkKey) }}
{{- end }}
{{- range $settings.extraSecretEnv }}
{{ include "syshax.secretEnv" (dict "name" .name "secret" .secretName "key" .key) }}
{{- end }}
{{- end -}}

{{/* The pod-level fields every pod of the chart shares. */}}
{{- define "syshax.podSpecCommon" -}}
automountServiceAccountToken: false
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pod annotations every pod of the chart shares. */}}
{{- define "syshax.podAnnotations" -}}
{{- with .Values.podAnnotations }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{/* The container-level security settings. */}}
{{- define "syshax.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.containerSecurityContext | nindent 2 }}
{{- end -}}

{{/* The scratch volumes of the project image: its state directory and /tmp. */}}
{{- define "syshax.scratchVolumes" -}}
- name: state
  emptyDir:
    sizeLimit: {{ .Values.scratch.stateSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
{{- end -}}

{{- define "syshax.scratchMounts" -}}
- name: state
  mountPath: /var/lib/syshax
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/*
An init container that waits until the database's schema is the image's: the migration hook
runs before upgrades, but on a first install with the bundled database it runs after the pods
are created. (dict "root" $ "resources" RESOURCES).
*/}}
{{- define "syshax.waitForMigrations" -}}
- name: wait-for-migrations
  image: {{ include "syshax.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - sh
    - -c
    - until syshax manage migrate --check >/dev/null 2>&1; do echo "waiting for the database and its migrations"; sleep 5; done
  env:
    {{- include "syshax.controlPlaneEnv" (dict "root" .root "routerKeys" false) | nindent 4 }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  {{- include "syshax.containerSecurity" .root | nindent 2 }}
  volumeMounts:
    {{- include "syshax.scratchMounts" .root | nindent 4 }}
{{- end -}}

{{/* An HTTP probe's action, with the Host Django accepts: (dict "path" P "port" PORT). */}}
{{- define "syshax.httpGet" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
  httpHeaders:
    - name: Host
      value: localhost
{{- end -}}

{{/*
A Celery worker's liveness: it answers a ping through the broker. The worker is named
controlplane@<hostname>.<pid>, so ping them all and look for this pod's.
*/}}
{{- define "syshax.celeryPing" -}}
exec:
  command:
    - sh
    - -c
    - celery -A controlplane inspect ping --timeout 10 | grep "controlplane@$(hostname)\." >/dev/null
{{- end -}}

{{/*
When the migration Job runs. It reads only Secrets and settings that exist before the release
(external databases, keys in an existing Secret): then before install. With anything the chart
makes itself (the bundled databases, generated keys) it has to run after install instead.
*/}}
{{- define "syshax.migrationHook" -}}
{{- if or (eq .Values.postgresql.mode "bundled") (eq .Values.redis.mode "bundled") .Values.secrets.generate -}}
post-install,pre-upgrade
{{- else -}}
pre-install,pre-upgrade
{{- end -}}
{{- end -}}

{{/* Checks across values that the schema cannot express; each failure names its key. */}}
{{- define "syshax.validate" -}}
{{- $keda := .Values.router.keda -}}
{{- if and .Values.router.enabled $keda.enabled -}}
{{- if not $keda.prometheus.serverAddress -}}
{{- fail "router.keda.prometheus.serverAddress: required when router.keda.enabled is true (the Prometheus KEDA queries)" -}}
{{- end -}}
{{- if lt (int $keda.maxReplicas) (int $keda.minReplicas) -}}
{{- fail (printf "router.keda.maxReplicas (%d) is below router.keda.minReplicas (%d)" (int $keda.maxReplicas) (int $keda.minReplicas)) -}}
{{- end -}}
{{- end -}}
{{- range $index, $peer := .Values.networkPolicy.gateway.agents -}}
{{- if and $peer.ipBlock (or $peer.podSelector $peer.namespaceSelector) -}}
{{- fail (printf "networkPolicy.gateway.agents[%d]: an ipBlock stands alone; put podSelector/namespaceSelector in another entry" $index) -}}
{{- end -}}
{{- if not (or $peer.ipBlock $peer.podSelector $peer.namespaceSelector) -}}
{{- fail (printf "networkPolicy.gateway.agents[%d]: needs a podSelector, a namespaceSelector or an ipBlock" $index) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.web.ingress.enabled (eq .Values.web.ingress.host "") -}}
{{- fail "web.ingress.host: required when web.ingress.enabled is true" -}}
{{- end -}}
{{- end -}}
