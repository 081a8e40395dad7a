#!/usr/bin/python3
"""Policy checks of rendered k8s/ manifests, for tests/k8s_manifests_test.sh.

  check_manifests.py --repo ROOT --json-dir DIR CASE=rendered.yaml [CASE=rendered.yaml ...]

For each case it parses the `kubectl kustomize` output, writes DIR/CASE.json (a JSON array of the
objects, for validate.py) and checks what the API schemas cannot express:

- every container: the restrictive securityContext (non-root uid 10001, read-only root
  filesystem with an emptyDir /tmp, no privilege escalation, capabilities dropped (only IPC_LOCK
  may be added), seccomp RuntimeDefault), cpu and memory requests and limits, the bearer token;
  a trainer pool worker that runs torch jobs' scripts as users of their own (--script_user) is
  the one exception: root with SETUID, SETGID, KILL and CHOWN;
- the controller and optimizer servers: gRPC readiness and liveness probes on their gRPC port;
  trainer workers: tcpSocket or httpGet probes;
- pods with an optimizer server are Guaranteed QoS, with --memory_limit_mib below the limit;
- the optimizer StatefulSet: headless Service, Parallel, POD_NAME, --advertise, a PDB;
- the trainer Job is Indexed (completions == parallelism), requests nvidia.com/gpu, passes
  $(JOB_COMPLETION_INDEX) as --worker_index, and has a memory-backed /dev/shm (every /dev/shm
  is a Memory emptyDir with a sizeLimit), shared with an optimizer server in the same pod;
- PodMonitors / ServiceMonitors: the Prometheus `job` label of each endpoint is a scrape job of
  docs/METRICS.md, the port it names exists on the selected pods (services) with the number
  METRICS.md gives, and every job of METRICS.md (bar dcgm-exporter) is scraped;
- the PrometheusRules' groups equal those of monitoring/prometheus/rules/*.yml (as data);
- the example job file agrees with the layout (ranks, shards, paths, transport); a torch job's
  program is installed and its script shipped by the Dockerfile's torch stage (or the script
  lies on a volume every trainer mounts), and its trainers (only) run the torch image, run the
  scripts as users of their own (--script_user, none of them 0 or the pods' uid) and mount the
  operator token readable by its owner (root) alone;
- the namespace's Pod Security level admits the pods (IPC_LOCK needs `privileged`);
- the NetworkPolicies, evaluated as Kubernetes does: a default deny of ingress; each selects
  pods and names only ports they have; every flow the binaries open is admitted (pool workers
  to the controller's gRPC port through its Service, job clients' namespaces to gRPC and REST,
  ranks to their shards and shards to the ranks on every TCP port (gRPC, UCX), ranks to each
  other on every TCP port (Gloo, NCCL, torch.distributed), Prometheus to every port a
  PodMonitor scrapes); and Prometheus, job clients, other namespaces and foreign pods of this
  namespace reach no other port (every container port and an ephemeral one are tried);
- the controller's --tenants_file lies in the optional Secret offload-tenants, and
  k8s/base/tenants-example.yaml is that Secret, with tenants the controller would parse and
  only placeholder tokens;
- the app.kubernetes.io labels and the namespace.

It prints one line per problem, "CASE<TAB>Kind/name: message", and exits 0 (2 if it crashes).
"""
import argparse
import importlib.util
import json
import os
import re
import sys
from fractions import Fraction

import yaml

UID = 10001
BIN = "/opt/offload/bin/"
TOKEN_FILE = "/etc/offload/token/token"
TOKEN_DIR = "/etc/offload/token"
TOKEN_SECRET = "offload-token"
CHECKPOINT_DIR = "/var/lib/offload/checkpoints"
CONTROLLER_STORE_DIR = "/var/lib/offload/controller"
DATA_DIR = "/opt/offload/data/"
EXAMPLES_DIR = "/opt/offload/examples/"
TORCH_IMAGE = "offload-torch"
NAMESPACE = "offload"
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "ReplicaSet", "Pod"}
NOT_NAMESPACED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# Not run by these manifests (NVIDIA's GPU operator deploys it).
EXTERNAL_JOBS = {"dcgm-exporter"}


class Case:
    def __init__(self, name, objects, repo):
        self.name = name
        self.objects = objects
        self.repo = repo
        self.problems = []

    def error(self, obj, message):
        self.problems.append(f"{oid(obj)}: {message}")


def oid(obj):
    if not isinstance(obj, dict):
        return "(object)"
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name') if isinstance(meta, dict) else None}"


def d(value):
    """A dict, or {} when the value is missing or of the wrong type (the schema check says so)."""
    return value if isinstance(value, dict) else {}


def lst(value):
    return value if isinstance(value, list) else []


# ---------------------------------------------------------------------------------------------
# Quantities

_SUFFIX = {"": 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}


