#!/usr/bin/env python3
"""Turns the rendered k8s/ base into what tests/container_test.sh runs with podman or docker.

  pods.py run-args RENDERED.yaml WORKLOAD [--env K=V]... [--volume NAME=HOST_PATH]...
      Prints, one per line, the `run` arguments that start the first container of WORKLOAD's
      pod template as Kubernetes would: its command and args with $(VAR) expanded from its env,
      its env (fieldRef values given by --env), its security context (user, read-only root,
      capabilities, no privilege escalation), emptyDirs as tmpfs and the other volumes
      (secret, configMap, persistentVolumeClaim) bound from --volume; an optional Secret or
      ConfigMap without a --volume is an empty read-only tmpfs (what the kubelet mounts while
      the object does not exist). Ends with the entrypoint, the image placeholder IMAGE and the
      arguments.

  pods.py kube RENDERED.yaml IMAGE OPTIMIZERS JOB_YAML OUT.yaml EMPTY_DIR_ROOT
      Writes RENDERED adapted to `podman kube play` (podman 4.3) and prints each adaptation:
      OPTIMIZERS pods of the optimizer StatefulSet, the example job's ConfigMap holding JOB_YAML,
      emptyDirs as directories under EMPTY_DIR_ROOT.

A kind, an env source or a volume the adaptation does not know is an error, so a manifest change
that it would silently drop fails the test instead.
"""

import copy
import os
import re
import sys

import yaml

VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def workload(docs, name):
    for d in docs:
        if d["metadata"]["name"] == name and d["kind"] in ("Deployment", "StatefulSet", "Job"):
            return d
    sys.exit(f"pods.py: no Deployment, StatefulSet or Job named {name}")


def expand(text, env):
    return VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container, given):
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "valueFrom" in e:
            if e["name"] not in given:
                sys.exit(f"pods.py: {e['name']} comes from {e['valueFrom']}: pass --env {e['name']}=...")
            env[e["name"]] = given[e["name"]]
        else:
            sys.exit(f"pods.py: env {e['name']} has neither value nor valueFrom")
    for k, v in given.items():
        env.setdefault(k, v)  # e.g. JOB_COMPLETION_INDEX, which Kubernetes sets itself
    return env


def run_args(rendered, name, given, volumes):
    spec = workload(load(rendered), name)["spec"]["template"]["spec"]
    c = spec["containers"][0]
    sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
    args = []
    if "runAsUser" in sc:
        args.append(f"--user={sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}")
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args.append("--security-opt=no-new-privileges")
    for cap in sc.get("capabilities", {}).get("drop", []):
        args.append(f"--cap-drop={cap}")
    for cap in sc.get("capabilities", {}).get("add", []):
        args.append(f"--cap-add={cap}")
    env = container_env(c, given)
    for k, v in env.items():
        args.append(f"--env={k}={v}")
    by_name = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        vol = by_name[m["name"]]
        path = m["mountPath"]
        if "emptyDir" in vol:
            size = str(vol["emptyDir"].get("sizeLimit", "64Mi")).replace("Mi", "m").replace("Gi", "g")
            args.append(f"--tmpfs={path}:rw,size={size},mode=1777")
        elif m["name"] in volumes:
            ro = ",ro" if m.get("readOnly") else ""
            args.append(f"--volume={volumes[m['name']]}:{path}:Z{ro}")
        elif vol.get("secret", vol.get("configMap", {})).get("optional") is True:
            args.append(f"--tmpfs={path}:ro,size=1m,mode=0755")
        else:
            sys.exit(f"pods.py: volume {m['name']} ({sorted(vol)}) of {name}: pass --volume {m['name']}=HOST_PATH")
    args.append(f"--entrypoint={c['command'][0]}")
    args.append("IMAGE")
    args.extend(expand(a, env) for a in c["command"][1:] + c.get("args", []))
    print("\n".join(args))


