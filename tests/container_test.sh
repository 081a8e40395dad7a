#!/usr/bin/env bash
# The image and the k8s/ manifests, run for real with podman (or docker) on this machine.
#
#   tests/container_test.sh [REPO_ROOT [BUILD_DIR]]
#
# Skips (exit 77, a line saying why) where neither podman nor docker can run a container, or
# kubectl is missing. Otherwise:
#   1. builds the image (scripts/build-image; OFFLOAD_CONTAINER_IMAGE=NAME:TAG reuses one);
#   2. every program in it starts (--help) as uid 10001 on a read-only root, and `ldd` finds every
#      library (libcuda, the node's driver, is the one exception);
#   3. the controller, two optimizer servers and a trainer worker run as containers with the
#      commands, flags, env, volumes and security context of `kubectl kustomize k8s/base`
#      (tests/container/pods.py run-args), on a network of their own where each has its pod's
#      DNS name; the demo job (the base's example job on the CPU, short) is submitted with curl
#      to the REST port and reaches SUCCEEDED;
#   4. the same job again, with one optimizer server's container killed (SIGKILL) after the first
#      checkpoint and started again, as its StatefulSet would: the job restarts from the
#      checkpoint, succeeds, and its final checkpoint equals run 3's byte for byte;
#   5. the torch image (scripts/build-image --torch; OFFLOAD_CONTAINER_TORCH_IMAGE=NAME:TAG reuses
#      one): python3 loads offload.torch and liboffload_c.so as uid 10001 on a read-only root;
#      then the controller, an optimizer server and a trainer worker as `kubectl kustomize
#      k8s/overlays/torch` runs them (the trainer on the torch image) train the overlay's example
#      torch job (short) to SUCCEEDED through the REST port, and again with the script taken from
#      the scripts ConfigMap's mount (/etc/offload/scripts), ending with the same weights;
#   6. with podman: `podman kube play` of the rendered base with two optimizer pods (adapted
#      where podman 4.3 differs from Kubernetes; pods.py kube prints each adaptation) trains the
#      same job to SUCCEEDED through the played controller's REST port;
#   7. the same with the single-node overlay, whose trainer must pick the shared-memory data
#      plane to the shard in its own pod.
# Everything it starts (containers, pods, networks, volumes) is removed at the end.
set -euo pipefail

root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
[ -n "${2:-}" ] && export OFFLOAD_BUILD_DIR=$2  # the tree scripts/build-image takes programs from
cd "$root"
python=/usr/bin/python3
[ -x "$python" ] || python=python3

# shellcheck source=../scripts/container-engine.sh
. scripts/container-engine.sh
if ! pick_container_engine; then
  echo "SKIP: container_test: $WHY (scripts/build-image installs podman; then run this test)"
  exit 77