def quantity(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Fraction(value)
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", str(value).strip())
    if not m:
        return None
    return Fraction(m.group(1)) * _SUFFIX[m.group(2) or ""]


# ---------------------------------------------------------------------------------------------
# Pods and containers


def pod_template(obj):
    """(pod metadata, pod spec) of a workload, or (None, None)."""
    kind = obj.get("kind")
    if kind == "Pod":
        return d(obj.get("metadata")), d(obj.get("spec"))
    if kind in WORKLOADS:
        template = d(d(obj.get("spec")).get("template"))
        return d(template.get("metadata")), d(template.get("spec"))
    return None, None


def containers(pod_spec, init=True):
    out = [c for c in lst(pod_spec.get("containers")) if isinstance(c, dict)]
    if init:
        out += [c for c in lst(pod_spec.get("initContainers")) if isinstance(c, dict)]
    return out


def binary(container):
    command = lst(container.get("command"))
    if command and isinstance(command[0], str) and command[0].startswith(BIN):
        return command[0][len(BIN):]
    return None


def flags(container):
    """--name=value arguments before a bare `--` (those after it go to trainer ranks)."""
    out = {}
    for arg in lst(container.get("args")):
        if arg == "--":
            break
        if isinstance(arg, str) and arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            out[name] = value
    return out


def port_of(address):
    m = re.fullmatch(r".*:(\d+)", address or "")
    return int(m.group(1)) if m else None


def workers_of(container):
    """gpu_trainer --workers=N: pool workers (ranks) the container's process runs; 1 if unset."""
    value = flags(container).get("workers", "1")
    return int(value) if str(value).isdigit() and int(value) >= 1 else None


# A process of N workers serves rank k's metrics on the rank port + k, container port
# `rank-metrics-<k>` for k >= 1 (docs/METRICS.md).
def extra_rank_port(name, number, base):
    m = re.fullmatch(r"(.+)-(\d+)", name or "")
    return m is not None and m.group(1) == base[1] and int(m.group(2)) >= 1 and \
        number == base[0] + int(m.group(2))


def container_ports(container):
    return {p.get("name"): p.get("containerPort") for p in lst(container.get("ports"))
            if isinstance(p, dict)}


def volumes(pod_spec):
    return {v.get("name"): v for v in lst(pod_spec.get("volumes")) if isinstance(v, dict)}


def mounts(container):
    return {m.get("mountPath"): m for m in lst(container.get("volumeMounts")) if isinstance(m, dict)}


def env_names(container):
    return {e.get("name"): e for e in lst(container.get("env")) if isinstance(e, dict)}


def matches(selector, labels):
    """A LabelSelector (matchLabels + matchExpressions) against a label map."""
    selector = d(selector)
    labels = d(labels)
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return False  # an empty selector selects everything: never what these manifests mean
    for k, v in d(selector.get("matchLabels")).items():
        if labels.get(k) != v:
            return False
    for expr in lst(selector.get("matchExpressions")):
        expr = d(expr)
        key, op, values = expr.get("key"), expr.get("operator"), lst(expr.get("values"))
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Checks


def check_labels(case):
    for obj in case.objects:
        meta = d(obj.get("metadata"))
        labels = d(meta.get("labels"))
        if labels.get("app.kubernetes.io/part-of") != "offload":
            case.error(obj, "label app.kubernetes.io/part-of: offload missing")
        if obj.get("kind") != "Namespace":
            for key in ("app.kubernetes.io/name", "app.kubernetes.io/component"):
                if not labels.get(key):
                    case.error(obj, f"label {key} missing")
        if obj.get("kind") not in NOT_NAMESPACED and meta.get("namespace") != NAMESPACE:
            case.error(obj, f"namespace is {meta.get('namespace')!r}, not {NAMESPACE!r}")
        pod_meta, _ = pod_template(obj)
        if pod_meta is not None and obj.get("kind") != "Pod":
            pod_labels = d(pod_meta.get("labels"))
            for key in ("app.kubernetes.io/name", "app.kubernetes.io/component",
                        "app.kubernetes.io/part-of"):
                if not pod_labels.get(key):
                    case.error(obj, f"pod template label {key} missing")
        if obj.get("kind") == "ServiceAccount" and obj.get("automountServiceAccountToken") is not False:
            case.error(obj, "automountServiceAccountToken is not false")


def check_security(case, obj, pod_spec):
    if pod_spec.get("automountServiceAccountToken") is not False:
        case.error(obj, "pod automountServiceAccountToken is not false")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            case.error(obj, f"pod sets {field}")
    pod_sc = d(pod_spec.get("securityContext"))
    vols = volumes(pod_spec)
    for c in containers(pod_spec):
        name = c.get("name")
        sc = c.get("securityContext")
        if not isinstance(sc, dict):
            case.error(obj, f"container {name}: no securityContext")
            continue
        # A pool worker that runs scripts as users of their own switches to them: root, with
        # exactly the capabilities that takes (check_script_users holds the rest).
        launcher = binary(c) == "gpu_trainer" and "script_user" in flags(c)
        if launcher:
            if sc.get("runAsUser", pod_sc.get("runAsUser")) != 0:
                case.error(obj, f"container {name}: --script_user, but not runAsUser 0 (switching users needs root)")
        elif (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))) is not True:
            case.error(obj, f"container {name}: runAsNonRoot is not true")
        elif sc.get("runAsUser", pod_sc.get("runAsUser")) != UID:
            case.error(obj, f"container {name}: runAsUser is not {UID}")
        if sc.get("readOnlyRootFilesystem") is not True:
            case.error(obj, f"container {name}: readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            case.error(obj, f"container {name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            case.error(obj, f"container {name}: privileged")
        caps = d(sc.get("capabilities"))
        if "ALL" not in lst(caps.get("drop")):
            case.error(obj, f"container {name}: capabilities do not drop ALL")
        allowed = {"IPC_LOCK"} | (SCRIPT_LAUNCHER_CAPABILITIES if launcher else set())
        added = set(lst(caps.get("add"))) - allowed
        if added:
            case.error(obj, f"container {name}: adds capabilities {sorted(added)} (only {sorted(allowed)} may be added)")
        if launcher and not SCRIPT_LAUNCHER_CAPABILITIES <= set(lst(caps.get("add"))):
            case.error(obj, f"container {name}: --script_user needs capabilities {sorted(SCRIPT_LAUNCHER_CAPABILITIES)}")
        seccomp = d(sc.get("seccompProfile")) or d(pod_sc.get("seccompProfile"))
        if seccomp.get("type") != "RuntimeDefault":
            case.error(obj, f"container {name}: seccompProfile is not RuntimeDefault")
        tmp = mounts(c).get("/tmp")
        if not tmp or "emptyDir" not in d(vols.get(tmp.get("name"))):
            case.error(obj, f"container {name}: no emptyDir at /tmp (the root filesystem is read-only)")


def check_resources(case, obj, pod_spec):
    for c in containers(pod_spec):
        res = d(c.get("resources"))
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if quantity(d(res.get(kind)).get(r)) is None:
                    case.error(obj, f"container {c.get('name')}: no {kind}.{r}")


def check_volumes(case, obj, pod_spec):
    vols = volumes(pod_spec)
    for c in containers(pod_spec):
        for path, m in mounts(c).items():
            vol = vols.get(m.get("name"))
            if vol is None:
                case.error(obj, f"container {c.get('name')}: mounts {path} from undefined volume {m.get('name')}")
                continue
            if path == "/dev/shm":
                ed = vol.get("emptyDir")
                if not isinstance(ed, dict) or ed.get("medium") != "Memory":
                    case.error(obj, f"container {c.get('name')}: /dev/shm is not an emptyDir with medium Memory")
                elif quantity(ed.get("sizeLimit")) is None:
                    case.error(obj, f"container {c.get('name')}: /dev/shm emptyDir has no sizeLimit")


def check_token(case, obj, pod_spec):
    vols = volumes(pod_spec)
    for c in containers(pod_spec):
        if not binary(c):
            continue
        f = flags(c)
        if f.get("token_file") != TOKEN_FILE:
            case.error(obj, f"container {c.get('name')}: no --token_file={TOKEN_FILE}")
        if "allow_unauthenticated" in f:
            case.error(obj, f"container {c.get('name')}: --allow_unauthenticated")
        m = mounts(c).get(TOKEN_DIR)
        secret = d(d(vols.get(m.get("name")) if m else None).get("secret"))
        if secret.get("secretName") != TOKEN_SECRET or not (m or {}).get("readOnly"):
            case.error(obj, f"container {c.get('name')}: secret {TOKEN_SECRET} is not mounted read-only at {TOKEN_DIR}")


def grpc_probe_port(probe):
    return d(d(probe).get("grpc")).get("port")


def check_roles(case, obj, pod_meta, pod_spec, ctx, metrics_jobs):
    kind = obj.get("kind")
    spec = d(obj.get("spec"))
    cs = containers(pod_spec, init=False)
    by_binary = {}
    for c in cs:
        if binary(c):
            by_binary.setdefault(binary(c), []).append(c)

    # Metrics ports and flags of every binary (docs/METRICS.md).
    expected_ports = {
        "job_controller": [("metrics_address", "offload-controller")],
        "cpu_optimizer_server": [("metrics_address", "offload-optimizer-server")],
        "gpu_trainer": [("metrics_address", "offload-trainer-worker"),
                        ("rank_metrics_address", "offload-trainer")],
    }
    for b, items in expected_ports.items():
        for c in by_binary.get(b, []):
            f = flags(c)
            ports = container_ports(c)
            for flag, job in items:
                want = metrics_jobs.get(job)
                if not want:
                    case.error(obj, f"docs/METRICS.md has no scrape job {job}")
                    continue
                number, port_name = want
                if port_of(f.get(flag)) != number:
                    case.error(obj, f"container {c.get('name')}: --{flag} is not on port {number} (docs/METRICS.md, job {job})")
                if ports.get(port_name) != number:
                    case.error(obj, f"container {c.get('name')}: no container port {port_name}: {number} (docs/METRICS.md, job {job})")
                # Each further rank of a process of several workers: its own port, one up.
                if flag == "rank_metrics_address":
                    for k in range(1, workers_of(c) or 1):
                        if ports.get(f"{port_name}-{k}") != number + k:
                            case.error(obj, f"container {c.get('name')}: --workers={workers_of(c)} but no container port {port_name}-{k}: {number + k} (docs/METRICS.md, job {job})")

    for c in by_binary.get("job_controller", []):
        f = flags(c)
        port = port_of(f.get("grpc_address"))
        for probe in ("readinessProbe", "livenessProbe"):
            if grpc_probe_port(c.get(probe)) != port or port is None:
                case.error(obj, f"container {c.get('name')}: {probe} is not a gRPC probe on the gRPC port {port}")
        if kind != "Deployment" or spec.get("replicas") != 1 or d(spec.get("strategy")).get("type") != "Recreate":
            case.error(obj, "the controller must be a Deployment with 1 replica and strategy Recreate")
        store = f.get("store") or ""
        m = mounts(c).get(CONTROLLER_STORE_DIR)
        if not store.startswith(CONTROLLER_STORE_DIR + "/") or not m or \
                "persistentVolumeClaim" not in d(volumes(pod_spec).get(m.get("name"))):
            case.error(obj, f"container {c.get('name')}: --store is not on a PVC mounted at {CONTROLLER_STORE_DIR}")

    optimizers = by_binary.get("cpu_optimizer_server", [])
    for c in optimizers:
        f = flags(c)
        port = port_of(f.get("listen"))
        for probe in ("readinessProbe", "livenessProbe"):
            if grpc_probe_port(c.get(probe)) != port or port is None:
                case.error(obj, f"container {c.get('name')}: {probe} is not a gRPC probe on the gRPC port {port}")
        limit = quantity(d(d(c.get("resources")).get("limits")).get("memory"))
        try:
            budget = int(f.get("memory_limit_mib", "")) * 2**20
        except ValueError:
            budget = None
        if budget is None or limit is None or budget >= limit:
            case.error(obj, f"container {c.get('name')}: --memory_limit_mib must be set below the container's memory limit")
        if not f.get("controller"):
            case.error(obj, f"container {c.get('name')}: no --controller")
    if optimizers:
        # Guaranteed QoS: every container of the pod has cpu and memory limits equal to requests.
        for c in containers(pod_spec):
            res = d(c.get("resources"))
            for r in ("cpu", "memory"):
                req = quantity(d(res.get("requests")).get(r))
                lim = quantity(d(res.get("limits")).get(r))
                if lim is None or req != lim:
                    case.error(obj, f"pod is not Guaranteed QoS: container {c.get('name')} {r} requests "
                                    f"{d(res.get('requests')).get(r)} != limits {d(res.get('limits')).get(r)}")
    if optimizers and kind == "StatefulSet":
        service_name = spec.get("serviceName")
        svc = ctx["services"].get(service_name)
        if not svc or d(svc.get("spec")).get("clusterIP") != "None" or \
                not matches({"matchLabels": d(d(svc.get("spec")).get("selector"))}, pod_meta.get("labels")):
            case.error(obj, f"serviceName {service_name!r} is not a headless Service selecting its pods")
        if spec.get("podManagementPolicy") != "Parallel":
            case.error(obj, "podManagementPolicy is not Parallel")
        for c in optimizers:
            env = env_names(c).get("POD_NAME")
            if d(d(d(env).get("valueFrom")).get("fieldRef")).get("fieldPath") != "metadata.name":
                case.error(obj, f"container {c.get('name')}: no POD_NAME from the downward API (metadata.name)")
            want = f"$(POD_NAME).{service_name}:{port_of(flags(c).get('listen'))}"
            if flags(c).get("advertise") != want:
                case.error(obj, f"container {c.get('name')}: --advertise is not {want}")
        replicas = spec.get("replicas", 1)
        ok = False
        for pdb in ctx["pdbs"]:
            ps = d(pdb.get("spec"))
            if matches(ps.get("selector"), pod_meta.get("labels")):
                if ps.get("maxUnavailable") == 0 or ps.get("minAvailable") == replicas:
                    ok = True
        if not ok:
            case.error(obj, "no PodDisruptionBudget keeps every shard (maxUnavailable 0 or minAvailable == replicas)")

    trainers = by_binary.get("gpu_trainer", [])
    for c in trainers:
        f = flags(c)
        for probe in ("readinessProbe", "livenessProbe"):
            p = d(c.get(probe))
            if not (p.get("tcpSocket") or p.get("httpGet")):
                case.error(obj, f"container {c.get('name')}: {probe} is not a tcpSocket or httpGet probe")
        if f.get("worker_index") != "$(JOB_COMPLETION_INDEX)":
            case.error(obj, f"container {c.get('name')}: --worker_index is not $(JOB_COMPLETION_INDEX)")
        if f.get("rank_address") != "$(POD_IP)" or d(d(d(env_names(c).get("POD_IP")).get("valueFrom")).get("fieldRef")).get("fieldPath") != "status.podIP":
            case.error(obj, f"container {c.get('name')}: --rank_address is not $(POD_IP) from status.podIP")
        if not f.get("controller"):
            case.error(obj, f"container {c.get('name')}: no --controller")
        gpus = quantity(d(d(c.get("resources")).get("limits")).get("nvidia.com/gpu"))
        if not gpus or gpus < 1:
            case.error(obj, f"container {c.get('name')}: no nvidia.com/gpu limit")
        workers = workers_of(c)
        if workers is None:
            case.error(obj, f"container {c.get('name')}: --workers is not a positive integer")
        elif gpus and gpus < workers:
            case.error(obj, f"container {c.get('name')}: nvidia.com/gpu limit {gpus} < --workers={workers} (a GPU per rank)")
        shm = mounts(c).get("/dev/shm")
        if not shm:
            case.error(obj, f"container {c.get('name')}: no /dev/shm mount")
        ckpt = mounts(c).get(CHECKPOINT_DIR)
        if not ckpt or "persistentVolumeClaim" not in d(volumes(pod_spec).get(ckpt.get("name"))):
            case.error(obj, f"container {c.get('name')}: no checkpoint PVC at {CHECKPOINT_DIR}")
        for o in optimizers:
            other = mounts(o).get("/dev/shm")
            if not shm or not other or other.get("name") != shm.get("name"):
                case.error(obj, f"containers {c.get('name')} and {o.get('name')} do not share one /dev/shm volume")
    if trainers:
        if kind != "Job":
            case.error(obj, "trainer workers must run as an Indexed Job")
        else:
            if spec.get("completionMode") != "Indexed":
                case.error(obj, "completionMode is not Indexed")
            if not isinstance(spec.get("completions"), int) or spec.get("completions") != spec.get("parallelism"):
                case.error(obj, "completions != parallelism")
            if pod_spec.get("restartPolicy") not in ("OnFailure", "Never"):
                case.error(obj, "restartPolicy is not OnFailure or Never")
            if not isinstance(spec.get("backoffLimit"), int):
                case.error(obj, "no backoffLimit")
        sub = pod_spec.get("subdomain")
        svc = ctx["services"].get(sub)
        if not svc or d(svc.get("spec")).get("clusterIP") != "None" or \
                not matches({"matchLabels": d(d(svc.get("spec")).get("selector"))}, pod_meta.get("labels")):
            case.error(obj, f"subdomain {sub!r} is not a headless Service selecting the trainer pods")


# Capabilities a container may add under each Pod Security Standard level.
# What a trainer pool worker needs to run scripts as users of their own (--script_user).
SCRIPT_LAUNCHER_CAPABILITIES = {"SETUID", "SETGID", "KILL", "CHOWN"}
PSS_CAPABILITIES = {
    "restricted": {"NET_BIND_SERVICE"},
    "baseline": {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                 "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"},
}


def check_pod_security(case, ctx):
    """The namespace enforces a Pod Security level that admits the pods."""
    ns = next((o for o in case.objects if o.get("kind") == "Namespace"
               and d(o.get("metadata")).get("name") == NAMESPACE), None)
    if ns is None:
        case.problems.append(f"Namespace/{NAMESPACE}: missing")
        return
    level = d(d(ns.get("metadata")).get("labels")).get("pod-security.kubernetes.io/enforce")
    if level not in ("restricted", "baseline", "privileged"):
        case.error(ns, "no pod-security.kubernetes.io/enforce level")
        return
    allowed = PSS_CAPABILITIES.get(level)
    if allowed is None:
        return
    for obj, _, pod_spec in ctx["pods"]:
        for c in containers(pod_spec):
            added = set(lst(d(d(c.get("securityContext")).get("capabilities")).get("add"))) - allowed
            if added:
                case.error(obj, f"container {c.get('name')} adds {sorted(added)}: its pods would be "
                                f"rejected by Pod Security admission (namespace enforces {level})")


def relabel_job(endpoint):
    """The fixed `job` a relabeling sets, or None."""
    job = None
    for r in lst(endpoint.get("relabelings")):
        r = d(r)
        if r.get("targetLabel") == "job" and r.get("action", "replace") == "replace" and \
                not r.get("sourceLabels") and r.get("regex", "(.*)") == "(.*)":
            job = r.get("replacement")
    return job


def container_filter(endpoint):
    """Regex of a `keep` relabeling on the container name, or None."""
    for r in lst(endpoint.get("relabelings")):
        r = d(r)
        if r.get("action") == "keep" and lst(r.get("sourceLabels")) == ["__meta_kubernetes_pod_container_name"]:
            return r.get("regex", "(.*)")
    return None


def check_monitoring(case, ctx, metrics_jobs):
    scraped = {}
    for mon in ctx["monitors"]:
        spec = d(mon.get("spec"))
        is_pod = mon.get("kind") == "PodMonitor"
        endpoints = lst(spec.get("podMetricsEndpoints" if is_pod else "endpoints"))
        if is_pod:
            targets = [(o, pm, ps) for o, pm, ps in ctx["pods"]
                       if matches(spec.get("selector"), pm.get("labels"))]
        else:
            targets = [s for s in ctx["services"].values()
                       if matches(spec.get("selector"), d(s.get("metadata")).get("labels"))]
        if not targets:
            case.error(mon, "its selector matches no pods" if is_pod else "its selector matches no services")
            continue
        for i, ep in enumerate(endpoints):
            ep = d(ep)
            port = ep.get("port")
            if not port:
                case.error(mon, f"endpoint {i}: no named port")
                continue
            job = relabel_job(ep)
            if job is None and spec.get("jobLabel"):
                labels = [d(pm.get("labels")) for _, pm, _ in targets] if is_pod else \
                    [d(d(s.get("metadata")).get("labels")) for s in targets]
                values = {l.get(spec["jobLabel"]) for l in labels}
                job = values.pop() if len(values) == 1 else None
            if job is None and not is_pod:
                job = d(targets[0].get("metadata")).get("name") if len(targets) == 1 else None
            if job not in metrics_jobs:
                case.error(mon, f"endpoint port {port}: Prometheus job label {job!r} is not a scrape job of docs/METRICS.md")
                continue
            number, port_name = metrics_jobs[job]
            found = []
            if is_pod:
                regex = container_filter(ep)
                for _, _, ps in targets:
                    for c in containers(ps, init=False):
                        if regex is not None and not re.fullmatch(regex, c.get("name") or ""):
                            continue
                        if port in container_ports(c):
                            found.append(container_ports(c)[port])
            else:
                for s in targets:
                    for p in lst(d(s.get("spec")).get("ports")):
                        if d(p).get("name") == port:
                            found.append(d(p).get("port"))
            if not found:
                case.error(mon, f"endpoint port {port}: no such port on the selected "
                                f"{'pods (containers)' if is_pod else 'services'}")
                continue
            if job == "offload-trainer" and port != port_name and \
                    all(extra_rank_port(port, n, (number, port_name)) for n in found):
                pass  # rank k of a process of several workers: the rank port + k
            elif port != port_name or any(n != number for n in found):
                case.error(mon, f"endpoint port {port} ({sorted(set(found))}): docs/METRICS.md gives job {job} port {number} ({port_name})")
            if oid(mon) not in scraped.setdefault(job, []):
                scraped[job].append(oid(mon))  # one monitor may scrape a job on several ports
    for job in sorted(metrics_jobs):
        if job in EXTERNAL_JOBS:
            continue
        if job not in scraped:
            case.problems.append(f"(monitoring): no PodMonitor or ServiceMonitor scrapes job {job} (docs/METRICS.md)")
        elif len(scraped[job]) > 1:
            case.problems.append(f"(monitoring): job {job} is scraped by {scraped[job]}")


def rule_groups(repo):
    """The groups the PrometheusRule must hold: make-prometheus-rule.py's own loader, so the two
    cannot disagree on which files or in which order."""
    path = os.path.join(repo, "k8s/tools/make-prometheus-rule.py")
    spec = importlib.util.spec_from_file_location("make_prometheus_rule", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.load_groups(os.path.join(repo, "monitoring/prometheus/rules"))


def check_rules(case, ctx):
    try:
        want = rule_groups(case.repo)
    except SystemExit as e:  # the loader's refusal of a bad rule file
        case.problems.append(f"(monitoring): {e}")
        return
    got = []
    for rule in ctx["rules"]:
        got += lst(d(rule.get("spec")).get("groups"))
    if got == want:
        return
    names_got = [d(g).get("name") for g in got]
    names_want = [d(g).get("name") for g in want]
    if names_got != names_want:
        detail = f"groups {names_got} != {names_want}"
    else:
        detail = next(f"group {a.get('name')!r} differs" for a, b in zip(got, want) if a != b)
    case.problems.append(f"PrometheusRule groups differ from monitoring/prometheus/rules/*.yml: {detail} "
                         "(run k8s/tools/make-prometheus-rule.py)")


def check_example_job(case, ctx):
    cm = ctx["configmaps"].get("offload-example-job")
    if not cm:
        case.problems.append("ConfigMap/offload-example-job: missing")
        return
    try:
        job = yaml.safe_load(d(cm.get("data")).get("job.yaml") or "")
    except yaml.YAMLError as e:
        case.error(cm, f"job.yaml does not parse: {e}")
        return
    job = d(job)
    parallel = d(job.get("parallel"))
    if job.get("torch") is not None:
        check_torch_job(case, ctx, cm, d(job.get("torch")))
    else:
        data_path = d(job.get("data")).get("path") or ""
        if not data_path.startswith(DATA_DIR) or \
                not os.path.isfile(os.path.join(case.repo, "data", data_path[len(DATA_DIR):])):
            case.error(cm, f"data.path {data_path!r} is not a file the image ships under {DATA_DIR}")
    if not (d(job.get("checkpoint")).get("dir") or "").startswith(CHECKPOINT_DIR + "/"):
        case.error(cm, f"checkpoint.dir is not under the checkpoint volume {CHECKPOINT_DIR}")
    trainer_pods = shards = 0
    rdma = False
    for obj, _, ps in ctx["pods"]:
        spec = d(obj.get("spec"))
        count = spec.get("completions", 1) if obj.get("kind") == "Job" else spec.get("replicas", 1)
        if not isinstance(count, int):
            continue
        for c in containers(ps, init=False):
            if binary(c) == "gpu_trainer":
                trainer_pods += count * (workers_of(c) or 1)
            if binary(c) == "cpu_optimizer_server":
                shards += count
            if any(k.startswith("rdma/") for k in d(d(c.get("resources")).get("limits"))):
                rdma = True
    if parallel.get("ranks", 1) != trainer_pods:
        case.error(cm, f"parallel.ranks {parallel.get('ranks', 1)} != {trainer_pods} trainer pool workers (pods x --workers)")
    if parallel.get("optimizer_servers", 1) != shards:
        case.error(cm, f"parallel.optimizer_servers {parallel.get('optimizer_servers', 1)} != {shards} optimizer servers")
    if rdma and parallel.get("transport") != "ucx":
        case.error(cm, "the layout has RDMA devices but the job's transport is not ucx")


def dockerfile_stage(repo, name):
    """The lines of the Dockerfile's stage `FROM ... AS name`, continuations joined."""
    with open(os.path.join(repo, "Dockerfile"), encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    stage, inside = [], False
    for line in text.splitlines():
        if line.startswith("FROM "):
            inside = line.split()[-2:] == ["AS", name]
        elif inside:
            stage.append(line)
    return stage


def check_script_users(case, obj, pod_spec):
    """A trainer that runs torch jobs' scripts runs them as users of their own (--script_user=N:
    worker k as N + k), none of them the pods' user or root, and mounts the operator token so that
    only root (the worker) reads it."""
    vols = volumes(pod_spec)
    for c in containers(pod_spec, init=False):
        if binary(c) != "gpu_trainer":
            continue
        f = flags(c)
        user = f.get("script_user", "")
        if not user.isdigit():
            case.error(obj, f"container {c.get('name')}: runs torch jobs' scripts without --script_user: a script could read the operator token")
            continue
        first = int(user)
        workers = int(f.get("workers", "1")) if str(f.get("workers", "1")).isdigit() else 1
        if first == 0 or first <= UID < first + workers:
            case.error(obj, f"container {c.get('name')}: --script_user={user} with {workers} worker(s) includes uid {0 if first == 0 else UID}")
        m = mounts(c).get(TOKEN_DIR)
        secret = d(d(vols.get(m.get("name")) if m else None).get("secret"))
        modes = [secret.get("defaultMode", 0o644)] + [i.get("mode") for i in lst(secret.get("items"))
                                                      if isinstance(i, dict) and "mode" in i]
        if any(not isinstance(mode, int) or mode & 0o077 for mode in modes):
            case.error(obj, f"container {c.get('name')}: the token secret's mode {[oct(x) if isinstance(x, int) else x for x in modes]} lets others than its owner read it: the scripts' group would")


def check_torch_job(case, ctx, cm, torch):
    """A torch job (a PyTorch script on the pool): its program is one the Dockerfile's `torch`
    stage installs, the script it runs is one that stage ships or one on a volume every trainer
    mounts, and every trainer pool worker runs from the torch image while nothing else does."""
    command = [a for a in lst(torch.get("command")) if isinstance(a, str)]
    stage = dockerfile_stage(case.repo, "torch")
    if not stage:
        case.error(cm, "a torch job, but the Dockerfile has no `torch` stage")
    installed = {w for line in stage if "apt-get install" in line for w in line.split()}
    if not command or (command[0] not in installed and not command[0].startswith(BIN)):
        case.error(cm, f"torch.command[0] {command[:1]!r} is not a package the Dockerfile's torch stage installs")
    trainers = [c for _, _, ps in ctx["pods"] for c in containers(ps, init=False)
                if binary(c) == "gpu_trainer"]
    scripts = [a for a in command[1:] if a.endswith(".py")]
    if not scripts:
        case.error(cm, f"torch.command {command!r} names no script (.py)")
    for script in scripts:
        if script.startswith(EXAMPLES_DIR):
            name = script[len(EXAMPLES_DIR):]
            if not os.path.isfile(os.path.join(case.repo, "examples", name)) or \
                    f"COPY examples/{name} {script}" not in stage:
                case.error(cm, f"torch.command's {script} is not examples/{name} copied by the Dockerfile's torch stage")
        elif not trainers or not all(
                any(script.startswith(path.rstrip("/") + "/") for path in mounts(c)) for c in trainers):
            case.error(cm, f"torch.command's {script} is neither shipped in the torch image "
                           f"({EXAMPLES_DIR}) nor on a volume every trainer mounts")
    for obj, _, ps in ctx["pods"]:
        for c in containers(ps, init=False):
            image = str(c.get("image", ""))
            torch_image = image.split("/")[-1].startswith(TORCH_IMAGE + ":")
            if binary(c) == "gpu_trainer" and not torch_image:
                case.error(obj, f"trainer {image!r} is not the torch image ({TORCH_IMAGE}) a torch job needs")
            if binary(c) != "gpu_trainer" and torch_image:
                case.error(obj, f"{c.get('name')} runs the torch image, which only trainers need")
        check_script_users(case, obj, ps)


# ---------------------------------------------------------------------------------------------
# NetworkPolicies (k8s/base/network-policies.yaml), evaluated as Kubernetes does for the flows the
# binaries need and for peers that must get nothing. Ports of the data plane are ephemeral, so a
# flow that needs them asks for every TCP port (port None).

EPHEMERAL_PORT = 40000  # stands for any port Gloo, NCCL, torch.distributed or UCX may bind
# Peers outside the pods of the manifests: (namespace labels, pod labels, in this namespace).
PROMETHEUS = ({"kubernetes.io/metadata.name": "monitoring"},
              {"app.kubernetes.io/name": "prometheus",
               "app.kubernetes.io/managed-by": "prometheus-operator"}, False)
JOB_CLIENT = ({"kubernetes.io/metadata.name": "ci", "offload.dev/job-clients": "true"},
              {"app": "ci-runner"}, False)
OTHER_NAMESPACE = ({"kubernetes.io/metadata.name": "elsewhere"}, {"app": "anything"}, False)
FOREIGN_POD = (None, {"app": "debug"}, True)  # a pod in this namespace that is none of ours
OUTSIDERS = {"Prometheus": PROMETHEUS, "a job client's namespace": JOB_CLIENT,
             "a pod of another namespace": OTHER_NAMESPACE,
             "a pod of this namespace that is not Offload's": FOREIGN_POD}
METRICS_PORT_NAME = re.compile(r"(metrics|rank-metrics(-\d+)?)")


def selects(selector, labels):
    """A LabelSelector as Kubernetes reads it: an empty one selects everything."""
    selector = d(selector)
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True
    return matches(selector, labels)


def namespace_labels(case):
    ns = next((o for o in case.objects if o.get("kind") == "Namespace"
               and d(o.get("metadata")).get("name") == NAMESPACE), {})
    return dict(d(d(ns.get("metadata")).get("labels")), **{"kubernetes.io/metadata.name": NAMESPACE})


def peer_matches(peer, source, own_namespace):
    ns_labels, pod_labels, here = source
    peer = d(peer)
    if "ipBlock" in peer:
        return False  # pod IPs are not modelled; the manifests use no ipBlock
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], own_namespace if here else ns_labels):
            return False
    elif not here:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], pod_labels)


