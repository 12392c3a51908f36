{{- /*
Named templates of the dsa-indexer chart: names, labels, the image, the TOML flag files, the
worker addresses the coordinator is given, TLS and bearer tokens, and the pod template all three
components share.
Components are "coordinator", "indexer" and "attention"; their values are .Values.<component>.
*/ -}}

{{/* The chart's name (nameOverride wins). */}}
{{- define "dsa.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
<release>-<chart>, or the release alone when it already holds the chart's name. At most 40
characters: "<fullname>-attention" plus a StatefulSet's "-<ordinal>" and its revision hash
suffix must stay within Kubernetes' 63.
*/}}
{{- define "dsa.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* name-version of the chart, for helm.sh/chart. */}}
{{- define "dsa.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's object name: <fullname>-<component>. Call with (dict "root" $ "component" "indexer"). */}}
{{- define "dsa.componentName" -}}
{{- printf "%s-%s" (include "dsa.fullname" .root) .component -}}
{{- end -}}

{{/* Labels that select a component's pods (never change them on upgrade). */}}
{{- define "dsa.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsa.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/* Kubernetes' recommended labels plus helm.sh/chart and commonLabels. Call with (dict "root" $ "component" NAME); component may be "" for objects of the whole release. */}}
{{- define "dsa.labels" -}}
helm.sh/chart: {{ include "dsa.chart" .root }}
{{ include "dsa.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: dsa-indexer
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The service account the pods run as. */}}
{{- define "dsa.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dsa.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* cpu or cuda: the image variant a component runs. Call with (dict "root" $ "component" NAME). */}}
{{- define "dsa.imageVariant" -}}
{{- $c := index .root.Values .component -}}
{{- default .root.Values.image.variant $c.imageVariant -}}
{{- end -}}

{{/* repository:tag of a component's image (the cuda variant adds image.cudaTagSuffix). */}}
{{- define "dsa.image" -}}
{{- $image := .root.Values.image -}}
{{- $tag := default .root.Chart.AppVersion $image.tag -}}
{{- if eq (include "dsa.imageVariant" .) "cuda" -}}
{{- $tag = printf "%s%s" $tag $image.cudaTagSuffix -}}
{{- end -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}

{{/* repository:tag of the OpenAI front's image: the tag plus image.openaiTagSuffix. */}}
{{- define "dsa.openaiImage" -}}
{{- $image := .Values.image -}}
{{- printf "%s:%s%s" $image.repository (default .Chart.AppVersion $image.tag) $image.openaiTagSuffix -}}
{{- end -}}

{{/* The binary of a component, under /usr/local/bin. */}}
{{- define "dsa.binary" -}}
{{- printf "/usr/local/bin/dsa-%s" .component -}}
{{- end -}}

{{/* "true" when the attention workers hold their indexers (attention.transport inprocess). */}}
{{- define "dsa.colocated" -}}
{{- if eq .Values.attention.transport "inprocess" -}}true{{- end -}}
{{- end -}}

{{/* The headless Service of a worker component, fully qualified. */}}
{{- define "dsa.headlessHost" -}}
{{- printf "%s.%s.svc.%s" (include "dsa.componentName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* One StatefulSet pod's stable name: <sts>-<ordinal>.<headless>.<ns>.svc.<domain>. Call with (dict "root" $ "component" NAME "ordinal" N). */}}
{{- define "dsa.podHost" -}}
{{- printf "%s-%d.%s" (include "dsa.componentName" .) (int .ordinal) (include "dsa.headlessHost" .) -}}
{{- end -}}

{{/*
The workers of a kind ("indexer" or "attention") as the coordinator is given them, as JSON
{"static": [HOST:PORT, ...], "dns": [NAME:PORT, ...]} (one of the two empty): the stable pod names
in order with attention.transport inprocess (each attention worker is also its indexer, so both
kinds name the attention pods) and with discovery.mode static, else the headless Service. The
coordinator's --indexer / --indexer-dns and the attention workers' allow-list
(--indexer-workers / --indexer-dns) both come from here, so they cannot disagree.
Call with (dict "root" $ "kind" "indexer").
*/}}
{{- define "dsa.workerAddresses" -}}
{{- $root := .root -}}
{{- $component := .kind -}}
{{- if include "dsa.colocated" $root -}}
{{- $component = "attention" -}}
{{- end -}}
{{- $c := index $root.Values $component -}}
{{- $static := list -}}
{{- $dns := list -}}
{{- if or (include "dsa.colocated" $root) (eq $root.Values.coordinator.discovery.mode "static") -}}
{{- range $i := until (int $c.replicas) -}}
{{- $static = append $static (printf "%s:%v" (include "dsa.podHost" (dict "root" $root "component" $component "ordinal" $i)) $c.ports.grpc) -}}
{{- end -}}
{{- else -}}
{{- $dns = append $dns (printf "%s:%v" (include "dsa.headlessHost" (dict "root" $root "component" $component)) $c.ports.grpc) -}}
{{- end -}}
{{- dict "static" $static "dns" $dns | toJson -}}
{{- end -}}

{{/* Where a pod's TLS Secret is mounted (tls.crt, tls.key, ca.crt), and the bearer-token files. */}}
{{- define "dsa.tlsDir" -}}/etc/dsa-tls{{- end -}}
{{- define "dsa.authDir" -}}/etc/dsa-auth{{- end -}}

{{/* The TLS Secret of a component: <component>.tlsSecretName, else tls.secretName. */}}
{{- define "dsa.tlsSecretName" -}}
{{- $c := index .root.Values .component -}}
{{- default .root.Values.tls.secretName $c.tlsSecretName -}}
{{- end -}}

{{/*
The tls volume of a pod (tls.enabled): the Secret `secretName`, read-only, its keys listed so a
missing one fails the mount with the key's name. Group-readable only (fsGroup 10001 reads it).
Call with (dict "secretName" NAME "keys" (list "tls.crt" ...)).
*/}}
{{- define "dsa.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ .secretName }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end -}}

{{/*
The TLS flags of a server (tls.enabled): its certificate, served and shown when it dials
(mutual TLS), the CA of what it dials, the client CA its port requires (tls.mutual), the name the
dialing components (coordinator, attention) check in dialed certificates (tls.serverName), and
the plaintext health port of the probes.
*/}}
{{- define "dsa.tlsArgs" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
{{- $dir := include "dsa.tlsDir" $root -}}
- --health-listen=0.0.0.0:{{ $c.ports.health }}
- --tls-cert={{ $dir }}/tls.crt
- --tls-key={{ $dir }}/tls.key
- --tls-ca={{ $dir }}/ca.crt
{{- if $root.Values.tls.mutual }}
- --tls-client-ca={{ $dir }}/ca.crt
{{- end }}
{{- if and $root.Values.tls.serverName (ne .component "indexer") }}
- --tls-server-name={{ $root.Values.tls.serverName }}
{{- end }}
{{- end -}}

{{/*
terminationGracePeriodSeconds of a component: its whole drain (drainDelayMs + shutdownGraceMs,
rounded up to seconds) plus terminationGraceMarginSeconds, so the kubelet's SIGKILL never comes
before the server's own exit.
*/}}
{{- define "dsa.terminationGrace" -}}
{{- $c := index .root.Values .component -}}
{{- $drainMs := add (int64 $c.drainDelayMs) (int64 $c.shutdownGraceMs) -}}
{{- add (div (add $drainMs 999) 1000) (int64 .root.Values.terminationGraceMarginSeconds) -}}
{{- end -}}

{{/*
The flags model.name sets in a component's TOML file, as JSON. smollm2: every indexer serves the
trained indexers' shape (H 16, D 64: the metadata of model.indexerWeights, which the chart check
compares), the coordinator selects the model's top-K (512, dsa up's --model smollm2 default) and
the attention workers load the model's files. pattern: none (each component's config says).
Call with (dict "root" $ "component" NAME).
*/}}
{{- define "dsa.modelFlags" -}}
{{- $m := .root.Values.model -}}
{{- $flags := dict -}}
{{- if eq $m.name "smollm2" -}}
{{- $indexerShape := dict "num-heads" 16 "head-dim" 64 -}}
{{- if eq .component "coordinator" -}}
{{- $_ := set $flags "top-k" 512 -}}
{{- else if eq .component "indexer" -}}
{{- $flags = $indexerShape -}}
{{- else if eq .component "attention" -}}
{{- $flags = dict "model" "smollm2" "model-file" (printf "%s/model.safetensors" $m.dir) "indexer-weights" $m.indexerWeights -}}
{{- end -}}
{{- end -}}
{{- $flags | toJson -}}
{{- end -}}

{{/*
The flags of a component's TOML file (/etc/dsa/<component>.toml): the chart's own (log-level, the
device and transport keys, the coordinator's check interval and --colocated) and then the
component's `config` map. Values go through toJson: a JSON string, number, boolean or array of them
is also a TOML one.
*/}}
{{- define "dsa.configToml" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
{{- $flags := include "dsa.modelFlags" . | fromJson -}}
{{- range $key := keys $c.config -}}
{{- $_ := unset $flags $key -}}
{{- end -}}
{{- $_ := set $flags "log-level" (default $root.Values.logLevel $c.logLevel) -}}
{{- if eq .component "coordinator" -}}
{{- $_ := set $flags "worker-check-interval-ms" $c.discovery.workerCheckIntervalMs -}}
{{- if include "dsa.colocated" $root -}}
{{- $_ := set $flags "colocated" true -}}
{{- end -}}
{{- else if eq .component "indexer" -}}
{{- $_ := set $flags "device" $c.device -}}
{{- else if eq .component "attention" -}}
{{- $_ := set $flags "attention-device" $c.device -}}
{{- $_ := set $flags "transport" $c.transport -}}
{{- end -}}
# dsa-{{ .component }}'s flags, rendered by the {{ $root.Chart.Name }} chart from .Values.{{ .component }}.
# The command line (listen addresses, drain timing, discovery) and DSA_* variables take precedence.
{{- range $key := keys $flags | sortAlpha }}
{{ $key }} = {{ index $flags $key | toJson }}
{{- end }}
{{- range $key := keys $c.config | sortAlpha }}
{{ $key }} = {{ index $c.config $key | toJson }}
{{- end }}
{{ end -}}

{{/* The command-line arguments of a component's server. */}}
{{- define "dsa.args" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
- --config=/etc/dsa/{{ .component }}.toml
- --listen=0.0.0.0:{{ $c.ports.grpc }}
- --metrics-listen=0.0.0.0:{{ $c.ports.metrics }}
- --drain-delay-ms={{ int64 $c.drainDelayMs }}
- --shutdown-grace-ms={{ int64 $c.shutdownGraceMs }}
{{- if $root.Values.tls.enabled }}
{{ include "dsa.tlsArgs" . }}
{{- end }}
{{- $indexers := include "dsa.workerAddresses" (dict "root" $root "kind" "indexer") | fromJson }}
{{- if eq .component "coordinator" }}
{{- $attention := include "dsa.workerAddresses" (dict "root" $root "kind" "attention") | fromJson }}
{{- if include "dsa.colocated" $root }}
{{- /* --colocated pairs indexer i with attention worker i: fixed, ordered, equal lists. */}}
{{- range $indexers.static }}
- --indexer={{ . }}
- --attention={{ . }}
{{- end }}
{{- else }}
{{- range $indexers.static }}
- --indexer={{ . }}
{{- end }}
{{- range $attention.static }}
- --attention={{ . }}
{{- end }}
{{- end }}
{{- range $indexers.dns }}
- --indexer-dns={{ . }}
{{- end }}
{{- range $attention.dns }}
- --attention-dns={{ . }}
{{- end }}
{{- if $root.Values.auth.tokensSecret }}
- --auth-tokens-file={{ include "dsa.authDir" $root }}/tokens
{{- end }}
{{- /* The owner of its leases on the workers: the pod's name, kept across the container's restarts
(which then free what the last run held at once) and distinct between replicas. A pod replaced by
another frees it when the lease expires. */}}
- --name=$(DSA_POD_NAME)
{{- else if eq .component "indexer" }}
{{- range $c.operatorIdentities }}
- {{ printf "--operator-identities=%s" . | quote }}
{{- end }}
{{- else if eq .component "attention" }}
{{- /* The only indexers a Prefill may name: the coordinator's (inprocess: its own pods, where the
allow-list goes unused since each worker serves its own indexer). */}}
{{- range $indexers.static }}
- --indexer-workers={{ . }}
{{- end }}
{{- range $indexers.dns }}
- --indexer-dns={{ . }}
{{- end }}
{{- end }}
{{- range $c.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* true when a component is a worker that takes part in the NCCL data plane (RDMA, NCCL_*). */}}
{{- define "dsa.isWorker" -}}
{{- if or (eq .component "indexer") (eq .component "attention") -}}true{{- end -}}
{{- end -}}

{{/* A component's resources: .resources plus its GPUs and, on RDMA workers, the RDMA device. */}}
{{- define "dsa.resources" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
{{- $resources := deepCopy (default (dict) $c.resources) -}}
{{- $requests := default (dict) $resources.requests -}}
{{- $limits := default (dict) $resources.limits -}}
{{- if gt (int $c.gpu) 0 -}}
{{- $_ := set $requests $root.Values.gpuResourceName (int $c.gpu) -}}
{{- $_ := set $limits $root.Values.gpuResourceName (int $c.gpu) -}}
{{- end -}}
{{- if and (include "dsa.isWorker" .) $root.Values.rdma.enabled $root.Values.rdma.resourceName -}}
{{- $_ := set $requests $root.Values.rdma.resourceName (int $root.Values.rdma.resourceCount) -}}
{{- $_ := set $limits $root.Values.rdma.resourceName (int $root.Values.rdma.resourceCount) -}}
{{- end -}}
{{- if $requests -}}{{- $_ := set $resources "requests" $requests -}}{{- end -}}
{{- if $limits -}}{{- $_ := set $resources "limits" $limits -}}{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* A component's container security context: securityContext plus rdma.capabilities on RDMA workers. */}}
{{- define "dsa.securityContext" -}}
{{- $root := .root -}}
{{- $context := deepCopy $root.Values.securityContext -}}
{{- if and (include "dsa.isWorker" .) $root.Values.rdma.enabled $root.Values.rdma.capabilities -}}
{{- $capabilities := default (dict) $context.capabilities -}}
{{- $_ := set $capabilities "add" (concat (default (list) $capabilities.add) $root.Values.rdma.capabilities | uniq) -}}
{{- $_ := set $context "capabilities" $capabilities -}}
{{- end -}}
{{- toYaml $context -}}
{{- end -}}

{{/* One probe of a component, on its grpc port (health with tls.enabled): (dict "root" $ "component" NAME "probe" "startup|readiness|liveness" "service" "liveness|readiness"). */}}
{{- define "dsa.probe" -}}
{{- $c := index .root.Values .component -}}
{{- $p := index $c.probes .probe -}}
grpc:
  {{- /* The kubelet's gRPC probes speak no TLS: with TLS on they ask the plaintext health port. */}}
  port: {{ ternary $c.ports.health $c.ports.grpc .root.Values.tls.enabled }}
  service: {{ .service }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{/*
The pod template of a component (Deployment or StatefulSet): one server container, non-root, a
read-only root filesystem, the TOML file, /dev/shm and /tmp; with tls.enabled its TLS Secret and
health port, and in the coordinator with auth.tokensSecret the tokens file.
*/}}
{{- define "dsa.podTemplate" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
{{- $worker := include "dsa.isWorker" . -}}
{{- $hostNetwork := and $worker $root.Values.rdma.enabled $root.Values.rdma.hostNetwork -}}
{{- $tokens := and (eq .component "coordinator") $root.Values.auth.tokensSecret -}}
metadata:
  labels:
    {{- include "dsa.labels" . | nindent 4 }}
    {{- with $c.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "dsa.configToml" . | sha256sum }}
    {{- with $c.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "dsa.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- /* Service links would put <SERVICE>_PORT variables in the environment; with a release
  named dsa-* some would start with DSA_ and read as flags. */}}
  enableServiceLinks: false
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ include "dsa.terminationGrace" . }}
  {{- if $hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- with $c.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $c.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "dsa.image" . | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command:
        - {{ include "dsa.binary" . }}
      args:
        {{- include "dsa.args" . | nindent 8 }}
      ports:
        - name: grpc
          containerPort: {{ $c.ports.grpc }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $c.ports.metrics }}
          protocol: TCP
        {{- if $root.Values.tls.enabled }}
        - name: health
          containerPort: {{ $c.ports.health }}
          protocol: TCP
        {{- end }}
      {{- $env := list }}
      {{- if $worker }}
      {{- range $name := keys $root.Values.nccl.env | sortAlpha }}
      {{- $env = append $env (dict "name" $name "value" (toString (index $root.Values.nccl.env $name))) }}
      {{- end }}
      {{- end }}
      {{- if eq .component "coordinator" }}
      {{- $env = append $env (dict "name" "DSA_POD_NAME" "valueFrom" (dict "fieldRef" (dict "fieldPath" "metadata.name"))) }}
      {{- end }}
      {{- $env = concat $env $c.extraEnv }}
      {{- with $env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      startupProbe:
        {{- include "dsa.probe" (dict "root" $root "component" .component "probe" "startup" "service" "liveness") | nindent 8 }}
      readinessProbe:
        {{- include "dsa.probe" (dict "root" $root "component" .component "probe" "readiness" "service" "readiness") | nindent 8 }}
      livenessProbe:
        {{- include "dsa.probe" (dict "root" $root "component" .component "probe" "liveness" "service" "liveness") | nindent 8 }}
      resources:
        {{- include "dsa.resources" . | nindent 8 }}
      securityContext:
        {{- include "dsa.securityContext" . | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/dsa
          readOnly: true
        - name: shm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- if $root.Values.tls.enabled }}
        - name: tls
          mountPath: {{ include "dsa.tlsDir" $root }}
          readOnly: true
        {{- end }}
        {{- if $tokens }}
        - name: auth-tokens
          mountPath: {{ include "dsa.authDir" $root }}
          readOnly: true
        {{- end }}
        {{- with $c.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "dsa.fullname" $root }}-config
        items:
          - key: {{ .component }}.toml
            path: {{ .component }}.toml
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $c.shm.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: 256Mi
    {{- if $root.Values.tls.enabled }}
    {{- include "dsa.tlsVolume" (dict "secretName" (include "dsa.tlsSecretName" .) "keys" (list "tls.crt" "tls.key" "ca.crt")) | nindent 4 }}
    {{- end }}
    {{- if $tokens }}
    - name: auth-tokens
      secret:
        secretName: {{ $root.Values.auth.tokensSecret }}
        defaultMode: 0440
        items:
          - key: tokens
            path: tokens
    {{- end }}
    {{- with $c.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/*
Checks across values that values.schema.json cannot say clearly; each failure names the values
to change. Included once, from the ConfigMap.
*/}}
{{- define "dsa.validate" -}}
{{- $v := .Values -}}
{{- range $component := list "indexer" "attention" -}}
{{- $c := index $v $component -}}
{{- if eq $c.device "cuda" -}}
{{- if lt (int $c.gpu) 1 -}}
{{- fail (printf "%s.device is cuda but %s.gpu is %d: set %s.gpu to at least 1" $component $component (int $c.gpu) $component) -}}
{{- end -}}
{{- if ne (include "dsa.imageVariant" (dict "root" $ "component" $component)) "cuda" -}}
{{- fail (printf "%s.device is cuda but its image is the cpu variant: set image.variant (or %s.imageVariant) to cuda" $component $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $v.attention.transport "nccl" -}}
{{- if ne $v.indexer.device "cuda" -}}
{{- fail "attention.transport nccl needs indexer.device cuda: the indexer's end of the NCCL data plane is its GPU" -}}
{{- end -}}
{{- if lt (int $v.attention.gpu) 1 -}}
{{- fail "attention.transport nccl needs attention.gpu of at least 1: the attention worker's end of the NCCL data plane is its GPU" -}}
{{- end -}}
{{- if ne (include "dsa.imageVariant" (dict "root" $ "component" "attention")) "cuda" -}}
{{- fail "attention.transport nccl needs the cuda image variant for the attention workers: set image.variant (or attention.imageVariant) to cuda" -}}
{{- end -}}
{{- end -}}
{{- if and $v.rdma.enabled (not $v.rdma.hostNetwork) (not $v.rdma.resourceName) -}}
{{- fail "rdma.enabled needs rdma.hostNetwork true or an rdma.resourceName (e.g. rdma/rdma_shared_device_a)" -}}
{{- end -}}
{{- if and (not (include "dsa.colocated" $)) (eq $v.coordinator.discovery.mode "static") (or (lt (int $v.indexer.replicas) 1) (lt (int $v.attention.replicas) 1)) -}}
{{- fail "coordinator.discovery.mode static needs indexer.replicas and attention.replicas of at least 1 (the coordinator needs one address of each)" -}}
{{- end -}}
{{- if and (include "dsa.colocated" $) (lt (int $v.attention.replicas) 1) -}}
{{- fail "attention.transport inprocess needs attention.replicas of at least 1 (each attention worker is also the coordinator's indexer)" -}}
{{- end -}}
{{- if eq $v.model.name "smollm2" -}}
{{- /* The coordinator's top-k may be set in its config; the shapes and files may not. */ -}}
{{- range $component := list "indexer" "attention" -}}
{{- $set := include "dsa.modelFlags" (dict "root" $ "component" $component) | fromJson -}}
{{- if eq $component "attention" -}}
{{- /* and the pattern model's shape flags, which dsa-attention refuses with --model smollm2 */ -}}
{{- $set = merge $set (dict "num-heads" 0 "head-dim" 0 "kv-dim" 0 "attention-heads" 0 "seed" 0 "layer-standin" 0) -}}
{{- end -}}
{{- range $key := keys $set | sortAlpha -}}
{{- if hasKey (index $v $component).config $key -}}
{{- fail (printf "%s.config sets %s, which model.name smollm2 sets from the model: remove it (or set model.name pattern)" $component $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.routes.grpcRoute.enabled (not $v.routes.grpcRoute.parentRefs) -}}
{{- fail "routes.grpcRoute.enabled needs routes.grpcRoute.parentRefs: the Gateway(s) the route attaches to" -}}
{{- end -}}
{{- if and $v.routes.ingress.enabled (not $v.routes.ingress.host) -}}
{{- fail "routes.ingress.enabled needs routes.ingress.host" -}}
{{- end -}}
{{- if $v.autoscaling.enabled -}}
{{- range $component := list "coordinator" "indexer" "attention" -}}
{{- $s := index $v.autoscaling $component -}}
{{- if and $s.enabled (gt (int $s.minReplicas) (int $s.maxReplicas)) -}}
{{- fail (printf "autoscaling.%s.minReplicas (%d) is over its maxReplicas (%d)" $component (int $s.minReplicas) (int $s.maxReplicas)) -}}
{{- end -}}
{{- if and $s.enabled (ne $component "coordinator") (eq $v.coordinator.discovery.mode "static") -}}
{{- fail (printf "autoscaling.%s needs coordinator.discovery.mode dns: static discovery lists the workers of %s.replicas only" $component $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- if not $v.tls.secretName -}}
{{- fail "tls.enabled needs tls.secretName: a Secret of type kubernetes.io/tls with the keys tls.crt, tls.key and ca.crt (cert-manager's layout)" -}}
{{- end -}}
{{- if and (not (include "dsa.colocated" $)) (eq $v.coordinator.discovery.mode "dns") (not $v.tls.serverName) -}}
{{- fail "tls.enabled with coordinator.discovery.mode dns needs tls.serverName: the coordinator and the attention workers dial workers by the IP addresses DNS returns, so they check this name instead, which every worker certificate must hold (or use discovery.mode static: the stable pod names are checked)" -}}
{{- end -}}
{{- range $component := list "coordinator" "indexer" "attention" -}}
{{- $ports := (index $v $component).ports -}}
{{- if or (eq (int $ports.health) (int $ports.grpc)) (eq (int $ports.health) (int $ports.metrics)) -}}
{{- fail (printf "%s.ports.health (%d) must differ from %s.ports.grpc and .metrics: with tls.enabled it is a port of its own" $component (int $ports.health) $component) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- range $component := list "coordinator" "indexer" "attention" -}}
{{- if (index $v $component).tlsSecretName -}}
{{- fail (printf "%s.tlsSecretName is set but tls.enabled is false: set tls.enabled (and tls.secretName)" $component) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.auth.tokensSecret (not $v.tls.enabled) -}}
{{- fail "auth.tokensSecret needs tls.enabled: the coordinator refuses bearer tokens over plaintext, where they would cross the network readable" -}}
{{- end -}}
{{- if and $v.auth.tokensSecret $v.tests.enabled (not $v.auth.testTokenKey) -}}
{{- fail "auth.tokensSecret with tests.enabled needs auth.testTokenKey: the key of that Secret holding the token (one of its tokens, alone) the helm test pod presents to the coordinator" -}}
{{- end -}}
{{- if and $v.auth.testTokenKey (not $v.auth.tokensSecret) -}}
{{- fail "auth.testTokenKey needs auth.tokensSecret (the Secret that key is in)" -}}
{{- end -}}
{{- if and $v.indexer.operatorIdentities (not (and $v.tls.enabled $v.tls.mutual)) -}}
{{- fail "indexer.operatorIdentities needs tls.enabled and tls.mutual: identities are client certificates' common names, and without mutual TLS every caller is anonymous" -}}
{{- end -}}
{{- if and $v.tls.enabled $v.tls.mutual (not (include "dsa.colocated" $)) (not $v.indexer.operatorIdentities) -}}
{{- if ne (include "dsa.tlsSecretName" (dict "root" $ "component" "coordinator")) (include "dsa.tlsSecretName" (dict "root" $ "component" "attention")) -}}
{{- fail "the coordinator and the attention workers have certificates of their own (coordinator.tlsSecretName or attention.tlsSecretName) but indexer.operatorIdentities is empty: put the coordinator's common name there, or the indexers refuse its Releases (prefix donors, and the sequences of attention workers that died) and their blocks leak" -}}
{{- end -}}
{{- end -}}
{{- if eq $v.model.name "smollm2" -}}
{{- $a := $v.attention.config -}}
{{- if and (hasKey $a "layer-pattern") (ne (len (toString (index $a "layer-pattern"))) 30) -}}
{{- fail (printf "attention.config.layer-pattern has %d layers; model.name smollm2 has 30 (one F or S each)" (len (toString (index $a "layer-pattern")))) -}}
{{- end -}}
{{- if and (hasKey $a "num-model-layers") (ne (int (index $a "num-model-layers")) 30) -}}
{{- fail (printf "attention.config.num-model-layers is %d; model.name smollm2 has 30" (int (index $a "num-model-layers"))) -}}
{{- end -}}
{{- end -}}
{{- if $v.openai.enabled -}}
{{- if ne $v.model.name "smollm2" -}}
{{- fail "openai.enabled needs model.name smollm2: the pattern model generates no tokens (set openai.enabled false)" -}}
{{- end -}}
{{- if and $v.auth.tokensSecret (not $v.openai.healthTokenKey) -}}
{{- fail "auth.tokensSecret with openai.enabled needs openai.healthTokenKey: the key of that Secret holding the token (one of its tokens, alone) the front presents at start and for /health" -}}
{{- end -}}
{{- end -}}
{{- if and $v.openai.healthTokenKey (not $v.auth.tokensSecret) -}}
{{- fail "openai.healthTokenKey needs auth.tokensSecret (the Secret that key is in)" -}}
{{- end -}}
{{- if and (or $v.routes.httpRoute.enabled $v.routes.openaiIngress.enabled) (not $v.openai.enabled) -}}
{{- fail "routes.httpRoute and routes.openaiIngress route to the OpenAI front: they need openai.enabled" -}}
{{- end -}}
{{- if and $v.routes.httpRoute.enabled (not $v.routes.httpRoute.parentRefs) -}}
{{- fail "routes.httpRoute.enabled needs routes.httpRoute.parentRefs: the Gateway(s) the route attaches to" -}}
{{- end -}}
{{- if and $v.routes.openaiIngress.enabled (not $v.routes.openaiIngress.host) -}}
{{- fail "routes.openaiIngress.enabled needs routes.openaiIngress.host" -}}
{{- end -}}
{{- end -}}

{{/* "true" when the component's replicas belong to an autoscaler (its workload then sets none, so
that an upgrade does not reset them). Call with (dict "root" $ "component" NAME). */}}
{{- define "dsa.autoscaled" -}}
{{- $a := .root.Values.autoscaling -}}
{{- if and $a.enabled (hasKey $a .component) (index $a .component).enabled -}}true{{- end -}}
{{- end -}}

{{/* The fewest replicas a component runs: autoscaling's minReplicas, else replicas. */}}
{{- define "dsa.minReplicas" -}}
{{- if include "dsa.autoscaled" . -}}
{{- (index .root.Values.autoscaling .component).minReplicas -}}
{{- else -}}
{{- (index .root.Values .component).replicas -}}
{{- end -}}
{{- end -}}
