#!/usr/bin/env python3
"""The Helm chart's CI check (scripts/check_chart.sh runs it; docs/deploy.md, "The Helm chart").

Renders helm/dsa-indexer with Helm's own engine (helm-python-sdk's libhelm_c, offline) for the
default values, every examples/*.yaml and a few scenarios that reach the other branches, test
hooks included, then:
  1. lints the chart (Helm's linter, warnings are failures);
  2. validates every rendered object: Kubernetes kinds with kubernetes-validate (strict, against
     KUBE_VERSION's bundled schemas), Prometheus Operator kinds with check-jsonschema against
     deploy/schemas/prometheus-operator/ (vendored, see deploy/schemas/README.md);
  3. checks what the chart promises in every render (recommended labels, grpc probes, the drain
     fitting in terminationGracePeriodSeconds, non-root pods, only flags the binaries have, the
     coordinator's discovery names matching the headless Services, the attention workers'
     indexer allow-list equal to the coordinator's indexers, TLS and bearer tokens as the values
     ask: every file flag a mounted Secret key, the probes on the health port, the tokens in the
     coordinator only, the helm test pods) and what each example promises (GPUs, IPC_LOCK and the
     RDMA device, NCCL over nccl, monitoring, mutual TLS with tokens);
  4. checks that values.schema.json and the templates' own checks refuse bad values, each with
     the message a user needs.
Prints one line per scenario and exits 1 with every failure listed. Needs no network.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import struct
import sys
import tempfile
import tomllib
from typing import Any, Callable

import helm_python as helm
import kubernetes_validate
import yaml
from helm_python import _native

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(REPO, "helm", "dsa-indexer")
CRD_SCHEMAS = os.path.join(REPO, "deploy", "schemas")
KUBE_VERSION = "1.30.0"  # the oldest version the chart is validated against (Chart.yaml annotation)
RELEASE, NAMESPACE = "dsa", "serving"
# Kinds kubernetes-validate does not know, and the vendored schema of each.
CRD_KINDS = {
    "ServiceMonitor": "prometheus-operator/servicemonitor_v1.json",
    "PodMonitor": "prometheus-operator/podmonitor_v1.json",
    "PrometheusRule": "prometheus-operator/prometheusrule_v1.json",
    "ScaledObject": "keda/scaledobject_v1alpha1.json",
    "GRPCRoute": "gateway-api/grpcroute_v1.json",
    "HTTPRoute": "gateway-api/httproute_v1.json",
}
APP_VERSION = str(yaml.safe_load(open(os.path.join(CHART, "Chart.yaml"), encoding="utf-8"))["appVersion"])
BINARIES = {
    "coordinator": "/usr/local/bin/dsa-coordinator",
    "indexer": "/usr/local/bin/dsa-indexer",
    "attention": "/usr/local/bin/dsa-attention",
}
# The flags of each binary (without "--"): server/server.cc, coordinator/main.cc,
# indexer_service/indexer_flags.cc + main.cc, attention_worker/main.cc, plus the ones
# docs/deploy.md's contract adds (--config, --log-level, --indexer-dns, --attention-dns,
# --worker-check-interval-ms, --ttft-buckets, --itl-buckets; --worker-check-timeout-ms,
# --unready-after-timed-out-checks and --load-cache-ms are the coordinator's own; --health-listen,
# the --tls-* flags, --auth-tokens-file, --operator-identities, --indexer-workers: "TLS, mutual TLS
# and bearer tokens"). A flag the chart renders (on the command line or in a TOML file) must be
# one of these.
TLS_FLAGS = {"tls-cert", "tls-key", "tls-client-ca", "tls-ca", "tls-server-name", "tls-reload-interval-s"}
SERVER_FLAGS = {"listen", "metrics-listen", "shutdown-grace-ms", "drain-delay-ms", "log-level", "config",
                "health-listen"} | TLS_FLAGS
INDEXER_ENGINE_FLAGS = {"capacity-blocks", "audit-fraction", "audit-seed", "device", "cuda-device",
                        "scan-kernel", "gpu-spin"}
KNOWN_FLAGS = {
    "coordinator": SERVER_FLAGS | {
        "indexer", "attention", "indexer-dns", "attention-dns", "worker-check-interval-ms",
        "worker-check-timeout-ms", "unready-after-timed-out-checks", "load-cache-ms",
        "max-queue", "colocated", "max-running", "top-k", "target-block-sparsity",
        "exploration-fraction", "all-keep", "acceptance-rate", "seed", "retain-finished",
        "stall-timeout-ms", "rpc-timeout-ms", "ttft-buckets", "itl-buckets", "auth-tokens-file",
        "hung-worker-checks", "max-migrations", "ngram-min", "ngram-max", "name", "lease-ttl-ms",
        "max-queued-per-caller", "max-running-per-caller", "caller-weight"},
    "indexer": SERVER_FLAGS | INDEXER_ENGINE_FLAGS | {"num-heads", "head-dim", "operator-identities"},
    "attention": SERVER_FLAGS | {"indexer-" + f for f in INDEXER_ENGINE_FLAGS} | {
        "layer-pattern", "retention", "num-model-layers", "lag-depth", "num-heads", "head-dim",
        "kv-dim", "attention-heads", "kv-capacity-slots", "prefill-threads", "seed", "transport",
        "attention-device", "attention-cuda-device", "device-selects", "layer-standin",
        "layer-standin-weight-bytes", "layer-standin-busy-us", "layer-standin-max-rows",
        "indexer-workers", "indexer-dns", "model", "model-file", "indexer-weights"},
}
# python -m dsa_openai's flags, read from its argument parser's source.
with open(os.path.join(REPO, "python", "dsa_openai", "__main__.py"), encoding="utf-8") as _front:
    FRONT_FLAGS = set(re.findall(r'add_argument\("--([a-z][a-z-]*)"', _front.read()))
FRONT_COMMAND = ["python", "-m", "dsa_openai"]
# The flags of `dsa health` (tools/dsa/main.cc) the helm test pods may pass.
HEALTH_FLAGS = {"target", "service", "timeout-ms", "tls-ca", "tls-cert", "tls-key", "tls-server-name",
                "token-file"}
# Flags whose value is a file the pod must have mounted.
FILE_FLAGS = ("tls-cert", "tls-key", "tls-ca", "tls-client-ca", "auth-tokens-file", "token-file")
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                      "app.kubernetes.io/version", "app.kubernetes.io/component",
                      "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by", "helm.sh/chart")


class Failures:
    """Collects failures with the scenario and object they belong to."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.checks = 0

    def check(self, ok: bool, where: str, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.messages.append(f"{where}: {message}")
        return ok


def render(chart: helm.Chart, values: dict[str, Any] | None) -> dict[str, str]:
    """Renders the chart (templates and test hooks) as `helm install` would, offline, with the
    capabilities of KUBE_VERSION and the Prometheus Operator's API. Raises helm.HelmError."""
    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
               "kube_version": "v" + KUBE_VERSION, "api_versions": ["monitoring.coreos.com/v1"]}
    # helm_render's own options (Chart.render does not expose kube_version / api_versions).
    rendered = _native.call_string("helm_render", chart._raw(),
                                   None if values is None else json.dumps(values), json.dumps(options))
    return json.loads(rendered)