def port_matches(entry, port, pod_spec):
    """Whether a NetworkPolicyPort admits TCP `port` of the pod (None: every TCP port)."""
    entry = d(entry)
    if entry.get("protocol", "TCP") != "TCP":
        return False
    p = entry.get("port")
    if p is None:
        return True
    if port is None:
        return False
    if isinstance(p, int):
        return p <= port <= entry.get("endPort", p)
    return any(container_ports(c).get(p) == port for c in containers(pod_spec, init=False))


def ingress_policies(ctx, pod_meta):
    return [p for p in ctx["netpols"]
            if selects(d(p.get("spec")).get("podSelector"), d(pod_meta.get("labels")))
            and "Ingress" in lst(d(p.get("spec")).get("policyTypes") or ["Ingress"])]


def admits(ctx, pod_meta, pod_spec, source, port, own_namespace):
    """Whether a pod takes a TCP connection from `source` (a peer tuple, or a pod's labels) on
    `port` (None: on every TCP port), under the NetworkPolicies of the case."""
    if isinstance(source, dict):
        source = (None, source, True)
    policies = ingress_policies(ctx, pod_meta)
    if not policies:
        return True  # not isolated
    for policy in policies:
        for rule in lst(d(policy.get("spec")).get("ingress")):
            rule = d(rule)
            peers, ports = lst(rule.get("from")), lst(rule.get("ports"))
            if peers and not any(peer_matches(p, source, own_namespace) for p in peers):
                continue
            if not ports or any(port_matches(e, port, pod_spec) for e in ports):
                return True
    return False


