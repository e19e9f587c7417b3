{{/*
Names are fixed, not derived from the release: the binary looks up its Lease, Secret and
webhook configuration by these names (flags can move the last two), and there is one
registrar per cluster.
*/}}
{{- define "spiffe-registrar.name" -}}spiffe-registrar{{- end }}

{{/* Labels on every object's metadata (not on selectors, which must never change). */}}
{{- define "spiffe-registrar.labels" -}}
app.kubernetes.io/name: spiffe-registrar
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The service account the registrar runs as: its own, or spire-server's in the sidecar layout. */}}
{{- define "spiffe-registrar.serviceAccount" -}}
{{- if eq .Values.layout "sidecar" }}{{ .Values.sidecar.serviceAccount }}{{ else }}spiffe-registrar{{ end }}
{{- end }}

{{- define "spiffe-registrar.checkLayout" -}}
{{- if not (has .Values.layout (list "agent" "sidecar")) }}
{{- fail (printf "layout must be agent or sidecar, not %q" .Values.layout) }}
{{- end }}
{{- end }}

{{/*
`spiffe-registrar run` arguments: the transport for the layout, then every non-null entry of
.Values.config as --flag=value (lists comma-separated), in the order below.
*/}}
{{- define "spiffe-registrar.args" -}}
- run
{{- if eq .Values.layout "sidecar" }}
- --spire-socket={{ .Values.spire.socket }}
{{- else }}
- --spire-address={{ .Values.spire.address }}
- --workload-api={{ .Values.spire.workloadApi }}
{{- end }}
{{- $flags := list
  (list "clusterName" "cluster-name")
  (list "previousClusterNames" "previous-cluster-name")
  (list "nodeAliasCluster" "node-alias-cluster")
  (list "namespaceLabel" "namespace-label")
  (list "workloadKinds" "workload-kinds")
  (list "barePods" "bare-pods")
  (list "transitionGrace" "transition-grace")
  (list "scopeLossGrace" "scope-loss-grace")
  (list "deletionBrakeCount" "deletion-brake-count")
  (list "deletionBrakeFraction" "deletion-brake-fraction")
  (list "adoptEquivalentEntries" "adopt-equivalent-entries")
  (list "spireServerId" "spire-server-id")
  (list "spireBatchSize" "spire-batch-size")
  (list "spireRps" "spire-rps")
  (list "resyncInterval" "resync-interval")
  (list "leaseDuration" "lease-duration")
  (list "renewDeadline" "renew-deadline")
  (list "leaseRetryPeriod" "lease-retry-period")
  (list "spireUnusableAfter" "spire-unusable-after")
  (list "servingCertValidity" "serving-cert-validity")
  (list "webhookCaValidity" "webhook-ca-validity")
  (list "webhookDnsNames" "webhook-dns-name")
  (list "webhookIps" "webhook-ip")
  (list "webhookConfiguration" "webhook-configuration")
  (list "certSecret" "cert-secret")
  (list "controller" "controller") }}
{{- $config := .Values.config | default dict }}
{{- range $config | keys }}
{{- $known := false }}
{{- $key := . }}
{{- range $flags }}{{ if eq (index . 0) $key }}{{ $known = true }}{{ end }}{{ end }}
{{- if not $known }}{{ fail (printf "config.%s is not a flag this chart knows; use extraArgs" $key) }}{{ end }}
{{- end }}
{{- range $flags }}
{{- $value := index $config (index . 0) }}
{{- if not (kindIs "invalid" $value) }}
{{- if kindIs "slice" $value }}
{{- if $value }}
- --{{ index . 1 }}={{ join "," $value }}
{{- end }}
{{- else }}
- --{{ index . 1 }}={{ $value }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.customKinds }}
- --custom-kind={{ include "spiffe-registrar.customKind" . }}
{{- end }}
{{- if .Values.logJson }}
- --log-json
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The registrar container, shared by the Deployment and the sidecar snippet in NOTES.txt. */}}
{{- define "spiffe-registrar.container" -}}
name: {{ if eq .Values.layout "sidecar" }}spiffe-registrar{{ else }}registrar{{ end }}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
  {{- include "spiffe-registrar.args" . | nindent 2 }}
env:
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  - name: HOSTNAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: webhook
    containerPort: 8443
  - name: admin
    containerPort: 8080
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.preStopSleepSeconds }}
readinessProbe:
  httpGet:
    path: /readyz
    port: admin
  periodSeconds: 5
livenessProbe:
  httpGet:
    path: /healthz
    port: admin
  periodSeconds: 10
  failureThreshold: 3
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  {{- if eq .Values.layout "sidecar" }}
  runAsNonRoot: true
  runAsUser: 65532
  seccompProfile:
    type: RuntimeDefault
  {{- end }}
volumeMounts:
  {{- if eq .Values.layout "sidecar" }}
  - name: spire-server-socket
    mountPath: {{ dir .Values.spire.socket }}
  {{- else if .Values.spire.agentSocketHostPath }}
  - name: spire-agent-socket
    mountPath: /run/spire/agent-sockets
    readOnly: true
  {{- end }}
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* One customKinds item as --custom-kind reads it: group/version/Kind/plural:template path. */}}
{{- define "spiffe-registrar.customKind" -}}
{{- range list "group" "version" "kind" "plural" }}{{ if not (index $ .) }}{{ fail (printf "customKinds: each item needs group, version, kind and plural (missing %s)" .) }}{{ end }}{{ end -}}
{{ .group }}/{{ .version }}/{{ .kind }}/{{ .plural }}:{{ .podTemplatePath | default "spec.template" }}
{{- end }}