fi
command -v kubectl >/dev/null || { echo "SKIP: container_test: kubectl not found (renders k8s/base)"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: container_test: curl not found"; exit 77; }

# final_files and same_checkpoint (the step-$steps checkpoints, byte for byte); this script's
# own cleanup and fail, defined below, replace the library's.
steps=60
# shellcheck source=process_lib.sh
. tests/process_lib.sh

passed=0
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
step() { echo "--- $*"; }

id=oct$$
work=$(mktemp -d "${TMPDIR:-/tmp}/container_test.XXXXXX")
net=$id-net
kube_net=$id-kube
kube_yaml=""
kube_volumes=""
built_image=""
built_torch_image=""
cleanup() {
  set +e
  if [ -n "$kube_yaml" ] && [ "$ENGINE" = podman ]; then
    podman kube down "$kube_yaml" >/dev/null 2>&1
    podman secret rm offload-token >/dev/null 2>&1
    # podman 4.3's kube down leaves the volumes kube play made (PVCs, ConfigMaps) behind.
    for v in $kube_volumes; do podman volume rm -f "$v" >/dev/null 2>&1; done
  fi
  $ENGINE ps -aq --filter label=offload-test="$id" | xargs -r $ENGINE rm -f >/dev/null 2>&1
  $ENGINE network rm -f "$net" >/dev/null 2>&1
  [ "$ENGINE" = podman ] && podman network rm -f "$kube_net" >/dev/null 2>&1
  # The images this run built (1-3 GB); their base and package layers stay cached for the next.
  # The torch image first: it is the other's child.
  [ -n "$built_torch_image" ] && $ENGINE rmi "$built_torch_image" >/dev/null 2>&1
  [ -n "$built_image" ] && $ENGINE rmi "$built_image" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  local filters=(--filter label=offload-test="$id")
  [ -n "$kube_yaml" ] && filters=(--filter network="$kube_net")
  for c in $($ENGINE ps -a --format '{{.Names}}' "${filters[@]}" 2>/dev/null | grep -v -- -infra); do
    echo "  --- $c (last 15 lines)"
    $ENGINE logs "$c" 2>&1 | tail -15 | sed 's/^/  /'
  done
  echo "$passed passed, 1 failed"
  exit 1
}

# --- 1. the image -----------------------------------------------------------------------------
image=${OFFLOAD_CONTAINER_IMAGE:-}
if [ -z "$image" ]; then
  step "building the image"
  ./scripts/build-image >"$work/build-image.log" 2>&1 || { tail -30 "$work/build-image.log"; fail "scripts/build-image"; }
  last=$(tail -1 "$work/build-image.log")
  echo "$last"
  image=$(echo "$last" | sed -n 's/^build-image: \([^ ]*\) (.*/\1/p')
  [ -n "$image" ] || fail "build-image printed no image name: $last"
  built_image=$image
fi
$ENGINE image inspect "$image" >/dev/null 2>&1 || fail "no image $image"
pass "image $image"

# --- 2. every program starts ------------------------------------------------------------------
secure=(--user=10001:10001 --read-only --tmpfs=/tmp:rw,size=64m --cap-drop=ALL
        --security-opt=no-new-privileges --network=none --label=offload-test="$id")
for p in job_controller cpu_optimizer_server gpu_trainer offloadctl; do
  rc=0
  $ENGINE run --rm "${secure[@]}" "$image" "/opt/offload/bin/$p" --help >"$work/help.$p" 2>&1 || rc=$?
  # absl's --help exits 1 after the usage text; a missing library or program is 127.
  { [ "$rc" -le 1 ] && grep -q "$p" "$work/help.$p"; } ||
    fail "$p --help exited $rc: $(head -3 "$work/help.$p")"
done
$ENGINE run --rm "${secure[@]}" --entrypoint=/bin/sh "$image" -c \
  'ldd /opt/offload/bin/* | grep -v "libcuda\.so" | grep "not found"; ldd /opt/offload/bin/* | grep -c "=> /"' \
  >"$work/ldd" 2>&1 || true
grep -q "not found" "$work/ldd" && fail "unresolved libraries: $(grep 'not found' "$work/ldd" | sort -u)"
pass "every program starts as uid 10001 on a read-only root; ldd resolves $(tail -1 "$work/ldd") libraries"

# --- the rendered base, the token, the job ----------------------------------------------------
kubectl kustomize k8s/base >"$work/base.yaml"
token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
mkdir -p "$work/token" "$work/jobs" "$work/checkpoints" "$work/store" "$work/scripts"
echo "$token" >"$work/token/token"
# Kubernetes gives the pods' fsGroup (10001) the volumes; here the host directories.
chown -R 10001:10001 "$work/token" "$work/checkpoints" "$work/store"
chmod 0440 "$work/token/token"

# The base's example job (its ConfigMap), made short and put on the CPU (no GPU here), with the
# optimizer servers this test runs.
job_yaml() {  # name optimizer_servers -> job file on stdout
  "$python" - "$work/base.yaml" "$1" "$2" "$steps" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "offload-example-job")
job = yaml.safe_load(cm["data"]["job.yaml"])
job["name"] = sys.argv[2]
job["training"].update(device="cpu", steps=int(sys.argv[4]), batch=8, seq_len=64)
job["eval"] = {"every": 0, "batches": 1, "sample_tokens": 0}
job["parallel"]["optimizer_servers"] = int(sys.argv[3])
job["checkpoint"]["dir"] += "-" + sys.argv[2]
job["checkpoint"]["every"] = 20
print(yaml.safe_dump(job, sort_keys=False), end="")
PY
}
job_json() { job_yaml "$@" | "$python" -c 'import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))'; }