def controller_port(ctx, address, controller_spec):
    """The controller container's port a --controller=HOST:PORT reaches, through its Service."""
    host, _, port = (address or "").rpartition(":")
    if not port.isdigit():
        return None
    svc = ctx["services"].get(host.split(".")[0])
    for p in lst(d(d(svc).get("spec")).get("ports")):
        p = d(p)
        if p.get("port") == int(port):
            target = p.get("targetPort", p.get("port"))
            if isinstance(target, str):
                for c in containers(controller_spec, init=False):
                    if target in container_ports(c):
                        return container_ports(c)[target]
                return None
            return target
    return int(port)


def check_network_policies(case, ctx):
    if not ctx["netpols"]:
        case.problems.append("(network): no NetworkPolicy (k8s/base/network-policies.yaml)")
        return
    own = namespace_labels(case)

    def denies_all(policy):
        spec = d(policy.get("spec"))
        selector = d(spec.get("podSelector"))
        return not selector.get("matchLabels") and not selector.get("matchExpressions") and \
            "Ingress" in lst(spec.get("policyTypes")) and not lst(spec.get("ingress"))

    if not any(denies_all(p) for p in ctx["netpols"]):
        case.problems.append("(network): no default-deny ingress NetworkPolicy "
                             "(podSelector {}, policyTypes [Ingress], no rules)")
    for policy in ctx["netpols"]:
        selector = d(d(policy.get("spec")).get("podSelector"))
        targets = [(o, pm, ps) for o, pm, ps in ctx["pods"] if selects(selector, pm.get("labels"))]
        if (selector.get("matchLabels") or selector.get("matchExpressions")) and not targets:
            case.error(policy, "its podSelector matches no pods")
        for rule in lst(d(policy.get("spec")).get("ingress")):
            for entry in lst(d(rule).get("ports")):
                name = d(entry).get("port")
                if not isinstance(name, str):
                    continue
                for obj, _, ps in targets:
                    if not any(name in container_ports(c) for c in containers(ps, init=False)):
                        case.error(policy, f"port {name}: no such container port on {oid(obj)}")

    def runs(ps, b):
        return [c for c in containers(ps, init=False) if binary(c) == b]

    controllers = [(o, pm, ps) for o, pm, ps in ctx["pods"] if runs(ps, "job_controller")]
    shards = [(o, pm, ps) for o, pm, ps in ctx["pods"] if runs(ps, "cpu_optimizer_server")]
    trainers = [(o, pm, ps) for o, pm, ps in ctx["pods"] if runs(ps, "gpu_trainer")]
    allowed = {}  # id(pod spec) -> {outsider name: ports it may reach}

    # The pool's pods reach the controller's gRPC port; job clients reach gRPC and REST.
    for dst, dm, ds in controllers:
        f = flags(runs(ds, "job_controller")[0])
        api = [p for p in (port_of(f.get("grpc_address")), port_of(f.get("http_address"))) if p]
        for port in api:
            if not admits(ctx, dm, ds, JOB_CLIENT, port, own):
                case.error(dst, f"port {port} (job API) is not open to the job clients' namespaces "
                                "(offload.dev/job-clients: \"true\")")
        allowed[id(ds)] = {"a job client's namespace": set(api)}
        for src, sm, ss in ctx["pods"]:
            for c in containers(ss, init=False):
                if binary(c) in ("cpu_optimizer_server", "gpu_trainer") and flags(c).get("controller"):
                    port = controller_port(ctx, flags(c)["controller"], ds)
                    if port is not None and not admits(ctx, dm, ds, d(sm.get("labels")), port, own):
                        case.error(dst, f"port {port} (gRPC) is not open to {oid(src)}, whose "
                                        f"{binary(c)} calls the controller there")
    # Ranks reach their shards on the gRPC port and UCX's listeners; ranks reach each other
    # (Gloo, NCCL, torch.distributed); shards reach the ranks' UCX listeners.
    for dst, dm, ds in shards:
        for src, sm, _ in trainers:
            if not admits(ctx, dm, ds, d(sm.get("labels")), None, own):
                case.error(dst, f"not every TCP port is open to the trainer pods of {oid(src)} "
                                "(the shard's gRPC port and its UCX listeners)")
    for dst, dm, ds in trainers:
        for src, sm, _ in trainers:
            if not admits(ctx, dm, ds, d(sm.get("labels")), None, own):
                case.error(dst, f"not every TCP port is open to the trainer pods of {oid(src)} "
                                "(Gloo, NCCL and torch.distributed listen on ephemeral ports)")
        for src, sm, _ in shards:
            if not admits(ctx, dm, ds, d(sm.get("labels")), None, own):
                case.error(dst, f"not every TCP port is open to the optimizer pods of {oid(src)} "
                                "(a shard connects to its ranks' UCX listeners)")

    # Prometheus reaches every port a PodMonitor scrapes.
    for mon in ctx["monitors"]:
        spec = d(mon.get("spec"))
        if mon.get("kind") != "PodMonitor":
            continue
        for ep in lst(spec.get("podMetricsEndpoints")):
            ep = d(ep)
            regex = container_filter(ep)
            for obj, pm, ps in ctx["pods"]:
                if not matches(spec.get("selector"), pm.get("labels")):
                    continue
                for c in containers(ps, init=False):
                    if regex is not None and not re.fullmatch(regex, c.get("name") or ""):
                        continue
                    number = container_ports(c).get(ep.get("port"))
                    if number is not None and not admits(ctx, pm, ps, PROMETHEUS, number, own):
                        case.error(mon, f"port {ep.get('port')} ({number}) of {oid(obj)} is not "
                                        "open to Prometheus (NetworkPolicy)")

    # Nothing else reaches anything: every container port, and an ephemeral one, against each
    # outsider, which may reach only the ports above.
    for obj, pm, ps in ctx["pods"]:
        ports = {n for c in containers(ps, init=False) for n in container_ports(c).values()
                 if isinstance(n, int)}
        metrics = {n for c in containers(ps, init=False) for name, n in container_ports(c).items()
                   if METRICS_PORT_NAME.fullmatch(name or "")}
        may = dict(allowed.get(id(ps), {}), Prometheus=metrics)
        for who, source in OUTSIDERS.items():
            for port in sorted(ports | {EPHEMERAL_PORT}):
                if port not in may.get(who, set()) and admits(ctx, pm, ps, source, port, own):
                    case.error(obj, f"port {port} is open to {who}")


