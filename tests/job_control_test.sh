#!/usr/bin/env bash
# Job control end to end (issue 7): a real job_controller, an optimizer server and a trainer in
# its pool. REST through curl, gRPC through Python grpcio (not our stubs), offloadctl; tokens
# refused and accepted; kill -9 of the controller mid-job and a restart that loses nothing; a dead
# worker; TLS with a CA made here; and offload_local's default path through the controller.
# usage: job_control_test.sh CONTROLLER SERVER TRAINER OFFLOADCTL LAUNCHER DATA PROTO_DIR
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 ctl=$4 launcher=$5 data=$6 proto_dir=$7
work=$(mktemp -d /tmp/offload-jobctl-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"  # make_tls_files; cleanup and fail are this script's own
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pkill -9 -f "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do echo "--- $f" >&2; tail -n 30 "$f" >&2; done
  exit 1
}
step() { echo "== $*"; }

echo "secret-token-$$" > "$work/token"
token=$(cat "$work/token")
export OFFLOAD_TOKEN=$token

# start_controller LOG [flags]: starts a controller, sets grpc/http from its announcement.
start_controller() {
  local log=$1; shift
  "$controller_bin" --grpc_address="${grpc_listen:-127.0.0.1:0}" --http_address=127.0.0.1:0 \
    --store="$work/jobs.db" --token_file="$work/token" --heartbeat_interval=200ms \
    --heartbeat_timeout=3s "$@" >"$log" 2>&1 &
  controller_pid=$!
  pids+=("$controller_pid")
  for _ in $(seq 100); do
    if line=$(grep -m1 '^job_controller: grpc ' "$log"); then
      grpc=$(awk '{print $3}' <<<"$line"); http=$(awk '{print $5}' <<<"$line"); return 0
    fi
    sleep 0.1
  done
  fail "controller did not announce its address"
}

# jq-less JSON field access through Python.
json() { /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"; }
get() { curl -sS -H "Authorization: Bearer $token" "http://$http$1"; }
post() { curl -sS -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -d "$2" "http://$http$1"; }
state_of() { get "/v1/jobs/$1" | json "['state']"; }
wait_state() {  # job state timeout_s
  for _ in $(seq $(( $3 * 5 ))); do
    [ "$(state_of "$1")" = "$2" ] && return 0
    sleep 0.2
  done
  fail "job $1 did not reach $2 (now $(state_of "$1"))"
}

step "controller refuses to start without a token"
rc=0; env -u OFFLOAD_TOKEN "$controller_bin" --grpc_address=127.0.0.1:0 --http_address= \
  --store="$work/x.db" >"$work/notoken.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && grep -q "allow_unauthenticated" "$work/notoken.log" || fail "started without a token"

start_controller "$work/controller1.log"

step "REST: 401 without or with a wrong token, healthz open"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' "http://$http/v1/jobs")
[ "$code" = 401 ] || fail "no token gave $code"
grep -q '"UNAUTHENTICATED"' "$work/r.json" || fail "401 body: $(cat "$work/r.json")"
grep -q "$token" "$work/r.json" && fail "401 body leaks the token"
code=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer wrong" "http://$http/v1/jobs")
[ "$code" = 401 ] || fail "wrong token gave $code"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://$http/healthz")
[ "$code" = 200 ] || fail "healthz gave $code"

step "gRPC through Python grpcio: UNAUTHENTICATED without a token, health SERVING, a job submitted"
mkdir -p "$work/py"
protoc --proto_path="$proto_dir" --proto_path=/usr/include --python_out="$work/py" \
  "$proto_dir/offload/v1/job.proto" "$proto_dir/offload/v1/checkpoint.proto" \
  "$proto_dir/offload/v1/optimizer.proto"
cat >"$work/client.py" <<PY
import sys, grpc
sys.path.insert(0, "$work/py")
from offload.v1 import job_pb2
ch = grpc.insecure_channel("$grpc")
def call(method, req, resp, token=None):
    md = [("authorization", "Bearer " + token)] if token else None
    return ch.unary_unary("/offload.v1.JobService/" + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=resp.FromString)(req, metadata=md, timeout=10)
try:
    call("ListJobs", job_pb2.ListJobsRequest(), job_pb2.ListJobsResponse)
    sys.exit("ListJobs without a token succeeded")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code()
try:
    call("ListJobs", job_pb2.ListJobsRequest(), job_pb2.ListJobsResponse, "wrong")
    sys.exit("ListJobs with a wrong token succeeded")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code()
health = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                        response_deserializer=lambda b: b)(b"", timeout=10)
assert health == b"\x08\x01", health  # status: SERVING
spec = job_pb2.JobSpec(name="py")
spec.data.path = "$data"
spec.training.steps = 0
try:
    call("SubmitJob", job_pb2.SubmitJobRequest(spec=spec), job_pb2.Job, "$token")
    sys.exit("a bad spec was accepted")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.code()
    assert "training.steps" in e.details(), e.details()