json() { "$python" -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"; }
get() { curl -sS -m 5 -H "Authorization: Bearer $token" "http://$http$1"; }
post() { curl -sS -m 5 -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -d "$2" "http://$http$1"; }
submit() {  # name optimizer_servers: POSTs the demo job to $http, sets job_id
  local reply
  reply=$(post /v1/jobs "$(job_json "$1" "$2")" 2>&1) || true
  job_id=$(echo "$reply" | json "['id']" 2>/dev/null) || fail "POST /v1/jobs to $http: $reply"
}
state_of() { get "/v1/jobs/$1" | json "['state']" 2>/dev/null || echo unknown; }
wait_state() {  # job state timeout_s
  local deadline=$((SECONDS + $3)) s
  while [ $SECONDS -lt $deadline ]; do
    s=$(state_of "$1")
    [ "$s" = "$2" ] && return 0
    case "$s" in JOB_STATE_FAILED | JOB_STATE_CANCELLED) break ;; esac
    sleep 1
  done
  get "/v1/jobs/$1/events" >"$work/events.json" 2>&1 || true
  fail "job $1 did not reach $2 (it is $(state_of "$1")): $(tail -c 1500 "$work/events.json")"
}
wait_http() {
  for _ in $(seq 120); do
    curl -s -m 2 -o /dev/null "http://$http/healthz" && return 0
    sleep 0.5
  done
  fail "the controller's REST port $http never answered"
}
# --- 3. the manifests' commands as containers --------------------------------------------------
step "controller, two optimizer servers and a trainer worker as containers (k8s/base's commands)"
subnet=10.$((200 + RANDOM % 50)).$((RANDOM % 250)).
$ENGINE network create --subnet "${subnet}0/24" --label offload-test="$id" "$net" >/dev/null
declare -A ip=([offload-controller]=${subnet}10 [offload-optimizer-0]=${subnet}20
               [offload-optimizer-1]=${subnet}21 [offload-trainer-0]=${subnet}30)
# The names the pods have in a cluster: Services and <pod>.<headless service>.
hosts=(--add-host="offload-controller:${ip[offload-controller]}"
       --add-host="offload-optimizer-0.offload-optimizer:${ip[offload-optimizer-0]}"
       --add-host="offload-optimizer-1.offload-optimizer:${ip[offload-optimizer-1]}"
       --add-host="offload-trainer-0.offload-trainer:${ip[offload-trainer-0]}")