TENANTS_SECRET = "offload-tenants"
TENANTS_EXAMPLE = "k8s/base/tenants-example.yaml"
TENANT_KEYS = {"name", "weight", "max_optimizer_servers", "max_ranks", "max_running_jobs",
               "admin", "tokens"}


def check_tenants(case, ctx):
    """The controller's --tenants_file lies in the optional Secret offload-tenants, and
    k8s/base/tenants-example.yaml is that Secret with a file the controller would parse and no
    token anyone could use."""
    for obj, _, ps in ctx["pods"]:
        for c in containers(ps, init=False):
            if binary(c) != "job_controller":
                continue
            path = flags(c).get("tenants_file")
            if not path:
                case.error(obj, f"container {c.get('name')}: no --tenants_file")
                continue
            directory, _, key = path.rpartition("/")
            m = mounts(c).get(directory)
            secret = d(d(volumes(ps).get(m.get("name")) if m else None).get("secret"))
            if secret.get("secretName") != TENANTS_SECRET or secret.get("optional") is not True \
                    or not (m or {}).get("readOnly"):
                case.error(obj, f"container {c.get('name')}: --tenants_file is not in the Secret "
                                f"{TENANTS_SECRET} mounted read-only at {directory} with optional: true")
            check_tenants_example(case, key)


