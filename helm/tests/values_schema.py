#!/usr/bin/env python3
"""Writes helm/dsa-indexer/values.schema.json (JSON Schema 2020-12 of the chart's values): the
schema's source, shorter than the JSON it expands to. Edit this, then run
  python3 helm/tests/values_schema.py > helm/dsa-indexer/values.schema.json
helm/tests/render_and_validate.py fails when the two differ. Every object refuses unknown keys;
the descriptions are what a user reads next to Helm's error.
"""
import json



def obj(props, required=None, desc=None, addl=False):
    """An object of `props` that refuses other keys (unless addl)."""
    o = {"type": "object", "additionalProperties": addl, "properties": props}
    if required:
        o["required"] = required
    if desc:
        o["description"] = desc
    return o


def s(desc=None, **kw):
    """A string with keywords kw (pattern, maxLength, ...)."""
    o = {"type": "string", **kw}
    if desc:
        o["description"] = desc
    return o


def i(lo=None, hi=None, desc=None):
    """An integer in [lo, hi] (both inclusive)."""
    o = {"type": "integer"}
    if lo is not None:
        o["minimum"] = lo
    if hi is not None:
        o["maximum"] = hi
    if desc:
        o["description"] = desc
    return o


def b(desc=None):
    """A boolean."""
    return {"type": "boolean", "description": desc} if desc else {"type": "boolean"}


def ref(name):
    """A reference to $defs/name."""
    return {"$ref": "#/$defs/" + name}


defs = {
  "port": i(1, 65535, "A TCP port, 1..65535."),
  "logLevel": {"type": "string", "enum": ["debug", "info", "warn", "error"], "description": "--log-level: debug, info, warn or error."},
  "logLevelOrInherit": {"type": "string", "enum": ["", "debug", "info", "warn", "error"], "description": "--log-level of this component; empty = the top-level logLevel."},
  "imageVariant": {"type": "string", "enum": ["", "cpu", "cuda"], "description": "Image variant of this component; empty = image.variant."},
  "quantity": {"description": "A Kubernetes quantity, e.g. 500m, 2, 4Gi.",
               "anyOf": [{"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"},
                         {"type": "number", "minimum": 0}]},
  "bytesQuantity": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(k|M|G|T|Ki|Mi|Gi|Ti)?$", "description": "A size, e.g. 64Mi, 1Gi."},
  "stringMap": {"type": "object", "additionalProperties": {"type": "string"}, "description": "A map of string to string."},
  "k8sName": {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", "maxLength": 253, "description": "A Kubernetes object name (lower case, digits, '-', '.'), or empty."},
  "duration": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$", "description": "A Prometheus duration, e.g. 15s, 1m."},
  "intOrPercent": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]{1,3}%$"}], "description": "A count (>= 0) or a percentage like 50%."},
  "resources": obj({
      "requests": {"type": "object", "additionalProperties": ref("quantity")},
      "limits": {"type": "object", "additionalProperties": ref("quantity")},
      "claims": {"type": "array", "items": {"type": "object"}},
  }, desc="Container resources (requests / limits); GPUs come from .gpu, not from here."),
  "probe": obj({
      "periodSeconds": i(1, 3600), "timeoutSeconds": i(1, 3600), "failureThreshold": i(1, 10000),
  }, required=["periodSeconds", "timeoutSeconds", "failureThreshold"]),
  "envVar": {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                            "value": {"type": "string"}, "valueFrom": {"type": "object"}},
             "additionalProperties": False,
             "description": "A container environment variable {name, value} or {name, valueFrom}."},
  "dnsName": s(pattern="^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$", maxLength=253,
                desc="A DNS name (lower case), or empty."),
  "flagValue": {"description": "A flag's value: a string, number, boolean or a list of them (a repeatable flag).",
                "anyOf": [{"type": ["string", "number", "boolean"]},
                          {"type": "array", "items": {"type": ["string", "number", "boolean"]}}]},
}

