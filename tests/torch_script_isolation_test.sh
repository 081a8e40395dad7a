#!/usr/bin/env bash
# A torch job's script as a user of its own (issue 60 part 1): a real job_controller, an optimizer
# server and trainer pool workers. tests/torch_script_probe.py, run as a torch job, tries to read
# the worker's token file and process (/proc environ, mem, fd), to signal it, to call the
# controller's WorkerService (register, heartbeat, rendezvous) and JobService with its shard secret
# and with every token it found, and to read the environment of another job's script running at
# the same time. Each try is a line of the job's output, named here.
#   control: a worker without --script_user: the probe reads the token and registers with it;
#   --script_user with a token file the scripts could read: the worker refuses to start, naming it;
#   --script_user=21000 --workers=3: two probe jobs at once, as uids 21000 and 21001, every try
#     refused and the token in no output; what a script leaves running is killed with its attempt;
#     a rank of one job can neither read another job's torch.distributed store nor join its
#     process group (issue 60 part 2), while the test, given that job's secret, reads the key;
#     examples/torch_job.py still trains to SUCCEEDED under its own user.
# usage: torch_script_isolation_test.sh CONTROLLER SERVER TRAINER REPO_ROOT BUILD_DIR
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 root=$4 build=$5
py=/usr/bin/python3
[ "$(id -u)" = 0 ] || { echo "SKIP: torch_script_isolation_test: switching users needs root"; exit 77; }
"$py" -c 'import grpc' 2>/dev/null || { echo "SKIP: torch_script_isolation_test: no grpcio"; exit 77; }
first_uid=21000
work=$(mktemp -d /tmp/offload-isolation-XXXXXX)
# The scripts' users reach the probe and the checkpoints, not the token.
chmod 0755 "$work"
mkdir -m 1777 "$work/ckpt"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pkill -9 -u "$first_uid,$((first_uid + 1)),$((first_uid + 2))" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do echo "--- $f" >&2; tail -n 60 "$f" >&2; done
  exit 1
}
step() { echo "== $*"; }

echo "operator-token-$$-$RANDOM$RANDOM" >"$work/token"
chmod 0644 "$work/token"
token=$(cat "$work/token")
unset OFFLOAD_TOKEN
export PYTHONPATH=$root/python OFFLOAD_BUILD_DIR=$build OMP_NUM_THREADS=1
probe=$root/tests/torch_script_probe.py

# start_pool NAME: a controller and two optimizer servers (the two probes below run at once, a
# job each); sets grpc and http. Each phase gets a pool of its own, so no job of it can be handed
# to a worker of the phase before, which the controller would still count for a while.
start_pool() {
  local line
  grpc= http=
  "$controller_bin" --grpc_address=127.0.0.1:0 --http_address=127.0.0.1:0 \
    --store="$work/$1-jobs.db" --token_file="$work/token" --heartbeat_interval=200ms \
    --heartbeat_timeout=3s >"$work/$1-controller.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    if line=$(grep -m1 '^job_controller: grpc ' "$work/$1-controller.log"); then
      grpc=$(awk '{print $3}' <<<"$line"); http=$(awk '{print $5}' <<<"$line"); break
    fi
    sleep 0.1
  done
  [ -n "$http" ] || fail "controller did not announce its address"
  for k in 1 2; do
    "$server_bin" --listen=127.0.0.1:0 --controller="$grpc" --token_file="$work/token" \
      --ucx=false >"$work/$1-server$k.log" 2>&1 &
    pids+=($!)
  done
}

json() { "$py" -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"; }
get() { curl -sS -H "Authorization: Bearer $token" "http://$http$1"; }
submit() {
  local answer
  answer=$(curl -sS -H "Authorization: Bearer $token" -d "$1" "http://$http/v1/jobs")
  json "['id']" <<<"$answer" || fail "submit refused: $answer"
}
wait_end() {  # job timeout_s: prints the final state
  local s
  for _ in $(seq $(( $2 * 5 ))); do
    s=$(get "/v1/jobs/$1" | json "['state']")
    case $s in JOB_STATE_SUCCEEDED|JOB_STATE_FAILED|JOB_STATE_CANCELLED) echo "$s"; return 0 ;; esac
    sleep 0.2
  done
  fail "job $1 did not end (now $(get "/v1/jobs/$1"))"
}
probe_job_args() {  # NAME ARGS (a JSON list's items)
  submit "{\"name\": \"$1\", \"max_restarts\": 0,
    \"torch\": {\"command\": [\"$py\", \"$probe\", $2]}}"
}
probe_job() { probe_job_args "$1" "\"--peer_wait=$2\""; }  # NAME PEER_WAIT
start_workers() {  # LOG ARGS...: starts gpu_trainer --controller; sets worker_pid
  local log=$1
  shift
  CUDA_VISIBLE_DEVICES= "$trainer_bin" --controller="$grpc" --token_file="$work/token" "$@" \
    >"$work/$log" 2>&1 &
  worker_pid=$!
  pids+=($worker_pid)
}
wait_registered() {  # LOG COUNT
  for _ in $(seq 100); do
    [ "$(grep -c "registered with the job controller" "$work/$1")" = "$2" ] && return 0
    sleep 0.1
  done
  fail "$2 workers did not register ($1)"
}