def check_tenants_example(case, key):
    where = TENANTS_EXAMPLE
    try:
        with open(os.path.join(case.repo, TENANTS_EXAMPLE), encoding="utf-8") as f:
            docs = [o for o in yaml.safe_load_all(f) if o is not None]
    except (OSError, yaml.YAMLError) as e:
        case.problems.append(f"{where}: cannot read it: {e}")
        return
    if len(docs) != 1 or d(docs[0]).get("kind") != "Secret" or \
            d(d(docs[0]).get("metadata")).get("name") != TENANTS_SECRET:
        case.problems.append(f"{where}: is not one Secret named {TENANTS_SECRET}")
        return
    text = d(d(docs[0]).get("stringData")).get(key)
    if not isinstance(text, str):
        case.problems.append(f"{where}: no stringData key {key} (the file --tenants_file names)")
        return
    try:
        tenants = json.loads(text).get("tenants")
    except (ValueError, AttributeError) as e:
        case.problems.append(f"{where}: {key} is not the JSON of a TenantsFile: {e}")
        return
    names = set()
    for i, t in enumerate(lst(tenants)):
        t = d(t)
        name = t.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9-]{1,63}", name) or name in names:
            case.problems.append(f"{where}: tenant {i}: name {name!r} is not a new [a-z0-9-]{{1,63}}")
        names.add(name)
        if set(t) - TENANT_KEYS:
            case.problems.append(f"{where}: tenant {name}: unknown keys {sorted(set(t) - TENANT_KEYS)}")
        # Placeholders only: a token shorter than 16 characters is refused by the controller, so
        # the example applied as it is gives no one access.
        if any(not isinstance(tok, str) or len(tok) >= 16 for tok in lst(t.get("tokens"))):
            case.problems.append(f"{where}: tenant {name}: a token that is not a placeholder "
                                 "(shorter than 16 characters)")
    if not names:
        case.problems.append(f"{where}: {key} lists no tenant")