# The manifests start() runs, and the trainer's image (step 5 switches both to the torch overlay).
rendered=$work/base.yaml
trainer_image=$image
start() {  # pod workload [--env K=V]...: runs the workload's container as pod
  local pod=$1 workload=$2
  shift 2
  local args
  mapfile -t args < <("$python" tests/container/pods.py run-args "$rendered" "$workload" "$@" \
    --volume token="$work/token" --volume jobs="$work/jobs" --volume store="$work/store" \
    --volume checkpoints="$work/checkpoints" --volume scripts="$work/scripts")
  [ ${#args[@]} -gt 0 ] || fail "pods.py run-args $workload"
  local i img=$image
  [ "$workload" = offload-trainer ] && img=$trainer_image
  for i in "${!args[@]}"; do [ "${args[$i]}" = IMAGE ] && args[$i]=$img; done
  $ENGINE run -d --name "$id-$pod" --hostname "$pod" --label offload-test="$id" \
    --network "$net" --ip "${ip[$pod]}" "${hosts[@]}" "${args[@]}" >/dev/null ||
    fail "starting $pod"
}
start offload-controller offload-controller
start offload-optimizer-0 offload-optimizer --env POD_NAME=offload-optimizer-0
start offload-optimizer-1 offload-optimizer --env POD_NAME=offload-optimizer-1
start offload-trainer-0 offload-trainer --env POD_IP="${ip[offload-trainer-0]}" --env JOB_COMPLETION_INDEX=0
http=${ip[offload-controller]}:8080
wait_http
pass "the four containers run; the controller answers on $http"
# k8s/README.md's way to reach the controller: offloadctl inside its pod, with the pod's token.
$ENGINE exec "$id-offload-controller" /opt/offload/bin/offloadctl --controller=127.0.0.1:7070 \
  --token_file=/etc/offload/token/token list >"$work/list" 2>&1 ||
  fail "offloadctl list in the controller container (k8s/README.md): $(cat "$work/list")"

step "the demo job through REST (curl), uninterrupted"
submit ct-a 2
job_a=$job_id
wait_state "$job_a" JOB_STATE_SUCCEEDED 300
[ "$(get "/v1/jobs/$job_a" | json "['progress']['step']")" = "$steps" ] ||
  fail "job $job_a did not end at step $steps"
[ -f "$work/checkpoints/demo-ct-a/$(printf 'step-%08d' "$steps")/manifest.json" ] ||
  fail "no final checkpoint of $job_a"
pass "job $job_a SUCCEEDED at step 60 on two containerised optimizer servers"

# --- 4. a killed optimizer server ----------------------------------------------------------------
step "the same job, one optimizer server's container killed after the first checkpoint"
submit ct-b 2
job_b=$job_id
for _ in $(seq 600); do
  [ -s "$work/checkpoints/demo-ct-b/latest" ] && break
  sleep 0.2
done
[ -s "$work/checkpoints/demo-ct-b/latest" ] || fail "job $job_b wrote no checkpoint"
$ENGINE kill --signal KILL "$id-offload-optimizer-1" >/dev/null
sleep 1
$ENGINE start "$id-offload-optimizer-1" >/dev/null || fail "restarting offload-optimizer-1"
wait_state "$job_b" JOB_STATE_SUCCEEDED 300
get "/v1/jobs/$job_b/events" >"$work/events-b.json"
reason=$("$python" -c 'import json, sys
ev = json.load(open(sys.argv[1]))["events"]
print(next(e["message"] for e in ev if "restart" in e["message"].lower()))' "$work/events-b.json") ||
  fail "job $job_b never restarted: $(cat "$work/events-b.json")"
echo "  restart reason: $reason"
# Issue 30: the reason named the shard twice ("optimizer shard X: optimizer shard X went away").
n=$(grep -o "offload-optimizer-1[.a-z-]*:50051" <<<"$reason" | wc -l)
[ "$n" -le 1 ] || fail "the restart reason names the shard $n times: $reason"
same_checkpoint "$work/checkpoints/demo-ct-a" "$work/checkpoints/demo-ct-b" \
  "killed and restarted against uninterrupted"
pass "job $job_b restarted from its checkpoint and ended with run 3's bytes ($(ls "$(final_files "$work/checkpoints/demo-ct-b")" | wc -l) files)"
$ENGINE ps -aq --filter label=offload-test="$id" | xargs -r $ENGINE rm -f >/dev/null
$ENGINE network rm -f "$net" >/dev/null

# --- 5. the torch image and k8s/overlays/torch ------------------------------------------------
torch_image=${OFFLOAD_CONTAINER_TORCH_IMAGE:-}
if [ -z "$torch_image" ]; then
  step "building the torch image"
  ./scripts/build-image --torch >"$work/build-torch.log" 2>&1 ||
    { tail -30 "$work/build-torch.log"; fail "scripts/build-image --torch"; }
  last=$(tail -1 "$work/build-torch.log")
  echo "$last"
  torch_image=$(echo "$last" | sed -n 's/^build-image: \([^ ]*\) (.*/\1/p')
  [ -n "$torch_image" ] || fail "build-image --torch printed no image name: $last"
  built_torch_image=$torch_image
fi
$ENGINE image inspect "$torch_image" >/dev/null 2>&1 || fail "no image $torch_image"
$ENGINE run --rm "${secure[@]}" --entrypoint=/bin/sh "$torch_image" -c \
  'ldd /usr/lib/python3/dist-packages/offload/lib/liboffload_c.so | grep -v "libcuda\.so" | grep "not found"
   python3 -c "import offload.torch, offload.native as l; l.lib(); print(l.server_binary())"' \
  >"$work/torch-import" 2>&1 || true
grep -q "=> not found" "$work/torch-import" &&
  fail "unresolved libraries of liboffload_c.so: $(grep '=> not found' "$work/torch-import" | sort -u)"
grep -qx /usr/lib/python3/dist-packages/offload/bin/cpu_optimizer_server "$work/torch-import" ||
  fail "offload.torch in $torch_image as uid 10001 on a read-only root: $(tail -5 "$work/torch-import")"
pass "torch image $torch_image: offload.torch and liboffload_c.so load as uid 10001 on a read-only root"

step "controller, an optimizer server and a torch trainer as containers (k8s/overlays/torch)"
kubectl kustomize k8s/overlays/torch >"$work/torch.yaml"
rendered=$work/torch.yaml
trainer_image=$torch_image
# What `kubectl create configmap offload-torch-scripts --from-file=train.py` would mount.
cp examples/torch_job.py "$work/scripts/train.py"
chmod 0755 "$work/scripts"
chmod 0644 "$work/scripts/train.py"
# The overlay's example torch job, short, with SCRIPT (if given) in place of its script and a
# checkpoint directory of its own; rank 0 writes the final weights next to the checkpoints.
torch_job_json() {  # name [script] -> JSON on stdout
  "$python" - "$work/torch.yaml" "$1" "$2" "$steps" <<'PY'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "offload-example-job")
job = yaml.safe_load(cm["data"]["job.yaml"])
name, script, steps = sys.argv[2], sys.argv[3], sys.argv[4]
job["name"] = name
job["checkpoint"]["dir"] += "-" + name
command = [(script or a) if a.endswith(".py") else a for a in job["torch"]["command"]
           if not a.startswith(("--steps=", "--checkpoint_every=", "--out="))]
job["torch"]["command"] = command + [f"--steps={steps}", "--checkpoint_every=20",
                                     f"--out={job['checkpoint']['dir']}/final.safetensors"]
print(json.dumps(job))
PY
}
submit_torch() {  # name [script]: POSTs the torch job to $http, sets job_id
  local reply
  reply=$(post /v1/jobs "$(torch_job_json "$1" "${2:-}")" 2>&1) || true
  job_id=$(echo "$reply" | json "['id']" 2>/dev/null) || fail "POST /v1/jobs to $http: $reply"
}
$ENGINE network create --subnet "${subnet}0/24" --label offload-test="$id" "$net" >/dev/null
start offload-controller offload-controller
start offload-optimizer-0 offload-optimizer --env POD_NAME=offload-optimizer-0
# OMP_NUM_THREADS comes from the CPU limit in a cluster (a resourceFieldRef, which `run` has not);
# one thread here, where three containers share two cores.
start offload-trainer-0 offload-trainer --env POD_IP="${ip[offload-trainer-0]}" \
  --env JOB_COMPLETION_INDEX=0 --env OMP_NUM_THREADS=1
wait_http

step "the torch overlay's example job through REST (curl): the script the image ships"
submit_torch ct-t
job_t=$job_id
wait_state "$job_t" JOB_STATE_SUCCEEDED 300
[ "$(get "/v1/jobs/$job_t" | json "['progress']['step']")" = "$steps" ] ||
  fail "torch job $job_t did not end at step $steps: $(get "/v1/jobs/$job_t")"
[ "$(get "/v1/jobs/$job_t" | json "['progress']['last_checkpoint_step']")" = "$steps" ] ||
  fail "torch job $job_t has no checkpoint of step $steps: $(get "/v1/jobs/$job_t")"
[ -s "$work/checkpoints/torch-demo-ct-t/final.safetensors" ] || fail "torch job $job_t wrote no final weights"
pass "torch job $job_t SUCCEEDED at step $steps: the shipped script on the torch trainer image"

step "the same job with the script from the scripts ConfigMap's mount"
submit_torch ct-u /etc/offload/scripts/train.py
wait_state "$job_id" JOB_STATE_SUCCEEDED 300
cmp "$work/checkpoints/torch-demo-ct-t/final.safetensors" \
  "$work/checkpoints/torch-demo-ct-u/final.safetensors" ||
  fail "the script from /etc/offload/scripts ended with other weights than the shipped one"
pass "torch job $job_id SUCCEEDED with /etc/offload/scripts/train.py, the same final weights"
$ENGINE ps -aq --filter label=offload-test="$id" | xargs -r $ENGINE rm -f >/dev/null
$ENGINE network rm -f "$net" >/dev/null
rendered=$work/base.yaml
trainer_image=$image

# --- 6, 7. podman kube play -------------------------------------------------------------------
if [ "$ENGINE" != podman ]; then
  echo "container_test: kube play needs podman (the engine here is $ENGINE); not run"
  echo "$passed passed, 0 failed"
  exit 0
fi
# kube_play OVERLAY OPTIMIZER_PODS NAME: plays the rendered overlay (adapted by pods.py kube, each
# adaptation printed), submits the demo job with OPTIMIZER_PODS servers through its REST port,
# waits for SUCCEEDED, and takes it all down again. Sets $trainer_log.
kube_play() {
  local overlay=$1 optimizers=$2 name=$3 rendered=$work/$3.yaml
  kubectl kustomize "k8s/$overlay" >"$rendered"
  job_yaml "$name" "$optimizers" >"$work/job-$name.yaml"
  kube_yaml=$work/kube-$name.yaml
  # What `kubectl create secret generic offload-token` makes in a cluster. First in the file:
  # podman 4.3 crashes on a pod whose secret volume names a Secret played after it. It writes a
  # Secret's data into the volume as it stands, not base64-decoded, so data holds the token.
  echo "  adapted: the Secret's data is the token, not its base64 (podman 4.3 does not decode it)"
  printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: offload-token\ndata:\n  token: %s\n---\n' \
    "$token" >"$kube_yaml"
  "$python" tests/container/pods.py kube "$rendered" "$image" "$optimizers" "$work/job-$name.yaml" \
    "$work/adapted-$name.yaml" "$work/empty-$name" | sed 's/^/  adapted: /'
  cat "$work/adapted-$name.yaml" >>"$kube_yaml"
  kube_volumes=$("$python" -c 'import sys, yaml
print(" ".join(d["metadata"]["name"] for d in yaml.safe_load_all(open(sys.argv[1]))
               if d and d["kind"] in ("PersistentVolumeClaim", "ConfigMap", "Secret")))' "$kube_yaml")
  for v in $kube_volumes; do
    podman volume exists "$v" && fail "podman already has a volume $v (left behind by an earlier run?)"
  done
  podman network exists "$kube_net" || podman network create --label offload-test="$id" "$kube_net" >/dev/null
  podman kube play --network "$kube_net" "$kube_yaml" >"$work/kube-play.log" 2>&1 ||
    { cat "$work/kube-play.log"; fail "podman kube play of k8s/$overlay"; }
  local ctl
  ctl=$(podman pod inspect offload-controller --format '{{.InfraContainerID}}') || fail "no controller pod"
  http=$(podman inspect "$ctl" --format "{{(index .NetworkSettings.Networks \"$kube_net\").IPAddress}}"):8080
  wait_http
  submit "$name" "$optimizers"
  wait_state "$job_id" JOB_STATE_SUCCEEDED 300
  trainer_log=$(podman logs offload-trainer-0-trainer 2>&1)
  podman kube down "$kube_yaml" >/dev/null 2>&1
  podman secret rm offload-token >/dev/null 2>&1
  for v in $kube_volumes; do podman volume rm -f "$v" >/dev/null 2>&1; done
  kube_yaml=""
}

step "podman kube play of k8s/base, two optimizer pods, the demo job through it"
kube_play base 2 ct-k
pass "podman kube play of k8s/base: job $job_id SUCCEEDED"

step "podman kube play of k8s/overlays/single-node: the shard in the trainer pod, shared memory"
kube_play overlays/single-node 1 ct-s
echo "$trainer_log" | grep -q "data plane shm" ||
  fail "the single-node trainer did not pick shared memory: $(echo "$trainer_log" | grep -m1 'data plane')"
pass "podman kube play of overlays/single-node: job $job_id SUCCEEDED over shared memory"
echo "$passed passed, 0 failed"