def config(reserved):
    return {"type": "object",
            "description": "Flags for the component's TOML file: the flag's name without '--' (e.g. max-queue) to its value. The chart sets " + ", ".join(reserved) + " itself.",
            "propertyNames": {"pattern": "^[a-z][a-z0-9]*(-[a-z0-9]+)*$", "not": {"enum": reserved}},
            "additionalProperties": ref("flagValue")}

RESERVED_COMMON = ["config", "listen", "metrics-listen", "drain-delay-ms", "shutdown-grace-ms", "log-level", "version", "help",
                   "health-listen", "tls-cert", "tls-key", "tls-client-ca", "tls-ca", "tls-server-name"]

def component(kind):
    props = {
      "replicas": i(0, 1024, "Pods of this component."),
      "imageVariant": ref("imageVariant"),
      "logLevel": ref("logLevelOrInherit"),
      "tlsSecretName": ref("k8sName") | {"description": "The Secret (tls.crt, tls.key, ca.crt) of this component's certificate; empty = tls.secretName."},
      "ports": obj({"grpc": ref("port"), "metrics": ref("port"),
                    "health": ref("port") | {"description": "--health-listen's port (plaintext grpc.health.v1 for the probes), with tls.enabled."}},
                   required=["grpc", "metrics", "health"]),
      "drainDelayMs": i(0, 3600000, "--drain-delay-ms: readiness NOT_SERVING this long on SIGTERM before the server stops taking calls."),
      "shutdownGraceMs": i(0, 3600000, "--shutdown-grace-ms: then how long in-flight calls may run."),
      "extraArgs": {"type": "array", "items": {"type": "string", "pattern": "^--[a-z]"}, "description": "More command-line flags, each '--name=value'."},
      "extraEnv": {"type": "array", "items": ref("envVar")},
      "extraVolumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
      "extraVolumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
      "resources": ref("resources"),
      "gpu": i(0, 16, "GPUs (gpuResourceName) requested and limited per pod."),
      "shm": obj({"sizeLimit": ref("bytesQuantity")}, required=["sizeLimit"], desc="/dev/shm, a memory-backed emptyDir."),
      "nodeSelector": ref("stringMap"),
      "affinity": {"type": "object"},
      "tolerations": {"type": "array", "items": {"type": "object"}},
      "topologySpreadConstraints": {"type": "array", "items": {"type": "object"}},
      "priorityClassName": ref("k8sName"),
      "runtimeClassName": ref("k8sName"),
      "podAnnotations": ref("stringMap"),
      "podLabels": ref("stringMap"),
      "probes": obj({"startup": ref("probe"), "readiness": ref("probe"), "liveness": ref("probe")},
                    required=["startup", "readiness", "liveness"]),
      "podDisruptionBudget": obj({"enabled": b(), "maxUnavailable": ref("intOrPercent"), "minAvailable": ref("intOrPercent")},
                                 required=["enabled"], desc="minAvailable, when set, wins over maxUnavailable."),
    }
    reserved = list(RESERVED_COMMON)
    if kind == "coordinator":
        props["discovery"] = obj({
            "mode": {"type": "string", "enum": ["dns", "static"], "description": "dns: --indexer-dns / --attention-dns on the headless Services; static: --indexer / --attention per pod."},
            "workerCheckIntervalMs": i(0, 600000, "--worker-check-interval-ms; 0 = resolve and check only at start."),
        }, required=["mode", "workerCheckIntervalMs"])
        props["service"] = obj({"type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                "annotations": ref("stringMap")}, required=["type"])
        reserved += ["indexer", "attention", "indexer-dns", "attention-dns", "worker-check-interval-ms", "colocated",
                     "auth-tokens-file"]
    elif kind == "indexer":
        props["device"] = {"type": "string", "enum": ["cpu", "cuda"], "description": "--device: cpu, or cuda (gpu >= 1, the cuda image)."}
        props["operatorIdentities"] = {
            "type": "array", "uniqueItems": True,
            "items": s(minLength=1, maxLength=1024, pattern="^[^,\\s]([^,]*[^,\\s])?$"),
            "description": "--operator-identities: client certificates' common names that may act on any indexer sequence (the coordinator's); no commas."}
        reserved += ["device", "operator-identities"]
    else:
        props["device"] = {"type": "string", "enum": ["cpu", "cuda"], "description": "--attention-device: cpu, or cuda (gpu >= 1, the cuda image)."}
        props["transport"] = {"type": "string", "enum": ["grpc", "inprocess", "nccl"], "description": "--transport: grpc, inprocess (co-located indexers) or nccl."}
        reserved += ["attention-device", "transport", "indexer-workers", "indexer-dns"]
    props["config"] = config(reserved)
    return obj(props, required=[k for k in props if k not in ("extraArgs", "extraEnv", "extraVolumes", "extraVolumeMounts")],
               desc="The " + kind + " component.")

top = {
  "global": {"type": "object", "description": "Helm's global values (unused by this chart)."},
  "nameOverride": s(pattern="^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", maxLength=40),
  "fullnameOverride": s(pattern="^([a-z]([-a-z0-9]*[a-z0-9])?)?$", maxLength=40, desc="At most 40 characters, a DNS label starting with a letter."),
  "clusterDomain": s(pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"),
  "commonLabels": ref("stringMap"),
  "image": obj({
      "repository": s(minLength=1, pattern="^[a-z0-9][a-z0-9._/:-]*[a-z0-9]$", desc="Image repository (registry host and path), no tag."),
      "tag": s(pattern="^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$", desc="Image tag; empty = appVersion."),
      "variant": {"type": "string", "enum": ["cpu", "cuda"]},
      "cudaTagSuffix": s(pattern="^[A-Za-z0-9_.-]*$"),
      "openaiTagSuffix": s(pattern="^[A-Za-z0-9_.-]*$", desc="Appended to the tag for the OpenAI front's image."),
      "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
  }, required=["repository", "variant", "pullPolicy"]),
  "imagePullSecrets": {"type": "array", "items": obj({"name": s(minLength=1)}, required=["name"])},
  "serviceAccount": obj({"create": b(), "name": ref("k8sName"), "annotations": ref("stringMap"),
                         "automountServiceAccountToken": b()}, required=["create"]),
  "logLevel": ref("logLevel"),
  "gpuResourceName": s(pattern="^[a-z0-9.-]+/[a-zA-Z0-9_.-]+$", desc="Extended resource of a GPU, e.g. nvidia.com/gpu."),
  "terminationGraceMarginSeconds": i(1, 600, "Seconds above the drain in terminationGracePeriodSeconds (at least 1: the kubelet must not kill a pod as its drain ends)."),
  "podSecurityContext": {"type": "object"},
  "securityContext": {"type": "object"},
  "nccl": obj({"env": {"type": "object",
                        "description": "NCCL_* variables of the indexer and attention workers.",
                        "propertyNames": {"pattern": "^NCCL_[A-Z0-9_]+$"},
                        "additionalProperties": {"type": ["string", "integer"]}}}),
  "rdma": obj({
      "enabled": b(), "hostNetwork": b(),
      "resourceName": s(pattern="^([a-z0-9.-]+/[a-zA-Z0-9_.-]+)?$", desc="Device-plugin resource of an RDMA device, e.g. rdma/rdma_shared_device_a; empty = none."),
      "resourceCount": i(1, 64),
      "capabilities": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z_]+$"}},
  }, required=["enabled", "hostNetwork"]),
  "tls": obj({
      "enabled": b("TLS on every gRPC port and hop; the probes move to ports.health."),
      "secretName": ref("k8sName") | {"description": "A kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt; needed when enabled."},
      "mutual": b("Servers require client certificates chained to ca.crt (--tls-client-ca)."),
      "serverName": ref("dnsName") | {"description": "--tls-server-name of the coordinator, the attention workers and the worker test pods; needed with discovery mode dns."},
  }, required=["enabled", "secretName", "mutual", "serverName"]),
  "auth": obj({
      "tokensSecret": ref("k8sName") | {"description": "A Secret whose key `tokens` is the coordinator's --auth-tokens-file; needs tls.enabled."},
      "testTokenKey": s(pattern="^([-._a-zA-Z0-9]+)?$", maxLength=253, desc="A key of tokensSecret holding the helm test pod's token."),
  }, required=["tokensSecret", "testTokenKey"]),
  "model": obj({
      "name": {"type": "string", "enum": ["smollm2", "pattern"],
               "description": "smollm2: SmolLM2-135M with its trained lightning indexers (the images carry its files); pattern: the synthetic pattern model (no tokens)."},
      "dir": s("The model's folder in the image (model.safetensors, tokenizer.json).", pattern="^/[^\\s]*$"),
      "indexerWeights": s("The lightning indexers' weights in the image.", pattern="^/[^\\s]*$"),
  }, required=["name", "dir", "indexerWeights"]),
  "coordinator": component("coordinator"),
  "indexer": component("indexer"),
  "attention": component("attention"),
  "openai": obj({
      "enabled": b("Render the OpenAI-compatible front (needs model.name smollm2)."),
      "replicas": i(0, 1024, "Pods of the front."),
      "port": ref("port") | {"description": "HTTP port of the container and the Service."},
      "timeoutSeconds": i(1, 86400, "--timeout-s: the deadline of each request's Generate call."),
      "drainDelaySeconds": i(0, 3600, "--drain-delay-s: on SIGTERM, how long /health answers 503 while requests are still taken."),
      "shutdownGraceSeconds": i(0, 3600, "--shutdown-grace-s: then how long requests in flight may run on."),
      "tlsSecretName": ref("k8sName") | {"description": "The Secret of the front's certificate (the names clients call it by); empty = tls.secretName."},
      "healthTokenKey": s(pattern="^([-._a-zA-Z0-9]+)?$", maxLength=253,
                          desc="With auth.tokensSecret: the key of that Secret holding the front's own token (start-up and /health)."),
      "service": obj({"type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                      "annotations": ref("stringMap")}, required=["type"]),
      "extraArgs": {"type": "array", "items": {"type": "string", "pattern": "^--[a-z]"}, "description": "More flags of python -m dsa_openai, each '--name=value'."},
      "extraEnv": {"type": "array", "items": ref("envVar")},
      "resources": ref("resources"),
      "nodeSelector": ref("stringMap"),
      "affinity": {"type": "object"},
      "tolerations": {"type": "array", "items": {"type": "object"}},
      "topologySpreadConstraints": {"type": "array", "items": {"type": "object"}},
      "priorityClassName": ref("k8sName"),
      "podAnnotations": ref("stringMap"),
      "podLabels": ref("stringMap"),
      "probes": obj({"startup": ref("probe"), "readiness": ref("probe"), "liveness": ref("probe")},
                    required=["startup", "readiness", "liveness"]),
      "podDisruptionBudget": obj({"enabled": b(), "maxUnavailable": ref("intOrPercent"), "minAvailable": ref("intOrPercent")},
                                 required=["enabled"], desc="minAvailable, when set, wins over maxUnavailable."),
  }, required=["enabled", "replicas", "port", "timeoutSeconds", "drainDelaySeconds", "shutdownGraceSeconds", "tlsSecretName", "healthTokenKey", "service", "resources", "probes",
               "podDisruptionBudget"], desc="The OpenAI-compatible front (python -m dsa_openai)."),
  "monitoring": obj({
      "scrape": obj({"enabled": b(), "kind": {"type": "string", "enum": ["PodMonitor", "ServiceMonitor"]},
                     "interval": ref("duration"), "scrapeTimeout": ref("duration"), "labels": ref("stringMap")},
                    required=["enabled", "kind", "interval", "scrapeTimeout"]),
      "prometheusRule": obj({"enabled": b(), "labels": ref("stringMap"),
                             "runbookUrl": s("Where your team reads docs/deploy.md (an http(s) URL, "
                                             "no '#'): each alert's runbook_url is it plus the "
                                             "alert's anchor. Empty: the alerts carry no runbook_url.",
                                             pattern="^(https?://[^#\\s]+)?$"),
                             "thresholds": obj({
                                 "auditedMissRatio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                                      "description": "DsaIndexerAuditedMissRatioHigh's threshold without --miss-target."},
                                 "selectionWaitSeconds": {"type": "number", "exclusiveMinimum": 0,
                                                          "description": "DsaAttentionSelectionWaitOverBudget's budget (seconds)."}},
                                 required=["auditedMissRatio", "selectionWaitSeconds"])},
                            required=["enabled"]),
      "dashboards": obj({"enabled": b(), "labels": ref("stringMap"), "annotations": ref("stringMap"),
                         "namespace": ref("k8sName")}, required=["enabled"]),
  }),
  "autoscaling": obj({
      "enabled": b(), "kind": {"type": "string", "enum": ["keda", "hpa"],
                               "description": "keda: a KEDA ScaledObject; hpa: a HorizontalPodAutoscaler on prometheus-adapter's external metric."},
      "prometheusAddress": s("The Prometheus KEDA queries.", pattern="^https?://[^\\s]+$"),
      "pollingIntervalSeconds": i(1, 3600), "cooldownPeriodSeconds": i(0, 86400),
      "coordinator": obj({"enabled": b(), "minReplicas": i(1, 1000), "maxReplicas": i(1, 1000),
                          "queuedPerReplica": i(1, 100000)},
                         required=["enabled", "minReplicas", "maxReplicas", "queuedPerReplica"]),
      "indexer": obj({"enabled": b(), "minReplicas": i(1, 1000), "maxReplicas": i(1, 1000),
                      "usedFraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
                     required=["enabled", "minReplicas", "maxReplicas", "usedFraction"]),
      "attention": obj({"enabled": b(), "minReplicas": i(1, 1000), "maxReplicas": i(1, 1000),
                        "usedFraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
                       required=["enabled", "minReplicas", "maxReplicas", "usedFraction"]),
  }, required=["enabled", "kind"]),
  "routes": obj({
      "grpcRoute": obj({"enabled": b(),
                        "parentRefs": {"type": "array", "items": {"type": "object"},
                                       "description": "Gateway API ParentReferences of the GRPCRoute."},
                        "hostnames": {"type": "array", "items": {"type": "string"}}},
                       required=["enabled"]),
      "ingress": obj({"enabled": b(), "className": s(), "annotations": ref("stringMap"),
                      "host": s("The Ingress rule's host."),
                      "tls": {"type": "array", "items": {"type": "object"}}},
                     required=["enabled"]),
      "httpRoute": obj({"enabled": b(),
                        "parentRefs": {"type": "array", "items": {"type": "object"},
                                       "description": "Gateway API ParentReferences of the HTTPRoute to the OpenAI front."},
                        "hostnames": {"type": "array", "items": {"type": "string"}}},
                       required=["enabled"]),
      "openaiIngress": obj({"enabled": b(), "className": s(), "annotations": ref("stringMap"),
                            "host": s("The Ingress rule's host."),
                            "tls": {"type": "array", "items": {"type": "object"}}},
                           required=["enabled"]),
  }),
  "networkPolicy": obj({"enabled": b(),
                        "routers": {"type": "array", "items": {"type": "object"},
                                    "description": "NetworkPolicyPeers allowed to call the coordinator; [] = any source."},
                        "monitoring": {"type": "array", "items": {"type": "object"},
                                       "description": "NetworkPolicyPeers allowed to scrape /metrics; [] = any source."},
                        "httpClients": {"type": "array", "items": {"type": "object"},
                                        "description": "NetworkPolicyPeers allowed to call the OpenAI front; [] = any source."}},
                       required=["enabled"]),
  "tests": obj({"enabled": b(), "timeoutMs": i(1, 600000), "nodeSelector": ref("stringMap"),
                "tolerations": {"type": "array", "items": {"type": "object"}}, "resources": ref("resources")},
               required=["enabled", "timeoutMs"]),
}
schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
          "$id": "dsa-indexer/values.schema.json",
          "title": "Values of the dsa-indexer chart",
          "description": "Every key is documented in values.yaml; unknown keys are refused.",
          "type": "object", "additionalProperties": False, "properties": top,
          "required": ["image", "coordinator", "indexer", "attention"],
          "$defs": defs}


if __name__ == "__main__":
    print(json.dumps(schema, indent=2))