def metrics_table(repo):
    """{job: (port number, port name)} from the scrape-job table of docs/METRICS.md."""
    jobs = {}
    with open(os.path.join(repo, "docs/METRICS.md"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|.*\|\s*(\d+)\s*(?:\(`([a-z0-9-]+)`\))?\s*\|\s*$", line)
            if m:
                jobs[m.group(1)] = (int(m.group(2)), m.group(3))
    return jobs


def guarded(case, check, *args):
    """Runs one check; a malformed object (the schema check reports it) must not end the run."""
    try:
        check(case, *args)
    except Exception as e:  # noqa: BLE001
        where = oid(args[0]) if args and isinstance(args[0], dict) and "kind" in args[0] else "(all)"
        case.problems.append(f"{where}: {check.__name__} could not check it: {type(e).__name__}: {e}")


def check_case(case, metrics_jobs):
    ctx = {"pods": [], "services": {}, "pdbs": [], "monitors": [], "rules": [], "configmaps": {},
           "netpols": []}
    for obj in case.objects:
        kind = obj.get("kind")
        if not isinstance(kind, str):
            case.problems.append(f"{oid(obj)}: no kind")
            continue
        name = d(obj.get("metadata")).get("name")
        if not isinstance(name, str):
            case.problems.append(f"{oid(obj)}: no name")
            continue
        pod_meta, pod_spec = pod_template(obj)
        if pod_spec is not None:
            ctx["pods"].append((obj, pod_meta, pod_spec))
        elif kind == "Service":
            ctx["services"][name] = obj
        elif kind == "PodDisruptionBudget":
            ctx["pdbs"].append(obj)
        elif kind in ("PodMonitor", "ServiceMonitor"):
            ctx["monitors"].append(obj)
        elif kind == "PrometheusRule":
            ctx["rules"].append(obj)
        elif kind == "ConfigMap":
            ctx["configmaps"][name] = obj
        elif kind == "NetworkPolicy":
            ctx["netpols"].append(obj)
    guarded(case, check_labels)
    for obj, pod_meta, pod_spec in ctx["pods"]:
        guarded(case, check_security, obj, pod_spec)
        guarded(case, check_resources, obj, pod_spec)
        guarded(case, check_volumes, obj, pod_spec)
        guarded(case, check_token, obj, pod_spec)
        guarded(case, check_roles, obj, pod_meta, pod_spec, ctx, metrics_jobs)
    for role in ("job_controller", "cpu_optimizer_server", "gpu_trainer"):
        if not any(binary(c) == role for _, _, ps in ctx["pods"] for c in containers(ps)):
            case.problems.append(f"(layout): nothing runs {role}")
    guarded(case, check_pod_security, ctx)
    guarded(case, check_monitoring, ctx, metrics_jobs)
    guarded(case, check_rules, ctx)
    guarded(case, check_example_job, ctx)
    guarded(case, check_network_policies, ctx)
    guarded(case, check_tenants, ctx)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--json-dir", required=True)
    parser.add_argument("cases", nargs="+", metavar="CASE=rendered.yaml")
    args = parser.parse_args()
    metrics_jobs = metrics_table(args.repo)
    if not metrics_jobs:
        print("check_manifests: no scrape-job table in docs/METRICS.md", file=sys.stderr)
        return 2
    for arg in args.cases:
        name, _, path = arg.partition("=")
        with open(path, encoding="utf-8") as f:
            try:
                objects = [o for o in yaml.safe_load_all(f) if o is not None]
            except yaml.YAMLError as e:
                print(f"{name}\t(all): rendered YAML does not parse: {e}")
                continue
        with open(os.path.join(args.json_dir, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(objects, f)
        case = Case(name, [o for o in objects if isinstance(o, dict)], args.repo)
        check_case(case, metrics_jobs)
        for problem in case.problems:
            print(f"{name}\t{problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