spec.training.steps = 40
spec.training.batch = 8
spec.training.seq_len = 64
spec.eval.every = 0
spec.eval.batches = 1
spec.eval.sample_tokens = 0
job = call("SubmitJob", job_pb2.SubmitJobRequest(spec=spec), job_pb2.Job, "$token")
assert job.state == job_pb2.JOB_STATE_PENDING, job.state
print(job.id)
PY
py_job=$(/usr/bin/python3 "$work/client.py") || fail "python grpcio client"

step "REST: bad specs are 400 naming the field"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' -H "Authorization: Bearer $token" \
  -d '{"training": {"stepz": 3}}' "http://$http/v1/jobs")
[ "$code" = 400 ] && grep -q "stepz" "$work/r.json" || fail "unknown field: $code $(cat "$work/r.json")"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' -H "Authorization: Bearer $token" \
  -d '{"data": {"path": "relative.txt"}}' "http://$http/v1/jobs")
[ "$code" = 400 ] && grep -q "data.path" "$work/r.json" || fail "relative path: $code $(cat "$work/r.json")"

step "pool: a server and a trainer join; the Python job runs to succeeded"
"$server_bin" --listen=127.0.0.1:0 --controller="$grpc" --token_file="$work/token" \
  >"$work/server.log" 2>&1 &
pids+=($!)
# It sees no GPU, whatever the machine has (CUDA_VISIBLE_DEVICES empty): see the NCCL case below.
CUDA_VISIBLE_DEVICES= "$trainer_bin" --controller="$grpc" --token_file="$work/token" -- \
  --progress=log >"$work/trainer.log" 2>&1 &
trainer_pid=$!
pids+=("$trainer_pid")
wait_state "$py_job" JOB_STATE_SUCCEEDED 120
[ "$(get "/v1/jobs/$py_job" | json "['progress']['step']")" = 40 ] || fail "python job's step"

step "pool: a CUDA rank over NCCL on a worker that sees no GPU fails its attempt saying so"
nccl_job=$(post /v1/jobs "{\"name\": \"nccl\", \"data\": {\"path\": \"$data\"},
  \"training\": {\"steps\": 5, \"batch\": 8, \"seq_len\": 64, \"device\": \"cuda\"},
  \"parallel\": {\"collectives\": \"nccl\"}}" | json "['id']")
wait_state "$nccl_job" JOB_STATE_FAILED 60
get "/v1/jobs/$nccl_job/events" >"$work/nccl-events.json"
grep -q "1 CUDA rank on this host needs one GPU per rank with --collectives=nccl, but none are" \
  "$work/nccl-events.json" || fail "the NCCL refusal: $(cat "$work/nccl-events.json")"

step "pool: one gpu_trainer process of two workers (--workers=2) runs two ranks of a job"
# A 3-rank job takes every trainer worker; ranks follow indices, so ranks 0 and 1 go to this
# process's workers (indices 0 and 1) and rank 2 to the unindexed worker above.
"$trainer_bin" --controller="$grpc" --token_file="$work/token" --workers=2 --worker_index=0 \
  -- --progress=log >"$work/trainer2x.log" 2>&1 &
pair_pid=$!
pids+=("$pair_pid")
for _ in $(seq 100); do
  [ "$(grep -c "registered with the job controller" "$work/trainer2x.log")" = 2 ] && break
  sleep 0.1
done
[ "$(grep -c "registered with the job controller" "$work/trainer2x.log")" = 2 ] ||
  fail "not two workers: $(cat "$work/trainer2x.log")"
pair_job=$(post /v1/jobs "{\"name\": \"pair\", \"data\": {\"path\": \"$data\"},
  \"training\": {\"steps\": 20, \"batch\": 12, \"seq_len\": 64},
  \"eval\": {\"every\": 0, \"batches\": 1, \"sample_tokens\": 0},
  \"parallel\": {\"ranks\": 3}}" | json "['id']")
wait_state "$pair_job" JOB_STATE_SUCCEEDED 120
for r in 0 1; do
  grep -q "runs rank $r of 3 of $pair_job" "$work/trainer2x.log" ||
    fail "rank $r did not run in the two-worker process: $(tail -5 "$work/trainer2x.log")"
done
kill "$pair_pid"
wait "$pair_pid" || true

step "REST: submit, progress while running, kill -9 of the controller, restart, succeeded"
spec=$(cat <<JSON
{"name": "curl", "data": {"path": "$data"},
 "training": {"steps": 300, "batch": 8, "seq_len": 64},
 "eval": {"every": 0, "batches": 1, "sample_tokens": 0},
 "checkpoint": {"dir": "$work/ckpt", "every": 50}, "max_restarts": 2}
JSON
)
job=$(post /v1/jobs "$spec" | json "['id']")
for _ in $(seq 300); do
  step_now=$(get "/v1/jobs/$job" | json ".get('progress', {}).get('step', 0)" 2>/dev/null || echo 0)
  [ "${step_now:-0}" -ge 10 ] && break
  sleep 0.2
