{{/*
The chart's objects are deploy/'s kustomize manifests (files/ links to them), read with
.Files.Get, decoded, changed where a value says so, and written out again: one copy of every
manifest. These helpers do the reading, the common changes and the writing.
*/}}

{{/* The objects of one file under files/, as a JSON list (include returns text). */}}
{{- define "hami-usage.docs" -}}
{{- $docs := list -}}
{{- range regexSplit "(?m)^---[ \\t]*$" (.root.Files.Get (printf "files/%s" .file)) -1 -}}
{{- $doc := fromYaml . -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "files/%s: %s" $.file $doc.Error) -}}
{{- end -}}
{{- if $doc -}}
{{- $docs = append $docs $doc -}}
{{- end -}}
{{- end -}}
{{- toJson $docs -}}
{{- end -}}

{{- define "hami-usage.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Write one object: in the release's namespace (unless cluster-scoped), with Helm's labels. */}}
{{- define "hami-usage.emit" -}}
{{- $doc := .doc -}}
{{- $meta := $doc.metadata -}}
{{- if not (has $doc.kind (list "Namespace" "ClusterRole" "ClusterRoleBinding" "PriorityClass")) -}}
{{- $_ := set $meta "namespace" .root.Release.Namespace -}}
{{- end -}}
{{- $labels := fromYaml (include "hami-usage.labels" .root) -}}
{{- $_ := set $meta "labels" (merge ($meta.labels | default dict) $labels) -}}
---
{{ toYaml $doc }}
{{ end -}}

{{/* A pod spec of ours: the image from the values in every hami-usage container, pull secrets,
and a checksum of the configuration so that a changed config.toml rolls the pods. */}}
{{- define "hami-usage.pod" -}}
{{- $root := .root -}}
{{- $template := .template -}}
{{- $spec := $template.spec -}}
{{- $image := printf "%s:%s" $root.Values.image.repository ($root.Values.image.tag | default $root.Chart.AppVersion) -}}
{{- range $c := concat ($spec.initContainers | default list) $spec.containers -}}
{{- if eq $c.image "hami-usage" -}}
{{- $_ := set $c "image" $image -}}
{{- $_ := set $c "imagePullPolicy" $root.Values.image.pullPolicy -}}
{{- end -}}
{{- end -}}
{{- with $root.Values.imagePullSecrets -}}
{{- $_ := set $spec "imagePullSecrets" . -}}
{{- end -}}
{{- $meta := $template.metadata -}}
{{- $checksum := include "hami-usage.config" $root | sha256sum -}}
{{- $_ := set $meta "annotations" (merge ($meta.annotations | default dict) (dict "checksum/config" $checksum)) -}}
{{- end -}}

{{/* The ConfigMap hami-usage-config: deploy/config.toml and the Kafka bootstrap servers. */}}
{{- define "hami-usage.config" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: hami-usage-config
data:
  config.toml: {{ .Values.config | default (.Files.Get "files/config.toml") | toJson }}
  kafka-bootstrap: {{ .Values.kafka.bootstrap | toJson }}
{{- end -}}

{{/* Kafka security for one container of `workload` (collector, aggregator, topics):
environment (HAMI_USAGE_KAFKA_*) and the Secrets as read-only files (a password never travels
as a flag or a plain variable). What the program would refuse at start (exit 2, every pod in
a crash loop) is refused here. */}}
{{- define "hami-usage.kafka" -}}
{{- $k := .root.Values.kafka -}}
{{- $w := index ($k.workloads | default dict) .workload | default dict -}}
{{- $tlsSecret := $w.tlsSecretName | default $k.tls.secretName -}}
{{- $username := $w.username | default $k.sasl.username -}}
{{- $password := mergeOverwrite (deepCopy $k.sasl.passwordSecret) ($w.passwordSecret | default dict) -}}
{{- $spec := .spec -}}
{{- $c := .container -}}
{{- $env := $c.env | default list -}}
{{- $mounts := $c.volumeMounts | default list -}}
{{- $volumes := $spec.volumes | default list -}}
{{- if not (has $k.securityProtocol (list "PLAINTEXT" "SSL" "SASL_SSL")) -}}
{{- fail (printf "kafka.securityProtocol %q: one of PLAINTEXT, SSL, SASL_SSL" $k.securityProtocol) -}}
{{- end -}}
{{- range $name, $_ := $k.workloads | default dict -}}
{{- if not (has $name (list "collector" "aggregator" "topics")) -}}
{{- fail (printf "kafka.workloads.%s: one of collector, aggregator, topics" $name) -}}
{{- end -}}
{{- end -}}
{{- if and $tlsSecret (eq $k.securityProtocol "PLAINTEXT") -}}
{{- fail (printf "kafka.tls.secretName or kafka.workloads.%s.tlsSecretName needs kafka.securityProtocol SSL or SASL_SSL" .workload) -}}
{{- end -}}
{{- if and $k.sasl.mechanism (ne $k.securityProtocol "SASL_SSL") -}}
{{- fail "kafka.sasl.mechanism needs kafka.securityProtocol SASL_SSL" -}}
{{- end -}}
{{- if and (eq $k.securityProtocol "SASL_SSL") (not $k.sasl.mechanism) -}}
{{- fail "kafka.securityProtocol SASL_SSL needs kafka.sasl.mechanism" -}}
{{- end -}}
{{- if and (or $username $password.name) (not $k.sasl.mechanism) -}}
{{- fail (printf "a Kafka username or passwordSecret (kafka.sasl or kafka.workloads.%s) needs kafka.sasl.mechanism and kafka.securityProtocol SASL_SSL" .workload) -}}
{{- end -}}
{{- if and $k.sasl.mechanism (not (has $k.sasl.mechanism (list "PLAIN" "SCRAM-SHA-256" "SCRAM-SHA-512"))) -}}
{{- fail (printf "kafka.sasl.mechanism %q: one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512" $k.sasl.mechanism) -}}
{{- end -}}
{{- if ne $k.securityProtocol "PLAINTEXT" -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_SECURITY_PROTOCOL" "value" $k.securityProtocol) -}}
{{- end -}}
{{- if $tlsSecret -}}
{{- $volumes = append $volumes (dict "name" "kafka-tls" "secret" (dict "secretName" $tlsSecret)) -}}
{{- $mounts = append $mounts (dict "name" "kafka-tls" "mountPath" "/etc/hami-usage/kafka-tls" "readOnly" true) -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_CA_FILE" "value" (printf "/etc/hami-usage/kafka-tls/%s" (required "kafka.tls.caKey is needed with a TLS Secret" $k.tls.caKey))) -}}
{{- if $k.tls.certKey -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_CERT_FILE" "value" (printf "/etc/hami-usage/kafka-tls/%s" $k.tls.certKey)) -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_KEY_FILE" "value" (printf "/etc/hami-usage/kafka-tls/%s" (required "kafka.tls.keyKey is needed with kafka.tls.certKey" $k.tls.keyKey))) -}}
{{- end -}}
{{- end -}}
{{- if not $k.tls.checkHostname -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_CHECK_HOSTNAME" "value" "false") -}}
{{- end -}}
{{- if $k.sasl.mechanism -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_SASL_MECHANISM" "value" $k.sasl.mechanism) -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_USERNAME" "value" (required "kafka.sasl.username is needed with kafka.sasl.mechanism" $username)) -}}
{{- $secret := required "kafka.sasl.passwordSecret.name is needed with kafka.sasl.mechanism" $password.name -}}
{{- $items := list (dict "key" (required "kafka.sasl.passwordSecret.key is needed with kafka.sasl.mechanism" $password.key) "path" "password") -}}
{{- $volumes = append $volumes (dict "name" "kafka-sasl" "secret" (dict "secretName" $secret "items" $items)) -}}
{{- $mounts = append $mounts (dict "name" "kafka-sasl" "mountPath" "/etc/hami-usage/kafka-sasl" "readOnly" true) -}}
{{- $env = append $env (dict "name" "HAMI_USAGE_KAFKA_PASSWORD_FILE" "value" "/etc/hami-usage/kafka-sasl/password") -}}
{{- end -}}
{{- $_ := set $c "env" $env -}}
{{- $_ := set $c "volumeMounts" $mounts -}}
{{- $_ := set $spec "volumes" $volumes -}}
{{- end -}}

{{/* Scheduling and resources from the values; null keeps the manifest's. */}}
{{- define "hami-usage.placement" -}}
{{- $spec := .spec -}}
{{- $v := .values -}}
{{- if kindIs "map" $v.nodeSelector -}}
{{- if $v.nodeSelector -}}
{{- /* Label values are strings: `--set nodeSelector.x=true` must not become a boolean. */ -}}
{{- $selector := dict -}}
{{- range $key, $value := $v.nodeSelector -}}
{{- $_ := set $selector $key (toString $value) -}}
{{- end -}}
{{- $_ := set $spec "nodeSelector" $selector -}}
{{- else -}}
{{- $_ := unset $spec "nodeSelector" -}}
{{- end -}}
{{- end -}}
{{- if kindIs "slice" $v.tolerations -}}
{{- if $v.tolerations -}}
{{- $_ := set $spec "tolerations" $v.tolerations -}}
{{- else -}}
{{- $_ := unset $spec "tolerations" -}}
{{- end -}}
{{- end -}}
{{- with $v.priorityClassName -}}
{{- $_ := set $spec "priorityClassName" . -}}
{{- end -}}
{{- end -}}