step "control: without --script_user the probe reads the operator token and registers with it"
start_pool control
start_workers control.log
wait_registered control.log 1
j=$(probe_job control 0)
[ "$(wait_end "$j" 60)" = JOB_STATE_FAILED ] || fail "the control probe reached nothing"
for reached in "REACHED the worker's --token_file file" "REACHED the worker's /proc/environ" \
  "REACHED WorkerService.RegisterWorker with the token read from $work/token"; do
  grep -qF "$reached" "$work/control.log" || fail "control: no '$reached'"
done
grep -qF "$token" "$work/control.log" || fail "control: the token it read is not in its output"
kill "$worker_pid"
wait "$worker_pid" || true

step "--script_user with a token file the scripts could read: the worker refuses to start"
set +e
CUDA_VISIBLE_DEVICES= timeout 30 "$trainer_bin" --controller="$grpc" --token_file="$work/token" \
  --script_user=$first_uid >"$work/refused.log" 2>&1
code=$?
set -e
[ "$code" = 2 ] && grep -qF "the scripts' user $first_uid can read $work/token" "$work/refused.log" ||
  fail "a readable token: exit $code, $(cat "$work/refused.log")"
grep -q "registered with the job controller" "$work/refused.log" && fail "it registered anyway"
CUDA_VISIBLE_DEVICES= timeout 30 "$trainer_bin" --controller="$grpc" --token_file="$work/token" \
  --script_user=nobody >"$work/refused.log" 2>&1 && fail "--script_user=nobody was taken"
grep -qF "must be a numeric uid" "$work/refused.log" || fail "nobody: $(cat "$work/refused.log")"

step "--script_user=$first_uid --workers=3: two probes at once, each as its own user, reach nothing"
chmod 0400 "$work/token"
start_pool isolated
start_workers isolated.log --script_user=$first_uid --workers=3
wait_registered isolated.log 3
a=$(probe_job probe-a 30)
b=$(probe_job probe-b 30)
sa=$(wait_end "$a" 90)
sb=$(wait_end "$b" 90)
[ "$sa" = JOB_STATE_SUCCEEDED ] && [ "$sb" = JOB_STATE_SUCCEEDED ] ||
  fail "probes: $sa $sb; $(get "/v1/jobs/$a" | json ".get('reason')") $(get "/v1/jobs/$b" | json ".get('reason')")"
grep "probe: " "$work/isolated.log" >"$work/probe-lines.txt"
# Two workers' users, each its own uid and gid and no group of the worker's.
users=$(sed -n 's/.*probe: uid \([0-9]*\) gid \([0-9]*\) groups \[\];.*/\1 \2/p' \
  "$work/probe-lines.txt" | sort -u)
[ "$(wc -l <<<"$users")" = 2 ] && awk -v f=$first_uid '$1 != $2 || $1 < f || $1 > f + 2 {bad=1}
  END {exit bad}' <<<"$users" || fail "the scripts' users: $(grep 'probe: uid' "$work/probe-lines.txt")"
for refused in "refused the worker's --token_file file: $work/token: Permission denied" \
  "refused the worker's /proc/environ" "refused the worker's /proc/mem" \
  "refused the worker's /proc/fd" "refused a signal to the worker" \
  "refused WorkerService.RegisterWorker with the attempt's shard secret: UNAUTHENTICATED" \
  "refused WorkerService.RegisterWorker with no token: UNAUTHENTICATED" \
  "refused WorkerService.Heartbeat with the attempt's shard secret" \
  "refused WorkerService.RendezvousGet with the attempt's shard secret" \
  "refused JobService.ListJobs with the attempt's shard secret" \
  "refused another script's environment" "refused a signal to another script"; do
  [ "$(grep -cF "$refused" "$work/probe-lines.txt")" -ge 2 ] ||
    fail "not refused in both probes: '$refused'"
done
[ "$(grep -c "probe: home /tmp/offload-home-.* is writable" "$work/probe-lines.txt")" = 2 ] ||
  fail "the scripts' homes: $(grep 'probe: home' "$work/probe-lines.txt")"
sed 's/^/  /' "$work/probe-lines.txt" | grep -E "refused|reached" | sort -u -t: -k2,2 | head -40
grep -q "REACHED" "$work/probe-lines.txt" && fail "a probe reached: $(grep REACHED "$work/probe-lines.txt")"
grep -qF "$token" "$work/isolated.log" && fail "the operator token is in the scripts' output"

step "what a script leaves running is killed with its attempt"
j=$(submit "{\"name\": \"leaves\", \"max_restarts\": 0, \"torch\": {\"command\": [\"sh\", \"-c\",
  \"setsid sleep 300 </dev/null >/dev/null 2>&1 & echo left \$!\"]}}")