done
[ "${step_now:-0}" -ge 10 ] || fail "no progress through GET /v1/jobs/$job"
[ "$(state_of "$job")" = JOB_STATE_RUNNING ] || fail "not running while progressing"
kill -9 "$controller_pid"
sleep 1
# The workers know the controller by its address: it comes back on the same one.
grpc_listen=$grpc start_controller "$work/controller2.log"
[ -n "$(get "/v1/jobs/$job" | json "['id']")" ] || fail "job lost after the restart"
wait_state "$job" JOB_STATE_SUCCEEDED 180
get "/v1/jobs/$job/events" > "$work/events.json"
grep -q "submitted" "$work/events.json" || fail "history lost: $(cat "$work/events.json")"
[ "$(get "/v1/jobs/$job" | json "['progress']['step']")" = 300 ] || fail "final step"

step "offloadctl: submit a YAML file, pause, resume, checkpoint, watch, list -o json, logs"
cat >"$work/job.yaml" <<YAML
name: ctl
data: {path: $data}
training: {steps: 400, batch: 8, seq_len: 64}
eval: {every: 0, batches: 1, sample_tokens: 0}
checkpoint: {dir: $work/ckpt2}
YAML
ctl_job=$("$ctl" --controller="$grpc" submit "$work/job.yaml") || fail "offloadctl submit"
wait_state "$ctl_job" JOB_STATE_RUNNING 60
"$ctl" --controller="$grpc" checkpoint "$ctl_job" >/dev/null || fail "offloadctl checkpoint"
for _ in $(seq 150); do
  [ "$(get "/v1/jobs/$ctl_job" | json ".get('progress', {}).get('last_checkpoint_step', 0)")" != 0 ] && break
  sleep 0.2
done
[ "$(get "/v1/jobs/$ctl_job" | json ".get('progress', {}).get('last_checkpoint_step', 0)")" != 0 ] ||
  fail "no checkpoint after offloadctl checkpoint"
"$ctl" --controller="$grpc" pause "$ctl_job" --reason=test >/dev/null || fail "offloadctl pause"
wait_state "$ctl_job" JOB_STATE_PAUSED 60
"$ctl" --controller="$grpc" resume "$ctl_job" >/dev/null || fail "offloadctl resume"
"$ctl" --controller="$grpc" watch "$ctl_job" >"$work/watch.out" || fail "watch exit $?"
[ "$(state_of "$ctl_job")" = JOB_STATE_SUCCEEDED ] || fail "ctl job did not succeed"
"$ctl" --controller="$grpc" -o json list | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin); assert len(j["jobs"]) >= 3, j' \
  || fail "list -o json"
"$ctl" --controller="$grpc" logs "$ctl_job" >"$work/logs.out" || fail "offloadctl logs"
grep -qi "paus" "$work/logs.out" || fail "logs lack the pause: $(cat "$work/logs.out")"
rc=0; env -u OFFLOAD_TOKEN "$ctl" --controller="$grpc" --allow_unauthenticated list >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "offloadctl without a token exited $rc"

step "a worker dies: the job fails after the heartbeat timeout"
dead_job=$(post /v1/jobs "{\"data\": {\"path\": \"$data\"}, \"training\": {\"steps\": 5000, \"batch\": 8, \"seq_len\": 64}, \"eval\": {\"every\": 0, \"batches\": 1, \"sample_tokens\": 0}}" | json "['id']")
wait_state "$dead_job" JOB_STATE_RUNNING 60
pkill -9 -P "$trainer_pid" || true
kill -9 "$trainer_pid"
wait_state "$dead_job" JOB_STATE_FAILED 30
get "/v1/jobs/$dead_job" | grep -q "heartbeat\|exited\|killed" || fail "failure reason: $(get "/v1/jobs/$dead_job")"
kill "$controller_pid"

step "TLS: offloadctl needs the CA; mutual TLS refuses a client without a certificate"
make_tls_files "$work"
start_controller "$work/controller_tls.log" --tls_cert="$work/server.pem" --tls_key="$work/server.key" \
  --tls_ca="$work/ca.pem" --tls_client_auth=require
"$ctl" --controller="$grpc" --tls_ca="$work/ca.pem" --tls_cert="$work/client.pem" \
  --tls_key="$work/client.key" --tls_server_name=localhost list >/dev/null || fail "mTLS list"
rc=0; "$ctl" --controller="$grpc" --tls_ca="$work/ca.pem" --tls_server_name=localhost list \
  >/dev/null 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "mTLS accepted a client without a certificate"
rc=0; "$ctl" --controller="$grpc" --timeout=3s list >/dev/null 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "plaintext client reached a TLS controller"
kill "$controller_pid"

step "offload_local runs the job through its own controller"
"$launcher" --shards=1 -- --data="$data" --steps=30 --batch=8 --seq_len=64 --eval_every=0 \
  --eval_batches=1 --sample_tokens=0 --progress=log >"$work/local.log" 2>&1 || fail "offload_local exit $?"
grep -q "submitted to the job controller" "$work/local.log" || fail "offload_local bypassed the controller"
grep -q "offload_local: job job-1 succeeded at step 30" "$work/local.log" || fail "offload_local outcome"
echo "PASS"