def objects_of(manifests: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(template, object) of every rendered YAML document."""
    found = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                found.append((template.split("/templates/", 1)[-1], doc))
    return found


def name_of(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def validate_objects(scenario: str, objs: list[tuple[str, dict[str, Any]]], f: Failures) -> None:
    """kubernetes-validate (strict) for Kubernetes kinds, check-jsonschema for the CRD kinds
    (deploy/schemas: the Prometheus Operator's and KEDA's)."""
    crd_docs: dict[str, list[dict[str, Any]]] = {}
    for template, obj in objs:
        where = f"{scenario}: {template}: {name_of(obj)}"
        if obj.get("kind") in CRD_KINDS:
            crd_docs.setdefault(obj["kind"], []).append(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            f.check(True, where, "")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            f.check(False, where, f"kubernetes-validate {KUBE_VERSION} (strict): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            f.check(False, where, e.message)
    check_jsonschema = os.path.join(os.path.dirname(sys.executable), "check-jsonschema")
    for kind, docs in crd_docs.items():
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for n, doc in enumerate(docs):
                path = os.path.join(tmp, f"{kind.lower()}-{n}.yaml")
                with open(path, "w", encoding="utf-8") as out:
                    yaml.safe_dump(doc, out)
                paths.append(path)
            run = subprocess.run([check_jsonschema, "--no-cache", "--schemafile",
                                  os.path.join(CRD_SCHEMAS, CRD_KINDS[kind]), *paths],
                                 capture_output=True, text=True, check=False)
            f.check(run.returncode == 0, f"{scenario}: {kind}",
                    f"check-jsonschema against the vendored CRD schema {CRD_KINDS[kind]}:\n"
                    + (run.stdout + run.stderr).strip())


def flag_name(arg: str) -> str:
    return arg[2:].split("=", 1)[0]


def flag_values(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def merged(defaults: Any, values: Any) -> Any:
    """values over defaults, as Helm merges a values file over values.yaml."""
    if isinstance(defaults, dict) and isinstance(values, dict):
        out = dict(defaults)
        for k, v in values.items():
            out[k] = merged(defaults.get(k), v) if k in defaults else v
        return out
    return values


def mounted_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str, str] | None:
    """(volume kind, object name, key) of the file `path` in `container`: a file of a Secret or
    ConfigMap volume mounted at its folder (an `items` entry when the volume lists items), or
    None when no mounted volume holds it."""
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    mount = mounts.get(os.path.dirname(path))
    if mount is None:
        return None
    volume = {v["name"]: v for v in spec.get("volumes", [])}.get(mount["name"], {})
    for kind, name_key in (("secret", "secretName"), ("configMap", "name")):
        if kind in volume:
            source = volume[kind]
            items = source.get("items")
            keys = {i["path"]: i["key"] for i in items} if items is not None else None
            key = os.path.basename(path) if keys is None else keys.get(os.path.basename(path))
            return None if key is None else (kind, source[name_key], key)
    return None


def secrets_of(spec: dict[str, Any]) -> dict[str, set[str]]:
    """Secret name -> the keys a pod's volumes take from it ("*" for a whole Secret)."""
    found: dict[str, set[str]] = {}
    for v in spec.get("volumes", []):
        if "secret" in v:
            items = v["secret"].get("items")
            found.setdefault(v["secret"]["secretName"], set()).update(
                {i["key"] for i in items} if items is not None else {"*"})
    return found


def check_security(where: str, component: str, v: dict[str, Any], spec: dict[str, Any],
                   container: dict[str, Any], ports: dict[str, int], f: Failures) -> None:
    """TLS, the health port and the bearer tokens of one server container, as the values ask."""
    args = container["args"]
    tls, auth = v["tls"], v["auth"]
    health_listen = flag_values(args, "health-listen")
    if tls["enabled"]:
        f.check(set(ports) == {"grpc", "metrics", "health"}, where,
                f"with tls.enabled the ports must be grpc, metrics and health, are {ports}")
        f.check(health_listen == [f"0.0.0.0:{ports.get('health')}"], where,
                f"--health-listen {health_listen} must be the health container port {ports.get('health')}")
        for flag in ("tls-cert", "tls-key", "tls-ca"):
            f.check(len(flag_values(args, flag)) == 1, where, f"tls.enabled: --{flag} must be passed once")
        f.check(len(flag_values(args, "tls-client-ca")) == (1 if tls["mutual"] else 0), where,
                f"--tls-client-ca must be passed {'once (tls.mutual)' if tls['mutual'] else 'never (tls.mutual false)'}")
        want_name = [tls["serverName"]] if tls["serverName"] and component != "indexer" else []
        f.check(flag_values(args, "tls-server-name") == want_name, where,
                f"--tls-server-name {flag_values(args, 'tls-server-name')}, expected {want_name}")
        want_secret = v[component]["tlsSecretName"] or tls["secretName"]
        cert = flag_values(args, "tls-cert")
        source = mounted_file(spec, container, cert[0]) if cert else None
        f.check(source is not None and source[:2] == ("secret", want_secret), where,
                f"--tls-cert must be a key of the Secret {want_secret}, is {source}")
    else:
        f.check(set(ports) == {"grpc", "metrics"}, where, f"ports must be grpc and metrics, are {ports}")
        present = sorted({flag_name(a) for a in args if flag_name(a) in TLS_FLAGS | {"health-listen"}})
        f.check(not present, where, f"tls.enabled is false but {present} are passed")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        want = ports.get("health") if tls["enabled"] else ports.get("grpc")
        f.check(container.get(probe, {}).get("grpc", {}).get("port") == want, where,
                f"{probe} must ask port {want} ({'health: the kubelet speaks no TLS' if tls['enabled'] else 'grpc'})")
    for flag in FILE_FLAGS:
        for path in flag_values(args, flag):
            source = mounted_file(spec, container, path)
            f.check(source is not None and source[0] == "secret", where,
                    f"--{flag}={path} is not a key of a mounted Secret ({source})")
            if flag == "auth-tokens-file" and source is not None:
                f.check(source[1:] == (auth["tokensSecret"], "tokens"), where,
                        f"--auth-tokens-file must be auth.tokensSecret's key tokens, is {source}")
    tokens = component == "coordinator" and bool(auth["tokensSecret"])
    f.check(len(flag_values(args, "auth-tokens-file")) == (1 if tokens else 0), where,
            f"--auth-tokens-file must be passed {'once' if tokens else 'only to the coordinator with auth.tokensSecret'}")
    f.check(tokens or auth["tokensSecret"] not in secrets_of(spec), where,
            f"the tokens Secret {auth['tokensSecret']} is mounted outside the coordinator")
    if not tls["enabled"]:
        f.check(not secrets_of(spec), where, f"tls.enabled is false but Secrets are mounted: {secrets_of(spec)}")
    if component == "indexer":
        f.check(flag_values(args, "operator-identities") == list(v["indexer"]["operatorIdentities"]), where,
                f"--operator-identities {flag_values(args, 'operator-identities')} are not "
                f"indexer.operatorIdentities {v['indexer']['operatorIdentities']}")


def check_invariants(scenario: str, values: dict[str, Any], objs: list[tuple[str, dict[str, Any]]],
                     f: Failures) -> dict[str, Any]:
    """What every render must hold. Returns what the example checks need (pods by component)."""
    chart_values = merged(load_yaml(os.path.join(CHART, "values.yaml")), values)
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for _, obj in objs:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    configmaps = by_kind.get("ConfigMap", {})
    services = by_kind.get("Service", {})
    headless = {n: s for n, s in services.items() if s["spec"].get("clusterIP") == "None"}
    pods: dict[str, dict[str, Any]] = {}  # component -> pod template (Deployment / StatefulSet)
    tomls: dict[str, dict[str, Any]] = {}
    front: dict[str, Any] | None = None  # the OpenAI front's pod template

    for template, obj in objs:
        where = f"{scenario}: {template}: {name_of(obj)}"
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in RECOMMENDED_LABELS if k not in labels and
                   not (k == "app.kubernetes.io/component" and obj["kind"] in
                        ("ConfigMap", "ServiceAccount", "PodMonitor", "ServiceMonitor", "PrometheusRule"))]
        f.check(not missing, where, f"missing labels {missing}")
        f.check(obj["metadata"].get("namespace") == NAMESPACE or obj["kind"] == "ConfigMap",
                where, f"namespace is {obj['metadata'].get('namespace')!r}, not the release's")

    for name, svc in headless.items():
        f.check(svc["spec"].get("publishNotReadyAddresses") is False, f"{scenario}: Service/{name}",
                "a headless worker Service must set publishNotReadyAddresses: false "
                "(only ready workers may resolve)")

    for kind in ("Deployment", "StatefulSet"):
        for name, workload in by_kind.get(kind, {}).items():
            where = f"{scenario}: {kind}/{name}"
            template = workload["spec"]["template"]
            component = template["metadata"]["labels"].get("app.kubernetes.io/component")
            if component == "openai":
                front = template
                check_front(where, chart_values, template, services, f)
                continue
            pods[component] = template
            spec = template["spec"]
            selector = workload["spec"]["selector"]["matchLabels"]
            f.check(all(template["metadata"]["labels"].get(k) == v for k, v in selector.items()),
                    where, "the selector does not match the pod template's labels")
            if kind == "StatefulSet":
                f.check(workload["spec"]["serviceName"] in headless, where,
                        f"serviceName {workload['spec']['serviceName']!r} is not a rendered headless Service")
            psc = spec.get("securityContext", {})
            f.check(psc.get("runAsNonRoot") is True and psc.get("runAsUser") == 10001 and
                    psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where,
                    f"pod securityContext must be non-root uid 10001 with seccomp RuntimeDefault, is {psc}")
            f.check(spec.get("enableServiceLinks") is False, where,
                    "enableServiceLinks must be false (service-link variables named DSA_* would read as flags)")
            (container,) = spec["containers"]
            csc = container.get("securityContext", {})
            caps = csc.get("capabilities", {})
            f.check(csc.get("readOnlyRootFilesystem") is True and csc.get("allowPrivilegeEscalation") is False
                    and caps.get("drop") == ["ALL"], where,
                    f"container securityContext must drop ALL, read-only root, no escalation; is {csc}")
            f.check(set(caps.get("add", [])) <= {"IPC_LOCK"}, where,
                    f"capabilities added beyond IPC_LOCK: {caps.get('add')}")
            f.check(container["command"] == [BINARIES.get(component, "?")], where,
                    f"command {container['command']} is not {BINARIES.get(component)}")
            args = container["args"]
            unknown = [a for a in args if not a.startswith("--") or flag_name(a) not in KNOWN_FLAGS[component]]
            f.check(not unknown, where, f"arguments the binary does not have: {unknown}")
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            check_security(where, component, chart_values, spec, container, ports, f)
            f.check(flag_values(args, "listen") == [f"0.0.0.0:{ports.get('grpc')}"] and
                    flag_values(args, "metrics-listen") == [f"0.0.0.0:{ports.get('metrics')}"], where,
                    "--listen / --metrics-listen must be the grpc / metrics container ports")
            for probe, service in (("startupProbe", "liveness"), ("readinessProbe", "readiness"),
                                   ("livenessProbe", "liveness")):
                p = container.get(probe, {})
                f.check(p.get("grpc", {}).get("service") == service and set(p.get("grpc", {})) == {"port", "service"},
                        where, f"{probe} must be grpc {{port, service: {service}}}, is {p}")
            drain = flag_values(args, "drain-delay-ms")
            grace = flag_values(args, "shutdown-grace-ms")
            if f.check(len(drain) == 1 and len(grace) == 1, where,
                       "--drain-delay-ms and --shutdown-grace-ms must each be passed once"):
                total_ms = int(drain[0]) + int(grace[0])
                tgps = spec.get("terminationGracePeriodSeconds", 30)
                f.check(tgps * 1000 >= total_ms + 1000, where,
                        f"terminationGracePeriodSeconds {tgps} s does not cover the drain "
                        f"({drain[0]} + {grace[0]} ms) plus a second")
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            shm = volumes.get(mounts.get("/dev/shm", {}).get("name"), {}).get("emptyDir", {})
            f.check(shm.get("medium") == "Memory" and "sizeLimit" in shm, where,
                    f"/dev/shm must be a Memory emptyDir with a sizeLimit, is {shm}")
            config = flag_values(args, "config")
            if f.check(len(config) == 1 and os.path.dirname(config[0]) in mounts, where,
                       f"--config {config} is not a file in a mounted volume"):
                volume = volumes[mounts[os.path.dirname(config[0])]["name"]]
                cm = configmaps.get(volume.get("configMap", {}).get("name"), {})
                key = os.path.basename(config[0])
                if f.check(key in cm.get("data", {}), where, f"ConfigMap has no {key} for --config"):
                    try:
                        toml = tomllib.loads(cm["data"][key])
                    except tomllib.TOMLDecodeError as e:
                        f.check(False, where, f"{key} is not valid TOML: {e}")
                        toml = {}
                    tomls[component] = toml
                    bad = sorted(k for k in toml if k not in KNOWN_FLAGS[component])
                    f.check(not bad, where, f"{key} sets flags the binary does not have: {bad}")
                    f.check(toml.get("log-level") in ("debug", "info", "warn", "error"), where,
                            f"{key}: log-level is {toml.get('log-level')!r}")
            if component in ("indexer", "attention"):
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                expected_nccl = values.get("nccl", {}).get("env", {"NCCL_NVLS_ENABLE": "0"})
                for k, v in expected_nccl.items():
                    f.check(env.get(k) == str(v), where, f"env {k} is {env.get(k)!r}, values say {v!r}")

    # The coordinator's worker addresses name the rendered headless Services and pods.
    coordinator = pods.get("coordinator")
    if f.check(coordinator is not None, f"{scenario}", "no coordinator rendered"):
        args = coordinator["spec"]["containers"][0]["args"]
        # Its lease owner is its pod's name: the same across a container's restarts, distinct
        # between replicas (two replicas of one name would supersede each other's leases).
        env = {e["name"]: e for e in coordinator["spec"]["containers"][0].get("env", [])}
        f.check(flag_values(args, "name") == ["$(DSA_POD_NAME)"] and
                env.get("DSA_POD_NAME", {}).get("valueFrom") == {"fieldRef": {"fieldPath": "metadata.name"}},
                f"{scenario}: coordinator",
                f"--name must be the pod's name (downward API), is {flag_values(args, 'name')} with env "
                f"{env.get('DSA_POD_NAME')}")
        suffix = f".{NAMESPACE}.svc.cluster.local"
        for kind in ("indexer", "attention"):
            addresses = flag_values(args, f"{kind}-dns") + flag_values(args, kind)
            f.check(bool(addresses), f"{scenario}: coordinator",
                    f"neither --{kind}-dns nor --{kind} is passed (the coordinator needs one)")
            for address in addresses:
                host, _, port = address.rpartition(":")
                svc_name = host.removesuffix(suffix).split(".")[-1]
                svc = headless.get(svc_name)
                if f.check(host.endswith(suffix) and svc is not None, f"{scenario}: coordinator",
                           f"--{kind} address {address} is not a rendered headless Service"):
                    f.check(int(port) in [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"],
                            f"{scenario}: coordinator", f"{address}: port is not {svc_name}'s grpc port")
        if tomls.get("attention", {}).get("transport") == "inprocess":
            f.check(tomls.get("coordinator", {}).get("colocated") is True and
                    flag_values(args, "indexer") == flag_values(args, "attention"), f"{scenario}: coordinator",
                    "transport inprocess needs --colocated and the same ordered --indexer / --attention lists")
        # The attention workers accept exactly the indexers the coordinator places on.
        if "attention" in pods:
            attention_args = pods["attention"]["spec"]["containers"][0]["args"]
            allowed = (flag_values(attention_args, "indexer-workers"), flag_values(attention_args, "indexer-dns"))
            f.check(allowed == (flag_values(args, "indexer"), flag_values(args, "indexer-dns")) and any(allowed),
                    f"{scenario}: attention", f"the indexer allow-list (--indexer-workers {allowed[0]}, "
                    f"--indexer-dns {allowed[1]}) must equal the coordinator's --indexer "
                    f"{flag_values(args, 'indexer')} / --indexer-dns {flag_values(args, 'indexer-dns')}")

    # helm test pods: dsa health --service readiness against the coordinator Service and workers.
    tests = [o for _, o in objs if o["kind"] == "Pod"]
    if values.get("tests", {}).get("enabled", True):
        f.check(len(tests) >= 2, scenario, f"expected helm test pods, found {len(tests)}")
    for pod in tests:
        where = f"{scenario}: {name_of(pod)}"
        f.check(pod["metadata"].get("annotations", {}).get("helm.sh/hook") == "test", where,
                "a test pod needs the helm.sh/hook: test annotation")
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        f.check(container["command"] == ["/usr/local/bin/dsa"] and args[0] == "health" and
                "--service=readiness" in args and flag_values(args, "timeout-ms") != [], where,
                f"must run dsa health --service readiness --timeout-ms N, runs {container['command'] + args}")
        (target,) = flag_values(args, "target")
        host = target.rpartition(":")[0].removesuffix(f".{NAMESPACE}.svc.cluster.local")
        f.check(host in services or host.split(".")[-1] in headless, where,
                f"--target {target} is not a rendered Service or a StatefulSet pod's stable name")
        unknown = [a for a in args[1:] if not a.startswith("--") or flag_name(a) not in HEALTH_FLAGS]
        f.check(not unknown, where, f"arguments dsa health does not have: {unknown}")
        worker = host not in services  # a StatefulSet pod, dialed as the coordinator dials it
        tls, auth = chart_values["tls"], chart_values["auth"]
        present = {flag_name(a) for a in args[1:]} & (TLS_FLAGS | {"token-file"})
        want = set()
        if tls["enabled"]:
            want |= {"tls-ca"} | ({"tls-cert", "tls-key"} if tls["mutual"] else set())
            want |= {"tls-server-name"} if worker and tls["serverName"] else set()
        want |= {"token-file"} if not worker and auth["tokensSecret"] else set()
        f.check(present == want, where, f"TLS / token flags {sorted(present)}, expected {sorted(want)}")
        if "tls-server-name" in want:
            f.check(flag_values(args, "tls-server-name") == [tls["serverName"]], where,
                    "--tls-server-name must be tls.serverName (the name the coordinator checks)")
        spec = pod["spec"]
        for flag in FILE_FLAGS:
            for path in flag_values(args, flag):
                source = mounted_file(spec, container, path)
                expected = ((auth["tokensSecret"], auth["testTokenKey"]) if flag == "token-file"
                            else (tls["secretName"], os.path.basename(path)))
                f.check(source == ("secret", *expected), where,
                        f"--{flag}={path} must be the key {expected[1]} of the Secret {expected[0]}, is {source}")
        f.check("tokens" not in secrets_of(spec).get(auth["tokensSecret"], set()) and
                "*" not in secrets_of(spec).get(auth["tokensSecret"], set()), where,
                "a test pod must not mount the coordinator's tokens file")
    targets = " ".join(" ".join(p["spec"]["containers"][0]["args"]) for p in tests)
    if tests:
        f.check(f"{RELEASE}-dsa-indexer-coordinator.{NAMESPACE}" in targets, scenario,
                "no helm test pod checks the coordinator Service")
        f.check("attention-0." in targets, scenario, "no helm test pod checks attention worker 0")

    # Every PodDisruptionBudget selects a rendered component and protects it: its workload keeps a
    # pod through an eviction the budget allows, and still allows one.
    workloads = {**by_kind.get("Deployment", {}), **by_kind.get("StatefulSet", {})}
    for name, pdb in by_kind.get("PodDisruptionBudget", {}).items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        rendered_pods = list(pods.values()) + ([front] if front is not None else [])
        f.check(any(all(t["metadata"]["labels"].get(k) == v for k, v in sel.items()) for t in rendered_pods),
                f"{scenario}: PodDisruptionBudget/{name}", "selects no rendered pods")
        owners = [w for w in workloads.values()
                  if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        scaled_min = {}
        for so in by_kind.get("ScaledObject", {}).values():
            scaled_min[so["spec"]["scaleTargetRef"]["name"]] = so["spec"].get("minReplicaCount", 1)
        for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
            scaled_min[hpa["spec"]["scaleTargetRef"]["name"]] = hpa["spec"].get("minReplicas", 1)
        for owner in owners:
            # An autoscaled workload sets no replicas: the fewest it runs is its scaler's minimum.
            replicas = owner["spec"].get("replicas", scaled_min.get(owner["metadata"]["name"], 1))
            spec = pdb["spec"]
            allowed = spec.get("maxUnavailable")
            if isinstance(allowed, int):
                protects = 1 <= allowed < replicas
            elif isinstance(spec.get("minAvailable"), int):
                protects = 1 <= spec["minAvailable"] < replicas
            else:  # a percentage: at least two pods to keep one and evict one
                protects = replicas > 1
            f.check(protects, f"{scenario}: PodDisruptionBudget/{name}",
                    f"over {replicas} replica(s) with {spec} it protects nothing or blocks every drain")
    f.check((front is not None) == bool(chart_values["openai"]["enabled"]), scenario,
            f"the OpenAI front is {'not ' if front is None else ''}rendered with openai.enabled "
            f"{chart_values['openai']['enabled']}")
    check_model(scenario, chart_values, tomls, f)
    return {"pods": pods, "tomls": tomls, "by_kind": by_kind, "front": front}


def gpu_of(template: dict[str, Any], kind: str = "requests") -> Any:
    return template["spec"]["containers"][0].get("resources", {}).get(kind, {}).get("nvidia.com/gpu")


def expect(f: Failures, scenario: str, checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        f.check(ok, scenario, message)


def check_front(where: str, v: dict[str, Any], template: dict[str, Any], services: dict[str, Any],
                f: Failures) -> None:
    """The OpenAI front's pod: its command and flags, the coordinator Service it dials, the model's
    folder, HTTP probes on its port (HTTPS with TLS), TLS and its token as the values ask."""
    spec = template["spec"]
    (container,) = spec["containers"]
    args = container["args"]
    tls, auth, o = v["tls"], v["auth"], v["openai"]
    f.check(container["command"] == FRONT_COMMAND, where, f"command {container['command']} is not {FRONT_COMMAND}")
    f.check(container["image"].endswith(":" + (v["image"]["tag"] or APP_VERSION) + v["image"]["openaiTagSuffix"]),
            where, f"image {container['image']} is not the front's (tag + openaiTagSuffix)")
    unknown = [a for a in args if not a.startswith("--") or flag_name(a) not in FRONT_FLAGS]
    f.check(not unknown, where, f"arguments python -m dsa_openai does not have: {unknown}")
    coordinator = f"{RELEASE}-dsa-indexer-coordinator"
    grpc_port = [p["port"] for p in services.get(coordinator, {}).get("spec", {}).get("ports", []) if p["name"] == "grpc"]
    f.check(flag_values(args, "coordinator") == [f"{coordinator}.{NAMESPACE}.svc.cluster.local:{grpc_port[0] if grpc_port else '?'}"],
            where, f"--coordinator {flag_values(args, 'coordinator')} is not the coordinator Service's grpc port")
    f.check(flag_values(args, "model-dir") == [v["model"]["dir"]], where, "--model-dir must be model.dir")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    f.check(ports == {"http": o["port"]} and flag_values(args, "listen") == [f"0.0.0.0:{o['port']}"], where,
            f"the front must listen on its one port http ({o['port']}): ports {ports}, --listen {flag_values(args, 'listen')}")
    scheme = "HTTPS" if tls["enabled"] else "HTTP"
    for probe in ("startupProbe", "readinessProbe"):
        f.check(container.get(probe, {}).get("httpGet") == {"path": "/health", "port": "http", "scheme": scheme},
                where, f"{probe} must GET /health on port http over {scheme}, is {container.get(probe)}")
    f.check(container.get("livenessProbe", {}).get("tcpSocket") == {"port": "http"}, where,
            "livenessProbe must be the port's TCP check (a coordinator that is down must not restart the front)")
    grace, drain = flag_values(args, "shutdown-grace-s"), flag_values(args, "drain-delay-s")
    f.check(len(grace) == 1 and len(drain) == 1 and
            spec.get("terminationGracePeriodSeconds", 30) >= float(drain[0]) + float(grace[0]) + 1, where,
            f"terminationGracePeriodSeconds {spec.get('terminationGracePeriodSeconds')} must cover "
            f"--drain-delay-s {drain} and --shutdown-grace-s {grace} plus a second")
    startup = container.get("startupProbe", {})
    f.check(flag_values(args, "startup-timeout-s") ==
            [str(startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3))], where,
            f"--startup-timeout-s {flag_values(args, 'startup-timeout-s')} must be the startup probe's "
            "whole budget (periodSeconds x failureThreshold)")
    psc, csc = spec.get("securityContext", {}), container.get("securityContext", {})
    f.check(psc.get("runAsNonRoot") is True and psc.get("runAsUser") == 10001 and spec.get("enableServiceLinks") is False,
            where, "the front's pod must be non-root uid 10001 without service links")
    f.check(csc.get("readOnlyRootFilesystem") is True and csc.get("allowPrivilegeEscalation") is False and
            csc.get("capabilities", {}).get("drop") == ["ALL"] and not csc.get("capabilities", {}).get("add"), where,
            f"the front's container must drop ALL, read-only root, no escalation; is {csc}")
    want = set()
    if tls["enabled"]:
        want |= {"tls-cert", "tls-key", "coordinator-ca"} | ({"coordinator-cert", "coordinator-key"} if tls["mutual"] else set())
    if auth["tokensSecret"]:
        want.add("startup-token-file")
    present = {flag_name(a) for a in args} & {"tls-cert", "tls-key", "coordinator-ca", "coordinator-cert",
                                               "coordinator-key", "startup-token-file", "coordinator-server-name"}
    f.check(present == want, where, f"TLS / token flags {sorted(present)}, expected {sorted(want)}")
    for flag in ("tls-cert", "tls-key", "coordinator-ca", "coordinator-cert", "coordinator-key", "startup-token-file"):
        for path in flag_values(args, flag):
            source = mounted_file(spec, container, path)
            expected = ((auth["tokensSecret"], o["healthTokenKey"]) if flag == "startup-token-file"
                        else (o["tlsSecretName"] or tls["secretName"], {"coordinator-ca": "ca.crt", "coordinator-cert": "tls.crt",
                                                  "coordinator-key": "tls.key"}.get(flag, os.path.basename(path))))
            f.check(source == ("secret", *expected), where,
                    f"--{flag}={path} must be the key {expected[1]} of the Secret {expected[0]}, is {source}")
    f.check("tokens" not in secrets_of(spec).get(auth["tokensSecret"], set()) and
            "*" not in secrets_of(spec).get(auth["tokensSecret"], set()), where,
            "the front must not mount the coordinator's tokens file")


def check_model(scenario: str, v: dict[str, Any], tomls: dict[str, dict[str, Any]], f: Failures) -> None:
    """model.name smollm2: the indexers serve the trained indexers' shape (their weights' metadata),
    the coordinator selects dsa up's top-K for the model (tools/dsa/cluster.h), the attention
    workers load the model's files where the images put them (deploy/docker)."""
    if v["model"]["name"] != "smollm2":
        f.check(not any(k in tomls.get("attention", {}) for k in ("model", "model-file", "indexer-weights")),
                scenario, "model.name pattern: the attention workers must not get the real model's flags")
        return
    where = f"{scenario}: model smollm2"
    if "indexer" in tomls:
        f.check((tomls["indexer"].get("num-heads"), tomls["indexer"].get("head-dim")) == INDEXER_SHAPE, where,
                f"the indexers' H, D are {tomls['indexer'].get('num-heads')}, {tomls['indexer'].get('head-dim')}; "
                f"the weights' are {INDEXER_SHAPE}")
    top_k = v["coordinator"]["config"].get("top-k", SMOLLM2_TOP_K)
    f.check(tomls.get("coordinator", {}).get("top-k") == top_k, where,
            f"the coordinator's top-k is {tomls.get('coordinator', {}).get('top-k')}: its config's, else dsa "
            f"up's {SMOLLM2_TOP_K}")
    attention = tomls.get("attention", {})
    f.check(attention.get("model") == "smollm2" and
            attention.get("model-file") == v["model"]["dir"] + "/model.safetensors" and
            attention.get("indexer-weights") == v["model"]["indexerWeights"], where,
            f"the attention workers' model flags are {attention}")


def model_constants() -> tuple[tuple[int, int], int, list[str]]:
    """(H, D) of the trained indexers' weights, dsa up's top-K for smollm2, and what the images and
    the chart's defaults disagree on (empty when they agree)."""
    with open(os.path.join(REPO, "data", "models", "smollm2_indexer.safetensors"), "rb") as weights:
        (size,) = struct.unpack("<Q", weights.read(8))
        metadata = json.loads(weights.read(size))["__metadata__"]
    with open(os.path.join(REPO, "tools", "dsa", "cluster.h"), encoding="utf-8") as header:
        top_k = int(re.search(r"kSmolLM2TopK = (\d+);", header.read()).group(1))
    with open(os.path.join(CHART, "values.yaml"), encoding="utf-8") as values:
        model = yaml.safe_load(values)["model"]
    disagree = []
    root = os.path.dirname(model["indexerWeights"])
    if os.path.dirname(model["dir"]) != root:
        disagree.append(f"model.dir {model['dir']} and model.indexerWeights {model['indexerWeights']} "
                        "are not in one folder, as the images put them")
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        with open(os.path.join(REPO, "deploy", "docker", dockerfile), encoding="utf-8") as d:
            text = d.read()
        wants = [f"COPY --from=model /out/ {root}/",  # the model stage's /out, whole
                 "DSA_MODEL_DIR=/out/" + os.path.basename(model["dir"]),  # model.dir's folder
                 f"COPY data/models/{os.path.basename(model['indexerWeights'])} /out/"]
        if dockerfile == "Dockerfile":  # the front's tokenizer.json, in model.dir
            wants.append(f"COPY --from=model /out/{os.path.basename(model['dir'])}/tokenizer.json "
                         f"{model['dir']}/")
        for want in wants:
            if want not in text:
                disagree.append(f"{dockerfile} lacks `{want}`: the image's model is not where "
                                "model.dir and model.indexerWeights say")
    return (int(metadata["num_heads"]), int(metadata["head_dim"])), top_k, disagree


INDEXER_SHAPE, SMOLLM2_TOP_K, MODEL_PLACES = model_constants()


def promises_default(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods, kinds = r["pods"], r["by_kind"]
    args = pods["coordinator"]["spec"]["containers"][0]["args"]
    return [
        (all(gpu_of(t) is None for t in pods.values()), "the default requests no GPU"),
        (any(a.startswith("--indexer-dns=") for a in args), "the default discovers indexers by DNS"),
        (not any(k in kinds for k in CRD_KINDS), "monitoring objects must be off by default"),
        (set(pods) == {"coordinator", "indexer", "attention"}, f"components rendered: {sorted(pods)}"),
        (r["front"] is not None, "the default renders the OpenAI front"),
        (r["tomls"]["attention"].get("model") == "smollm2", "the default serves the real model"),
    ]


def promises_cpu_only(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods, tomls = r["pods"], r["tomls"]
    images = [t["spec"]["containers"][0]["image"] for t in pods.values()]
    return [
        (all(gpu_of(t) is None for t in pods.values()), "cpu-only must request no GPU"),
        (tomls["indexer"].get("device") == "cpu" and tomls["attention"].get("attention-device") == "cpu",
         "cpu-only: indexer device and attention-device must be cpu"),
        (not any(i.endswith("-cuda") for i in images), f"cpu-only must use the cpu image, uses {images}"),
    ]


def rules_with_runbooks(runbook_url: str, thresholds: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """files/prometheus-rules.yaml's groups as the chart renders them: each alert's runbook_url
    (docs/deploy.md#anchor in the file) is runbook_url + "#anchor", or gone when it is empty; the
    two thresholds the values set replace the file's 0.25 and 0.005."""
    groups = load_yaml(os.path.join(CHART, "files", "prometheus-rules.yaml"))["groups"]
    thresholds = thresholds or {"auditedMissRatio": 0.25, "selectionWaitSeconds": 0.005}
    for group in groups:
        for rule in group["rules"]:
            if rule.get("record") == "dsa:indexer_miss_target_ratio:effective":
                rule["expr"] = rule["expr"].replace("+ 0.25", f"+ {thresholds['auditedMissRatio']}")
            if rule.get("alert") == "DsaAttentionSelectionWaitOverBudget":
                rule["expr"] = rule["expr"].replace("> 0.005", f"> {thresholds['selectionWaitSeconds']}")
            annotations = rule.get("annotations", {})
            if "runbook_url" in annotations:
                anchor = annotations["runbook_url"][annotations["runbook_url"].index("#"):]
                if runbook_url:
                    annotations["runbook_url"] = runbook_url + anchor
                else:
                    del annotations["runbook_url"]
    return groups


def promises_gpu(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods, tomls, kinds = r["pods"], r["tomls"], r["by_kind"]
    dashboards = [c for n, c in kinds.get("ConfigMap", {}).items() if n.endswith("-dashboards")]
    checks = [
        (gpu_of(pods[c]) == 1 and gpu_of(pods[c], "limits") == 1,
         f"{c} must request and limit nvidia.com/gpu: 1, has {gpu_of(pods[c])} / {gpu_of(pods[c], 'limits')}")
        for c in ("indexer", "attention")
    ] + [
        (gpu_of(pods["coordinator"]) is None, "the coordinator must not request a GPU"),
        (tomls["indexer"].get("device") == "cuda", "the indexer must run with --device cuda"),
        (tomls["attention"].get("attention-device") == "cuda", "attention must run with --attention-device cuda"),
        (all(pods[c]["spec"]["containers"][0]["image"].endswith("-cuda") for c in ("indexer", "attention")),
         "GPU workers must use the cuda image"),
        (all(pods[c]["spec"].get("runtimeClassName") == "nvidia" for c in ("indexer", "attention")),
         "GPU workers must run with runtimeClassName nvidia"),
        ("PrometheusRule" in kinds and list(kinds["PrometheusRule"].values())[0]["spec"]["groups"]
         == rules_with_runbooks(*[load_yaml(os.path.join(
             CHART, "examples", "gpu-one-per-worker.yaml"))["monitoring"]["prometheusRule"][k]
             for k in ("runbookUrl", "thresholds")]),
         "the GPU example's PrometheusRule must hold files/prometheus-rules.yaml's groups, each "
         "runbook_url the example's runbookUrl plus the alert's anchor"),
        (len(dashboards) == 1 and dashboards[0]["metadata"]["labels"].get("grafana_dashboard") == "1",
         "the GPU example renders one dashboards ConfigMap labelled grafana_dashboard: \"1\""),
    ] + scrape_checks(r, "PodMonitor")
    for cm in dashboards:
        for key, text in cm.get("data", {}).items():
            try:
                ok = key.endswith(".json") and "title" in json.loads(text)
            except json.JSONDecodeError:
                ok = False
            checks.append((ok, f"dashboard {key} must be JSON with a title"))
        files = {os.path.basename(p) for p in glob.glob(os.path.join(CHART, "files", "dashboards", "*.json"))}
        size = sum(len(v.encode()) for v in cm.get("data", {}).values())
        checks.append((size < 1_000_000, f"dashboards ConfigMap is {size} bytes; a ConfigMap holds 1 MiB"))
        checks.append((set(cm.get("data", {})) == files, f"dashboards ConfigMap must hold every "
                       f"files/dashboards/*.json: has {sorted(cm.get('data', {}))}, files {sorted(files)}"))
    return checks


def scrape_checks(r: dict[str, Any], kind: str) -> list[tuple[bool, str]]:
    """A PodMonitor / ServiceMonitor of kind `kind` scraping `metrics`, job = <fullname>-<component>."""
    monitors = list(r["by_kind"].get(kind, {}).values())
    if not monitors:
        return [(False, f"no {kind} rendered")]
    spec = monitors[0]["spec"]
    (endpoint,) = spec.get("podMetricsEndpoints" if kind == "PodMonitor" else "endpoints", [{}])
    relabel = [x for x in endpoint.get("relabelings", []) if x.get("targetLabel") == "job"]
    return [(endpoint.get("port") == "metrics", f"the {kind} must scrape the metrics port"),
            (len(relabel) == 1 and relabel[0].get("replacement") == f"{RELEASE}-dsa-indexer-$1",
             f"the {kind} must set job to <fullname>-<component>: {relabel}")]


def promises_rdma(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods, tomls, kinds = r["pods"], r["tomls"], r["by_kind"]
    checks = [(tomls["attention"].get("transport") == "nccl", "the RDMA example must use --transport nccl"),
              (tomls["indexer"].get("device") == "cuda", "NCCL needs the indexer on its GPU")]
    for c in ("indexer", "attention"):
        container = pods[c]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        checks += [
            ("IPC_LOCK" in container["securityContext"].get("capabilities", {}).get("add", []),
             f"{c} must have the IPC_LOCK capability"),
            (container["resources"]["limits"].get("rdma/rdma_shared_device_a") == 1,
             f"{c} must request the RDMA device rdma/rdma_shared_device_a"),
            (gpu_of(pods[c]) == 1, f"{c} must request one GPU"),
            (env.get("NCCL_NVLS_ENABLE") == "0" and "NCCL_IB_HCA" in env and "NCCL_SOCKET_IFNAME" in env,
             f"{c} must have NCCL_NVLS_ENABLE=0, NCCL_IB_HCA and NCCL_SOCKET_IFNAME, has {sorted(env)}"),
        ]
    coordinator_caps = pods["coordinator"]["spec"]["containers"][0]["securityContext"]["capabilities"]
    checks += [
        ("add" not in coordinator_caps, "the coordinator must not get RDMA capabilities"),
        ("podAntiAffinity" in pods["attention"]["spec"].get("affinity", {}),
         "the RDMA example keeps attention workers off the indexers' nodes"),
    ] + scrape_checks(r, "ServiceMonitor")
    return checks


def promises_colocated(r: dict[str, Any]) -> list[tuple[bool, str]]:
    return [("indexer" not in r["pods"], "transport inprocess must render no indexer StatefulSet"),
            (r["tomls"]["coordinator"].get("colocated") is True, "inprocess: the coordinator runs --colocated")]


def promises_host_network(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods = r["pods"]
    return [(pods[c]["spec"].get("hostNetwork") is True and
             pods[c]["spec"].get("dnsPolicy") == "ClusterFirstWithHostNet", f"{c} must use hostNetwork with "
             "dnsPolicy ClusterFirstWithHostNet") for c in ("indexer", "attention")] + [
            (not pods["coordinator"]["spec"].get("hostNetwork"), "the coordinator stays off the host network")]


def promises_routes(r: dict[str, Any]) -> list[tuple[bool, str]]:
    """The GRPCRoute and the Ingress send the coordinator's services, and only those, to its Service's
    gRPC port."""
    kinds = r["by_kind"]
    service = f"{RELEASE}-dsa-indexer-coordinator"
    routes = list(kinds.get("GRPCRoute", {}).values())
    ingresses = list(kinds.get("Ingress", {}).values())
    checks = [(len(routes) == 1 and len(ingresses) == 1, "one GRPCRoute and one Ingress")]
    if not checks[0][0]:
        return checks
    (rule,) = routes[0]["spec"]["rules"]
    ports = [s["spec"]["ports"] for n, s in kinds["Service"].items() if n == service]
    grpc_port = [p["port"] for p in ports[0] if p["name"] == "grpc"] if ports else []
    checks += [
        (sorted(m["method"]["service"] for m in rule["matches"]) ==
         ["dsa.coordinator.v1.CoordinatorService", "grpc.health.v1.Health"],
         "the GRPCRoute matches CoordinatorService and grpc.health.v1 only"),
        ([(b["name"], b["port"]) for b in rule["backendRefs"]] == [(service, grpc_port[0] if grpc_port else None)],
         f"the GRPCRoute's backend is {service}'s grpc port"),
        (all(p["backend"]["service"]["name"] == service and p["backend"]["service"]["port"] == {"name": "grpc"}
             for rule in ingresses[0]["spec"]["rules"] for p in rule["http"]["paths"]),
         "every Ingress path goes to the coordinator's grpc port"),
    ]
    return checks


def promises_front_routes(r: dict[str, Any]) -> list[tuple[bool, str]]:
    """The HTTPRoute and the Ingress send /v1 and /health, and only those, to the OpenAI front's port."""
    kinds = r["by_kind"]
    service = f"{RELEASE}-dsa-indexer-openai"
    routes = list(kinds.get("HTTPRoute", {}).values())
    ingresses = [i for i in kinds.get("Ingress", {}).values() if i["metadata"]["name"] == service]
    checks = [(len(routes) == 1 and len(ingresses) == 1, "one HTTPRoute and one Ingress to the front")]
    if not checks[0][0]:
        return checks
    (rule,) = routes[0]["spec"]["rules"]
    port = [p["port"] for p in kinds["Service"][service]["spec"]["ports"] if p["name"] == "http"]
    paths = [(p["path"], p["pathType"]) for rule_ in ingresses[0]["spec"]["rules"] for p in rule_["http"]["paths"]]
    return checks + [
        (sorted((m["path"]["type"], m["path"]["value"]) for m in rule["matches"]) ==
         [("Exact", "/health"), ("PathPrefix", "/v1")], "the HTTPRoute matches /v1 and /health only"),
        ([(b["name"], b["port"]) for b in rule["backendRefs"]] == [(service, port[0] if port else None)],
         f"the HTTPRoute's backend is {service}'s http port"),
        (sorted(paths) == [("/health", "Exact"), ("/v1", "Prefix")] and
         all(p["backend"]["service"] == {"name": service, "port": {"name": "http"}}
             for rule_ in ingresses[0]["spec"]["rules"] for p in rule_["http"]["paths"]),
         f"the Ingress sends /v1 and /health to the front's http port: {paths}"),
    ]


def promises_front_tokens(r: dict[str, Any]) -> list[tuple[bool, str]]:
    """mutual-tls-tokens: the front serves HTTPS, dials the coordinator with its certificate and
    presents openai.healthTokenKey's token."""
    args = args_of(r["front"])
    return [(flag_values(args, "startup-token-file") == ["/etc/dsa-auth/token"] and
             flag_values(args, "coordinator-cert") == ["/etc/dsa-tls/tls.crt"] and
             flag_values(args, "tls-cert") == ["/etc/dsa-tls/tls.crt"] and
             tls_secret_of(r["front"]) == "dsa-openai-tls",
             f"the front: HTTPS with its own certificate dsa-openai-tls, as the coordinator's client "
             f"too, and its own token: {args}, {tls_secret_of(r['front'])}")]


def promises_autoscaling(r: dict[str, Any], kind: str) -> list[tuple[bool, str]]:
    """An autoscaler per component on its own workload and series, and workloads without replicas."""
    scalers = r["by_kind"].get(kind, {})
    workloads = {**r["by_kind"].get("Deployment", {}), **r["by_kind"].get("StatefulSet", {})}
    checks = [(len(scalers) == 3, f"three {kind}s, has {sorted(scalers)}")]
    series = {"coordinator": "dsa_coordinator_queued_requests", "indexer": "dsa_indexer_cache_blocks",
              "attention": "dsa_attention_kv_slots"}
    for name, scaler in scalers.items():
        target = scaler["spec"]["scaleTargetRef"]["name"]
        component = target.rsplit("-", 1)[-1]
        checks.append((target in workloads and "replicas" not in workloads[target]["spec"],
                       f"{name} must scale a rendered workload that sets no replicas: {target}"))
        if kind == "ScaledObject":
            query = scaler["spec"]["triggers"][0]["metadata"]["query"]
            low, high = scaler["spec"]["minReplicaCount"], scaler["spec"]["maxReplicaCount"]
        else:
            query = scaler["metadata"]["annotations"]["dsa-indexer/metric-query"]
            low, high = scaler["spec"]["minReplicas"], scaler["spec"]["maxReplicas"]
        checks.append((series.get(component, "?") in query and f'job="{RELEASE}-dsa-indexer-{component}"' in query,
                       f"{name} must query its own component's series: {query}"))
        checks.append((1 <= low <= high, f"{name}: replicas {low}..{high}"))
    return checks


ROUTERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
HTTP_CLIENTS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]


def promises_network_policy(r: dict[str, Any], nccl: bool) -> list[tuple[bool, str]]:
    """One NetworkPolicy per component: gRPC from the parts that call it (routers for the
    coordinator), metrics from `monitoring`, NCCL between the workers only with that transport."""
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p["spec"]
                for p in r["by_kind"].get("NetworkPolicy", {}).values()}
    checks = [(set(policies) == {"coordinator", "indexer", "attention", "openai"},
               f"a NetworkPolicy per component and the OpenAI front, has {sorted(policies)}")]
    if not checks[0][0]:
        return checks

    def sources(spec, port):
        rules = [rule for rule in spec["ingress"] if [p.get("port") for p in rule.get("ports", [])] == [port]]
        return rules[0].get("from") if len(rules) == 1 else "missing"

    def components(peers):
        return sorted(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component", "?")
                      for p in peers)

    checks += [
        (sources(policies["coordinator"], "grpc")[:len(ROUTERS)] == ROUTERS and
         components(sources(policies["coordinator"], "grpc")[len(ROUTERS):]) == ["openai", "test"],
         f"the coordinator's gRPC must admit the routers, the OpenAI front and the test pods only: "
         f"{sources(policies['coordinator'], 'grpc')}"),
        (sources(policies["openai"], "http") == HTTP_CLIENTS,
         f"the OpenAI front's port must admit `httpClients` only: {sources(policies['openai'], 'http')}"),
        (components(sources(policies["indexer"], "grpc")) == ["attention", "coordinator", "test"],
         f"the indexers' gRPC must admit the coordinator, the attention workers and the test pods: "
         f"{sources(policies['indexer'], 'grpc')}"),
        (components(sources(policies["attention"], "grpc")) == ["coordinator", "test"],
         "the attention workers' gRPC must admit the coordinator and the test pods"),
    ]
    for component, spec in policies.items():
        if component == "openai":
            continue  # no metrics port
        checks.append((sources(spec, "metrics") == MONITORING, f"{component}'s metrics must admit `monitoring` only"))
        all_ports = [rule for rule in spec["ingress"] if "ports" not in rule]
        other = {"indexer": "attention", "attention": "indexer"}.get(component)
        want = [[other]] if nccl and other else []
        checks.append(([components(rule["from"]) for rule in all_ports] == want,
                       f"{component}: every-port ingress must be {want} (NCCL between the workers)"))
    return checks


def promises_static(r: dict[str, Any]) -> list[tuple[bool, str]]:
    args = r["pods"]["coordinator"]["spec"]["containers"][0]["args"]
    return [(len(flag_values(args, "indexer")) == 3 and len(flag_values(args, "attention")) == 2,
             f"static discovery: one --indexer per indexer pod (3) and --attention per attention pod (2): {args}")]


def args_of(template: dict[str, Any]) -> list[str]:
    return template["spec"]["containers"][0]["args"]


def tls_secret_of(template: dict[str, Any]) -> str | None:
    """The Secret of a pod's tls volume (None without one)."""
    return next((v["secret"]["secretName"] for v in template["spec"].get("volumes", []) if v["name"] == "tls"), None)


def test_pods(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """helm test pods by target: coordinator, indexer-0, attention-0."""
    return {n.removeprefix(f"{RELEASE}-dsa-indexer-test-"): p for n, p in r["by_kind"].get("Pod", {}).items()}


def promises_tls(r: dict[str, Any], mutual: bool, server_name: str) -> list[tuple[bool, str]]:
    """TLS on in every server and test pod, with or without client certificates."""
    pods, tests = r["pods"], test_pods(r)
    checks = [(len(flag_values(args_of(t), "tls-cert")) == 1 and
               bool(flag_values(args_of(t), "tls-client-ca")) == mutual and
               [p for p in t["spec"]["containers"][0]["ports"] if p["name"] == "health"] != [],
               f"{c}: TLS{' and client certificates' if mutual else ' without client certificates'}, "
               f"a health port: {args_of(t)}") for c, t in pods.items()]
    checks += [(flag_values(args_of(pods[c]), "tls-server-name") == ([server_name] if server_name else []),
                f"{c} must check {server_name or 'the dialed name'} in the workers' certificates")
               for c in ("coordinator", "attention")]
    checks += [(bool(flag_values(args_of(p), "tls-ca")) and bool(flag_values(args_of(p), "tls-cert")) == mutual,
                f"test pod {n}: --tls-ca{' and a client certificate' if mutual else ' only'}")
               for n, p in tests.items()]
    return checks + [(len(tests) == 3, f"three helm test pods, found {sorted(tests)}")]


def promises_mutual_tls_tokens(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods, tests = r["pods"], test_pods(r)
    coordinator = pods["coordinator"]
    tokens = [v for v in coordinator["spec"]["volumes"] if v.get("secret", {}).get("secretName") == "dsa-tokens"]
    return promises_tls(r, True, "dsa-workers.internal") + [
        (tls_secret_of(pods[c]) == f"dsa-{c}-tls", f"{c} must mount its own certificate dsa-{c}-tls, "
         f"mounts {tls_secret_of(pods[c])}") for c in ("coordinator", "indexer", "attention")] + [
        (all(tls_secret_of(p) == "dsa-test-client-tls" for p in tests.values()),
         "the helm test pods present tls.secretName's certificate"),
        (len(tokens) == 1 and tokens[0]["secret"]["items"] == [{"key": "tokens", "path": "tokens"}] and
         flag_values(args_of(coordinator), "auth-tokens-file") == ["/etc/dsa-auth/tokens"],
         "the coordinator mounts dsa-tokens' key tokens and passes it as --auth-tokens-file"),
        (flag_values(args_of(tests["coordinator"]), "token-file") != [] and
         not any(flag_values(args_of(tests[n]), "token-file") for n in ("indexer-0", "attention-0")),
         "only the coordinator's test pod presents a token"),
        (flag_values(args_of(pods["indexer"]), "operator-identities") == ["dsa-coordinator"],
         "the indexers take the coordinator's identity as an operator"),
        (flag_values(args_of(pods["attention"]), "indexer-dns") ==
         flag_values(args_of(coordinator), "indexer-dns") != [],
         "the attention workers allow the coordinator's indexer Service"),
    ]


def promises_per_component_colocated(r: dict[str, Any]) -> list[tuple[bool, str]]:
    pods = r["pods"]
    return promises_tls(r, True, "")[:-1] + [
        ("indexer" not in pods, "transport inprocess must render no indexer StatefulSet"),
        (tls_secret_of(pods["coordinator"]) == "dsa-coordinator-tls" and
         tls_secret_of(pods["attention"]) == "dsa-attention-tls",
         "coordinator and attention mount their own Secrets"),
        (all(tls_secret_of(p) == "dsa-tls" for p in test_pods(r).values()), "test pods mount tls.secretName"),
        (flag_values(args_of(pods["attention"]), "indexer-workers") ==
         flag_values(args_of(pods["coordinator"]), "attention") != [],
         "co-located: the allow-list is the attention pods, as the coordinator's --indexer"),
    ]


def load_yaml(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


# (scenario, values, promises): the renders that must succeed.
GOOD: list[tuple[str, Callable[[], dict[str, Any] | None], Callable[[dict[str, Any]], list]]] = [
    ("default values", lambda: None, promises_default),
    ("examples/cpu-only.yaml", lambda: load_yaml(os.path.join(CHART, "examples", "cpu-only.yaml")),
     promises_cpu_only),
    ("examples/gpu-one-per-worker.yaml",
     lambda: load_yaml(os.path.join(CHART, "examples", "gpu-one-per-worker.yaml")), promises_gpu),
    ("examples/multi-node-rdma.yaml",
     lambda: load_yaml(os.path.join(CHART, "examples", "multi-node-rdma.yaml")), promises_rdma),
    ("co-located (attention.transport inprocess)",
     lambda: {"attention": {"transport": "inprocess", "replicas": 3}, "monitoring": {"dashboards": {"enabled": True}}},
     promises_colocated),
    ("RDMA over hostNetwork",
     lambda: {"image": {"variant": "cuda"}, "rdma": {"enabled": True, "hostNetwork": True},
              "indexer": {"device": "cuda", "gpu": 1, "podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}},
              "attention": {"device": "cuda", "gpu": 2, "transport": "nccl"}},
     promises_host_network),
    ("examples/autoscaling-keda.yaml",
     lambda: load_yaml(os.path.join(CHART, "examples", "autoscaling-keda.yaml")),
     lambda r: promises_autoscaling(r, "ScaledObject") + promises_network_policy(r, nccl=False)
     + scrape_checks(r, "PodMonitor")),
    ("routes: a GRPCRoute and an Ingress",
     lambda: {"routes": {"grpcRoute": {"enabled": True, "hostnames": ["dsa.example.com"],
                                       "parentRefs": [{"name": "edge", "namespace": "gateway"}]},
                         "ingress": {"enabled": True, "className": "nginx", "host": "dsa.example.com",
                                     "annotations": {"nginx.ingress.kubernetes.io/backend-protocol": "GRPC"},
                                     "tls": [{"hosts": ["dsa.example.com"], "secretName": "dsa-ingress-tls"}]}}},
     promises_routes),
    ("routes to the OpenAI front: an HTTPRoute and an Ingress",
     lambda: {"routes": {"httpRoute": {"enabled": True, "hostnames": ["llm.example.com"],
                                       "parentRefs": [{"name": "edge", "namespace": "gateway", "sectionName": "https"}]},
                         "openaiIngress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                                           "tls": [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]}}},
     promises_front_routes),
    ("the pattern model without the front",
     lambda: {"model": {"name": "pattern"}, "openai": {"enabled": False},
              "indexer": {"config": {"num-heads": 8, "head-dim": 32}},
              "attention": {"config": {"num-heads": 8, "head-dim": 32}}},
     lambda r: [(r["front"] is None and "top-k" not in r["tomls"]["coordinator"] and
                 r["tomls"]["indexer"].get("num-heads") == 8, "the pattern model: its own shapes, no front")]),
    ("the real model at the coordinator's own top-K, retention 3",
     lambda: {"coordinator": {"config": {"top-k": 1024}},
              "attention": {"config": {"retention": 3, "num-model-layers": 30}}},
     lambda r: [(r["tomls"]["coordinator"].get("top-k") == 1024, "the coordinator's config sets its top-k")]),
    ("the front over two replicas",
     lambda: {"openai": {"replicas": 2}},
     lambda r: [(any(p["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == "openai"
                     for p in r["by_kind"].get("PodDisruptionBudget", {}).values()),
                 "two front replicas get a PodDisruptionBudget")]),
    ("autoscaling with KEDA",
     lambda: {"autoscaling": {"enabled": True}},
     lambda r: promises_autoscaling(r, "ScaledObject")),
    ("autoscaling with HPAs (prometheus-adapter)",
     lambda: {"autoscaling": {"enabled": True, "kind": "hpa"}},
     lambda r: promises_autoscaling(r, "HorizontalPodAutoscaler")),
    ("network policies",
     lambda: {"networkPolicy": {"enabled": True, "routers": ROUTERS, "monitoring": MONITORING, "httpClients": HTTP_CLIENTS}},
     lambda r: promises_network_policy(r, nccl=False)),
    ("network policies with NCCL between the workers",
     lambda: {"networkPolicy": {"enabled": True, "routers": ROUTERS, "monitoring": MONITORING, "httpClients": HTTP_CLIENTS},
              "image": {"variant": "cuda"}, "indexer": {"device": "cuda", "gpu": 1},
              "attention": {"device": "cuda", "gpu": 1, "transport": "nccl"}},
     lambda r: promises_network_policy(r, nccl=True)),
    ("static discovery",
     lambda: {"coordinator": {"discovery": {"mode": "static", "workerCheckIntervalMs": 1000}},
              "indexer": {"replicas": 3}, "tests": {"enabled": False},
              "monitoring": {"scrape": {"enabled": True, "kind": "ServiceMonitor"}}},
     promises_static),
    ("TLS, mutual, one Secret, DNS discovery",
     lambda: {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "dsa-workers.serving.svc"}},
     lambda r: promises_tls(r, True, "dsa-workers.serving.svc")),
    ("TLS without client certificates, static discovery",
     lambda: {"tls": {"enabled": True, "secretName": "dsa-tls", "mutual": False},
              "coordinator": {"discovery": {"mode": "static", "workerCheckIntervalMs": 1000}},
              "monitoring": {"scrape": {"enabled": True}}},
     lambda r: promises_tls(r, False, "")),
    ("examples/mutual-tls-tokens.yaml",
     lambda: load_yaml(os.path.join(CHART, "examples", "mutual-tls-tokens.yaml")),
     lambda r: promises_mutual_tls_tokens(r) + promises_front_tokens(r)),
    ("TLS, a Secret per component, co-located",
     lambda: {"tls": {"enabled": True, "secretName": "dsa-tls"},
              "coordinator": {"tlsSecretName": "dsa-coordinator-tls"},
              "attention": {"transport": "inprocess", "tlsSecretName": "dsa-attention-tls",
                            "ports": {"grpc": 50053, "metrics": 9403, "health": 8081}}},
     promises_per_component_colocated),
]

# (scenario, values, a fragment the error must contain): values the chart must refuse.
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("negative replicas", {"indexer": {"replicas": -1}}, "at '/indexer/replicas': minimum: got -1, want 0"),
    ("a bad port", {"coordinator": {"ports": {"grpc": 70000, "metrics": 9401}}},
     "at '/coordinator/ports/grpc': maximum"),
    ("an unknown key", {"attention": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ("a bad log level", {"logLevel": "verbose"}, "at '/logLevel': value must be one of 'debug', 'info', 'warn', 'error'"),
    ("a bad transport", {"attention": {"transport": "tcp"}}, "at '/attention/transport': value must be one of"),
    ("a flag the chart sets in config", {"indexer": {"config": {"listen": "0.0.0.0:1"}}}, "invalid propertyName 'listen'"),
    ("a non-NCCL name in nccl.env", {"nccl": {"env": {"LD_PRELOAD": "x"}}}, "invalid propertyName 'LD_PRELOAD'"),
    ("no margin above the drain", {"terminationGraceMarginSeconds": 0},
     "at '/terminationGraceMarginSeconds': minimum: got 0, want 1"),
    ("a bad image pull policy", {"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ("a GRPCRoute without a Gateway", {"routes": {"grpcRoute": {"enabled": True}}},
     "routes.grpcRoute.enabled needs routes.grpcRoute.parentRefs"),
    ("an Ingress without a host", {"routes": {"ingress": {"enabled": True}}},
     "routes.ingress.enabled needs routes.ingress.host"),
    ("autoscaled workers with static discovery",
     {"autoscaling": {"enabled": True}, "coordinator": {"discovery": {"mode": "static"}}},
     "autoscaling.indexer needs coordinator.discovery.mode dns"),
    ("an autoscaling minimum over its maximum",
     {"autoscaling": {"enabled": True, "coordinator": {"enabled": True, "minReplicas": 5, "maxReplicas": 2,
                                                        "queuedPerReplica": 16}}},
     "autoscaling.coordinator.minReplicas (5) is over its maxReplicas (2)"),
    ("a relative runbook URL", {"monitoring": {"prometheusRule": {"enabled": True,
                                                                  "runbookUrl": "docs/deploy.md"}}},
     "at '/monitoring/prometheusRule/runbookUrl'"),
    ("device cuda without a GPU", {"image": {"variant": "cuda"}, "indexer": {"device": "cuda"}},
     "indexer.device is cuda but indexer.gpu is 0: set indexer.gpu to at least 1"),
    ("device cuda on the cpu image", {"attention": {"device": "cuda", "gpu": 1}},
     "attention.device is cuda but its image is the cpu variant"),
    ("nccl with a CPU indexer", {"image": {"variant": "cuda"}, "attention": {"transport": "nccl", "gpu": 1}},
     "attention.transport nccl needs indexer.device cuda"),
    ("RDMA with neither hostNetwork nor a device", {"rdma": {"enabled": True}},
     "rdma.enabled needs rdma.hostNetwork true or an rdma.resourceName"),
    ("TLS without a Secret", {"tls": {"enabled": True}},
     "tls.enabled needs tls.secretName: a Secret of type kubernetes.io/tls with the keys tls.crt, tls.key and ca.crt"),
    ("bearer tokens without TLS", {"auth": {"tokensSecret": "dsa-tokens", "testTokenKey": "helm-test"}},
     "auth.tokensSecret needs tls.enabled: the coordinator refuses bearer tokens over plaintext"),
    ("TLS over DNS discovery without a server name", {"tls": {"enabled": True, "secretName": "dsa-tls"}},
     "tls.enabled with coordinator.discovery.mode dns needs tls.serverName"),
    ("bearer tokens without the test pod's token",
     {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "w.internal"}, "auth": {"tokensSecret": "t"}},
     "auth.tokensSecret with tests.enabled needs auth.testTokenKey"),
    ("a test token without the tokens Secret", {"auth": {"testTokenKey": "helm-test"}},
     "auth.testTokenKey needs auth.tokensSecret"),
    ("operator identities without mutual TLS",
     {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "w.internal", "mutual": False},
      "indexer": {"operatorIdentities": ["dsa-coordinator"]}},
     "indexer.operatorIdentities needs tls.enabled and tls.mutual"),
    ("per-component certificates without the coordinator as an operator",
     {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "w.internal"},
      "coordinator": {"tlsSecretName": "dsa-coordinator-tls"}},
     "the coordinator and the attention workers have certificates of their own"),
    ("a component's Secret without TLS", {"indexer": {"tlsSecretName": "dsa-indexer-tls"}},
     "indexer.tlsSecretName is set but tls.enabled is false"),
    ("the health port on the gRPC port",
     {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "w.internal"},
      "attention": {"ports": {"grpc": 50053, "metrics": 9403, "health": 50053}}},
     "attention.ports.health (50053) must differ from attention.ports.grpc and .metrics"),
    ("an operator identity with a comma", {"indexer": {"operatorIdentities": ["a,b"]}},
     "at '/indexer/operatorIdentities/0'"),
    ("a TLS flag in config", {"coordinator": {"config": {"tls-cert": "/x.pem"}}}, "invalid propertyName 'tls-cert'"),
    ("an unknown tls key", {"tls": {"enable": True}}, "additional properties 'enable' not allowed"),
    ("an unknown model", {"model": {"name": "llama"}}, "at '/model/name': value must be one of"),
    ("a layer pattern of another model", {"attention": {"config": {"layer-pattern": "FSFSFSFS"}}},
     "attention.config.layer-pattern has 8 layers; model.name smollm2 has 30"),
    ("another model's layer count", {"attention": {"config": {"retention": 2, "num-model-layers": 16}}},
     "attention.config.num-model-layers is 16; model.name smollm2 has 30"),
    ("the front on the pattern model", {"model": {"name": "pattern"}},
     "openai.enabled needs model.name smollm2: the pattern model generates no tokens"),
    ("the real model with the indexers' shape in config", {"indexer": {"config": {"num-heads": 64}}},
     "indexer.config sets num-heads, which model.name smollm2 sets from the model"),
    ("the real model with a pattern-model flag", {"attention": {"config": {"seed": 3}}},
     "attention.config sets seed, which model.name smollm2 sets from the model"),
    ("tokens without the front's token",
     {"tls": {"enabled": True, "secretName": "dsa-tls", "serverName": "w.internal"},
      "auth": {"tokensSecret": "t", "testTokenKey": "helm-test"}},
     "auth.tokensSecret with openai.enabled needs openai.healthTokenKey"),
    ("the front's token without the tokens Secret", {"openai": {"healthTokenKey": "front"}},
     "openai.healthTokenKey needs auth.tokensSecret"),
    ("an HTTPRoute without a Gateway", {"routes": {"httpRoute": {"enabled": True}}},
     "routes.httpRoute.enabled needs routes.httpRoute.parentRefs"),
    ("an HTTPRoute without the front", {"openai": {"enabled": False},
                                        "routes": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "g"}]}}},
     "routes.httpRoute and routes.openaiIngress route to the OpenAI front: they need openai.enabled"),
    ("a front Ingress without a host", {"routes": {"openaiIngress": {"enabled": True}}},
     "routes.openaiIngress.enabled needs routes.openaiIngress.host"),
]


def main() -> int:
    helm.disable_logging()  # the library's own log lines; failures come back as exceptions
    f = Failures()
    lines = []
    with helm.Chart.load(CHART) as chart:
        # values.schema.json is itself a valid 2020-12 schema.
        run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "check-jsonschema"),
                              "--check-metaschema", os.path.join(CHART, "values.schema.json")],
                             capture_output=True, text=True, check=False)
        f.check(run.returncode == 0, "values.schema.json", (run.stdout + run.stderr).strip())
        generated = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "values_schema.py")],
                                   capture_output=True, text=True, check=False).stdout
        with open(os.path.join(CHART, "values.schema.json"), encoding="utf-8") as committed:
            f.check(generated == committed.read(), "values.schema.json",
                    "differs from helm/tests/values_schema.py's output: run python3 helm/tests/values_schema.py "
                    "> helm/dsa-indexer/values.schema.json")
        # The image tag (appVersion by default) is the release the binaries report: VERSION.
        with open(os.path.join(CHART, "..", "..", "VERSION"), encoding="utf-8") as version_file:
            release = version_file.read().strip()
        app_version = str(load_yaml(os.path.join(CHART, "Chart.yaml"))["appVersion"])
        f.check(app_version == release, "Chart.yaml",
                f"appVersion {app_version} is not the release in VERSION ({release}), which "
                "--version and dsa_build_info report")
        for message in MODEL_PLACES:
            f.check(False, "deploy/docker", message)
        examples = sorted(glob.glob(os.path.join(CHART, "examples", "*.yaml")))
        covered = {s for s, _, _ in GOOD}
        for path in examples:
            f.check(f"examples/{os.path.basename(path)}" in covered, path, "an example no scenario checks")

        for scenario, values_of, promises in GOOD:
            values = values_of()
            before = len(f.messages)
            lint = helm.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
            for m in lint["messages"]:
                f.check(m["severity"] < 2, f"{scenario}: helm lint", f"{m['path']}: {m['error']}")
            for e in lint["errors"]:
                f.check(False, f"{scenario}: helm lint", e)
            try:
                manifests = render(chart, values)
            except helm.HelmError as e:
                f.check(False, scenario, f"the chart does not render: {e}")
                lines.append(f"FAIL {scenario}: does not render")
                continue
            objs = objects_of(manifests)
            validate_objects(scenario, objs, f)
            try:
                rendered = check_invariants(scenario, values or {}, objs, f)
                for ok, message in promises(rendered):
                    f.check(ok, scenario, message)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                f.check(False, scenario, f"rendered objects lack what the checks read: {e!r}")
            kinds: dict[str, int] = {}
            for _, obj in objs:
                kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
            status = "ok  " if len(f.messages) == before else "FAIL"
            lines.append(f"{status} {scenario}: {len(objs)} objects ("
                         + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")")

        for scenario, values, fragment in BAD:
            before = len(f.messages)
            try:
                render(chart, values)
                f.check(False, f"bad values, {scenario}", f"rendered; the chart must refuse {values}")
            except helm.HelmError as e:
                message = " ".join(str(e).split())
                f.check(fragment in message, f"bad values, {scenario}",
                        f"refused, but the message lacks {fragment!r}: {message}")
            status = "ok  " if len(f.messages) == before else "FAIL"
            lines.append(f"{status} refuses {scenario}")

    print("\n".join(lines))
    if f.messages:
        print(f"\nrender_and_validate: {len(f.messages)} of {f.checks} checks failed:", file=sys.stderr)
        for m in f.messages:
            print(f"  - {m}", file=sys.stderr)
        return 1
    print(f"render_and_validate: all {f.checks} checks passed "
          f"(Kubernetes {KUBE_VERSION} strict, Prometheus Operator CRD schemas)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