def kube(rendered, image, optimizers, job_yaml, out, empty_dirs):
    """podman 4.3 runs Pods, Deployments, PVCs, ConfigMaps and Secrets; the rest is adapted."""
    notes = []

    def note(text):
        if text not in notes:
            notes.append(text)

    docs = load(rendered)
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    played = []

    def pod(name, template, env):
        p = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": name, "labels": template["metadata"].get("labels", {})},
             "spec": copy.deepcopy(template["spec"])}
        spec = p["spec"]
        # podman 4.3 resolves neither status.podIP nor metadata.name: literal values.
        for c in spec["containers"]:
            for e in c.get("env", []):
                if "valueFrom" in e:
                    e.pop("valueFrom")
                    e["value"] = env[e["name"]]
                    note(f"env {e['name']} from a fieldRef -> a literal value (podman 4.3 has no downward API)")
            for k, v in env.items():
                if k not in {e["name"] for e in c.get("env", [])}:
                    c.setdefault("env", []).append({"name": k, "value": v})
        return p

    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("Namespace", "ServiceAccount", "PodMonitor", "PrometheusRule",
                    "PodDisruptionBudget", "NetworkPolicy"):
            note(f"{kind} dropped (no such object in podman)")
            continue
        if kind == "Service":
            note("Services dropped: pods reach each other by pod name on podman's network")
            continue
        if kind in ("ConfigMap", "PersistentVolumeClaim"):
            played.append(d)
            continue
        if kind == "Deployment":
            # One replica: a Pod of the Deployment's name, so the Service's name resolves.
            played.append(pod(name, d["spec"]["template"], {}))
            note("Deployment -> one Pod named like its Service (podman 4.3 names a Deployment's pod <name>-pod-0)")
            continue
        if kind == "StatefulSet":
            note(f"StatefulSet -> {optimizers} Pods <name>-<i> (podman 4.3 has no StatefulSet)")
            for i in range(optimizers):
                pn = f"{name}-{i}"
                played.append(pod(pn, d["spec"]["template"], {"POD_NAME": pn}))
            continue
        if kind == "Job":
            note("Indexed Job -> Pods <name>-<i> with JOB_COMPLETION_INDEX=i (podman 4.3 has no Job)")
            for i in range(d["spec"].get("parallelism", 1)):
                pn = f"{name}-{i}"
                played.append(pod(pn, d["spec"]["template"],
                                  {"JOB_COMPLETION_INDEX": str(i), "POD_IP": pn}))
            continue
        sys.exit(f"pods.py: no podman adaptation for {kind} {name}")

    for p in played:
        if p["kind"] != "Pod":
            continue
        spec = p["spec"]
        for c in spec["containers"]:
            c["image"] = image
            # <pod>.<headless service> names -> pod names.
            new_args = []
            for a in c.get("args", []):
                b = a
                for s in services:
                    b = re.sub(r"\.%s(?=:|$)" % re.escape(s), "", b)
                if b != a:
                    note(f"<pod>.{{service}} DNS names -> pod names ({a} -> {b})")
                new_args.append(b)
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            expanded = [expand(a, env) for a in new_args]
            if expanded != new_args:
                note("$(VAR) in args expanded here (podman 4.3 passes them on as they stand)")
            c["args"] = expanded
            for probe in ("readinessProbe", "livenessProbe"):
                if "grpc" in c.get(probe, {}):
                    c.pop(probe)
                    note(f"gRPC {probe}s dropped (podman 4.3 has no gRPC probe); the test polls /healthz")
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                tcp = c.get(probe, {}).get("tcpSocket")
                if tcp and tcp["port"] in ports:
                    tcp["port"] = ports[tcp["port"]]
                    note("probes' named ports -> numbers (the ports are dropped, below)")
            # containerPort: podman 4.3 publishes it on the host, so replicas would collide.
            if c.pop("ports", None) is not None:
                note("containerPorts dropped (podman 4.3 binds them on the host; replicas collide)")
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                if part in res:
                    res[part].pop("nvidia.com/gpu", None)
                    if "cpu" in res[part]:
                        res[part]["cpu"] = "1"
                    if "memory" in res[part]:
                        res[part]["memory"] = "4Gi"
            note("resources scaled to 1 CPU and 4Gi, no nvidia.com/gpu (a 2-core machine without a GPU)")
        for v in spec.get("volumes", []):
            if "emptyDir" in v:
                # Kubernetes makes an emptyDir mode 0777; podman 4.3 makes it root's, 0755, so
                # uid 10001 could not write its /dev/shm or /tmp.
                path = os.path.join(empty_dirs, p["metadata"]["name"], v["name"])
                os.makedirs(path, exist_ok=True)
                os.chmod(path, 0o1777)
                v.pop("emptyDir")
                v["hostPath"] = {"path": path, "type": "Directory"}
                note("emptyDirs -> host directories of mode 1777 (podman 4.3 makes them root's, "
                     "0755, where Kubernetes makes them 0777)")
            if v.get("secret", {}).get("optional") is True:
                # The test makes only offload-token; the kubelet mounts an empty directory for
                # an optional Secret that does not exist (offload-tenants).
                path = os.path.join(empty_dirs, p["metadata"]["name"], v["name"])
                os.makedirs(path, exist_ok=True)
                v.pop("secret")
                v["hostPath"] = {"path": path, "type": "Directory"}
                note("optional Secrets -> empty host directories (the test makes only "
                     "offload-token; the kubelet mounts an empty directory for a missing one)")
            if "secret" in v and "optional" not in v["secret"]:
                v["secret"]["optional"] = False
                note("secret volumes say optional: false (podman 4.3 crashes on a secret volume "
                     "without it, its issue 16636)")
        spec.pop("serviceAccountName", None)
        spec.pop("subdomain", None)
        spec.pop("enableServiceLinks", None)
        spec.pop("fsGroupChangePolicy", None)
        spec["restartPolicy"] = "Never"

    for d in played:
        if d["kind"] == "ConfigMap" and "job.yaml" in d.get("data", {}):
            with open(job_yaml) as f:
                d["data"]["job.yaml"] = f.read()
            note("the example job's ConfigMap holds the test's job (CPU, short, optimizer_servers as played)")

    with open(out, "w") as f:
        yaml.safe_dump_all(played, f, sort_keys=False)
    for n in notes:
        print(n)


def main(argv):
    if len(argv) >= 3 and argv[0] == "run-args":
        given, volumes = {}, {}
        rest = argv[3:]
        while rest:
            flag, value = rest[0], rest[1]
            k, v = value.split("=", 1)
            (given if flag == "--env" else volumes)[k] = v
            rest = rest[2:]
        run_args(argv[1], argv[2], given, volumes)
    elif len(argv) == 7 and argv[0] == "kube":
        kube(argv[1], argv[2], int(argv[3]), argv[4], argv[5], argv[6])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