[ "$(wait_end "$j" 60)" = JOB_STATE_SUCCEEDED ] || fail "the leaving job: $(get "/v1/jobs/$j")"
left=$(grep -o "left [0-9]*" "$work/isolated.log" | awk '{print $2}')
[ -n "$left" ] || fail "the script did not say what it left"
for _ in $(seq 50); do
  state=$(awk '{print $3}' "/proc/$left/stat" 2>/dev/null || echo gone)
  [ "$state" = gone ] || [ "$state" = Z ] && break
  sleep 0.1
done
[ "$state" = gone ] || [ "$state" = Z ] || fail "pid $left outlived its attempt ($state)"
# Zombies aside (their new parent reaps them in its own time), nothing of either user runs.
left_running=$(ps -u "$first_uid,$((first_uid + 1)),$((first_uid + 2))" -o pid=,stat=,args= |
  awk '$2 !~ /^Z/')
[ -z "$left_running" ] || fail "processes of the scripts' users remain: $left_running"

step "a rank of another job neither reads this job's torch.distributed store nor joins it"
victim=$(submit "{\"name\": \"victim\", \"max_restarts\": 0, \"parallel\": {\"ranks\": 2},
  \"torch\": {\"command\": [\"$py\", \"$probe\", \"--victim\", \"--until=$work/victim-go\"]}}")
for _ in $(seq 600); do
  grep -q "\[$victim rank 0\] probe: victim ready" "$work/isolated.log" && break
  sleep 0.1
done
grep -q "\[$victim rank 0\] probe: victim ready" "$work/isolated.log" ||
  fail "the victim's ranks did not meet: $(get "/v1/jobs/$victim")"
# What only the victim's rank 0 holds: the test reads it as root, as no script can.
rank0=
for p in $(pgrep -f -- "--victim --until=$work/victim-go" || true); do
  if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=0"; then rank0=$p; fi
done
[ -n "$rank0" ] || fail "no victim rank 0 process"
victim_env() { tr '\0' '\n' <"/proc/$rank0/environ" | sed -n "s/^$1=//p"; }
echo "$(victim_env MASTER_ADDR) $(victim_env MASTER_PORT)" >"$work/victim-target.tmp"
mv "$work/victim-target.tmp" "$work/victim-target"
attacker=$(probe_job_args attacker "\"--attack=$work/victim-target\"")
[ "$(wait_end "$attacker" 90)" = JOB_STATE_SUCCEEDED ] ||
  fail "the attacker reached something: $(get "/v1/jobs/$attacker" | json ".get('reason')")"
for refused in "refused the other job's store key with no prefix" \
  "refused the other job's store key with this job's prefix" \
  "refused joining the other job's process group"; do
  grep -qF "[$attacker rank 0] probe: $refused" "$work/isolated.log" || fail "not refused: $refused"
done
grep -F "[$attacker rank 0] probe: " "$work/isolated.log" | grep -v "probe: uid" | sed 's/^/  /'

# The control: with the victim's own secret the key is there to read.
read_marker() {
  "$py" - "$@" <<'PY'
import datetime, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from offload import rendezvous
store = dist.PrefixStore(rendezvous.key_prefix(sys.argv[3]),
                         dist.TCPStore(sys.argv[1], int(sys.argv[2]), 2, False,
                                       datetime.timedelta(seconds=10), wait_for_workers=False))
print(store.get("marker").decode())
PY
}
marker=$(read_marker $(cat "$work/victim-target") "$(victim_env OFFLOAD_TOKEN)" "$root/python" 2>&1) ||
  fail "the victim's key with its secret: $marker"
[ "$marker" = "published by the victim's rank 0" ] || fail "the victim's key read back as '$marker'"
touch "$work/victim-go"
[ "$(wait_end "$victim" 60)" = JOB_STATE_SUCCEEDED ] ||
  fail "the victim: $(get "/v1/jobs/$victim" | json ".get('reason')")"
grep -q "\[$victim rank 1\] probe: victim rank 1 all_reduce 2" "$work/isolated.log" ||
  fail "the victim's rank 1 did not reduce with its rank 0"

step "a real script trains under its own user"
j=$(submit "{\"name\": \"trains\", \"max_restarts\": 0, \"checkpoint\": {\"dir\": \"$work/ckpt/trains\"},
  \"torch\": {\"command\": [\"$py\", \"$root/examples/torch_job.py\", \"--steps=10\",
  \"--checkpoint_every=5\", \"--out=$work/ckpt/trains.safetensors\"]}}")
[ "$(wait_end "$j" 120)" = JOB_STATE_SUCCEEDED ] || fail "torch_job.py: $(get "/v1/jobs/$j")"
[ "$(stat -c %u "$work/ckpt/trains.safetensors")" -ge "$first_uid" ] ||
  fail "the weights were not written by a script user"
echo "PASS"
