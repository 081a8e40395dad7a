#!/usr/bin/env bash
# PyTorch scripts as jobs on the pool (issue 43): a real job_controller, two optimizer servers and
# two trainer pool workers; torch jobs submitted through REST with curl. The example script
# (examples/torch_job.py) runs to SUCCEEDED with one rank and with two over gloo; kill -9 of its
# optimizer server and kill -9 of the script mid-run each restart the job from its last checkpoint
# and end with final weights byte-identical to the uninterrupted run; a pause checkpoints and a
# resume finishes with the same bytes. Progress reaches GET /v1/jobs, `offloadctl watch` and the
# worker's /metrics. Bad input: a spec without a command (400), a command that exits at once
# (FAILED with its code and last lines), a script that never calls the optimizer (its own exit
# code), a wrong token in the script's environment (FAILED naming the server, after max_restarts).
# usage: torch_job_test.sh CONTROLLER SERVER TRAINER OFFLOADCTL REPO_ROOT BUILD_DIR
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 ctl=$4 root=$5 build=$6
py=/usr/bin/python3
work=$(mktemp -d /tmp/offload-torchjob-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pkill -9 -f "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do echo "--- $f" >&2; tail -n 40 "$f" >&2; done
  exit 1
}
step() { echo "== $*"; }
"$py" -c 'import torch' 2>/dev/null || { echo "SKIP: torch_job_test: $py has no torch"; exit 77; }

echo "torch-job-token-$$" >"$work/token"
token=$(cat "$work/token")
export OFFLOAD_TOKEN=$token
# The scripts find the package and its library in the source and build trees (an installed
# package needs neither: tests/wheel_test.sh).
export PYTHONPATH=$root/python OFFLOAD_BUILD_DIR=$build OMP_NUM_THREADS=1
script=$root/examples/torch_job.py

"$controller_bin" --grpc_address=127.0.0.1:0 --http_address=127.0.0.1:0 --store="$work/jobs.db" \
  --token_file="$work/token" --heartbeat_interval=200ms --heartbeat_timeout=3s \
  >"$work/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  if line=$(grep -m1 '^job_controller: grpc ' "$work/controller.log"); then
    grpc=$(awk '{print $3}' <<<"$line"); http=$(awk '{print $5}' <<<"$line"); break
  fi
  sleep 0.1
done
[ -n "${http:-}" ] || fail "controller did not announce its address"

json() { "$py" -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"; }
get() { curl -sS -H "Authorization: Bearer $token" "http://$http$1"; }
post() { curl -sS -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -d "$2" "http://$http$1"; }
state_of() { get "/v1/jobs/$1" | json "['state']"; }
wait_state() {  # job state timeout_s
  for _ in $(seq $(( $3 * 5 ))); do
    [ "$(state_of "$1")" = "$2" ] && return 0
    sleep 0.2
  done
  fail "job $1 did not reach $2 (now $(get "/v1/jobs/$1"))"
}
reason_of() { get "/v1/jobs/$1" | json ".get('reason', '')"; }
progress_of() { get "/v1/jobs/$1" | json ".get('progress', {}).get('$2', 0)"; }  # job field
# submit JSON: the new job's id.
submit() {
  local answer
  answer=$(post /v1/jobs "$1")
  id=$(json "['id']" <<<"$answer") || fail "submit refused: $answer"
  echo "$id"
}

# start_server N: optimizer server N of the pool; sets server_pid_N and server_port_N.
start_server() {
  local log=$work/server$1.log
  : >"$log"
  "$server_bin" --listen=127.0.0.1:0 --controller="$grpc" --token_file="$work/token" \
    --ucx=false >"$log" 2>&1 &
  pids+=($!)
  eval "server_pid_$1=$!"
  for _ in $(seq 200); do
    port=$(sed -n 's/.*listening port=\([0-9]*\).*/\1/p' "$log")
    [ -n "$port" ] && eval "server_port_$1=$port" && return 0
    sleep 0.05
  done
  fail "server $1 did not start"
}
start_server 1
start_server 2
CUDA_VISIBLE_DEVICES= "$trainer_bin" --controller="$grpc" --token_file="$work/token" \
  --metrics_address=127.0.0.1:0 --workers=2 >"$work/workers.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  [ "$(grep -c "registered with the job controller" "$work/workers.log")" = 2 ] && break
  sleep 0.1
done
metrics_port=$(grep -o 'metrics.*127.0.0.1:[0-9]*' "$work/workers.log" | grep -o '[0-9]*$' | head -1)
[ -n "$metrics_port" ] || fail "the workers' metrics port"

step "bad input: no command is 400 naming the field; nothing is created"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' -H "Authorization: Bearer $token" \
  -d '{"torch": {"working_dir": "/tmp"}}' "http://$http/v1/jobs")
[ "$code" = 400 ] && grep -q "torch.command: required" "$work/r.json" ||
  fail "no command: $code $(cat "$work/r.json")"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' -H "Authorization: Bearer $token" \
  -d '{"torch": {"command": ["python3"], "env": ["OFFLOAD_TOKEN=x"]}}' "http://$http/v1/jobs")
[ "$code" = 400 ] && grep -q "OFFLOAD_TOKEN is the job's own" "$work/r.json" ||
  fail "reserved env: $code $(cat "$work/r.json")"
code=$(curl -s -o "$work/r.json" -w '%{http_code}' -H "Authorization: Bearer $token" \
  -d '{"torch": {"command": ["python3"]}, "model": {"layers": 2}}' "http://$http/v1/jobs")
[ "$code" = 400 ] && grep -q "model.layers" "$work/r.json" ||
  fail "model fields: $code $(cat "$work/r.json")"
[ "$(get /v1/jobs | json ".get('jobs', [])")" = "[]" ] || fail "a refused spec left a job"

step "bad input: a command that exits at once is FAILED with its code and last lines"
j=$(submit '{"name": "exits", "torch": {"command": ["sh", "-c", "echo first-line; echo boom >&2; exit 3"]}}')
wait_state "$j" JOB_STATE_FAILED 30
reason=$(reason_of "$j")
grep -q "exited with code 3" <<<"$reason" && grep -q "boom" <<<"$reason" &&
  grep -q "first-line" <<<"$reason" || fail "exit reason: $reason"
j=$(submit '{"name": "missing", "torch": {"command": ["no-such-program-anywhere"]}}')
wait_state "$j" JOB_STATE_FAILED 30
grep -q "no-such-program-anywhere is not on the worker's PATH" <<<"$(reason_of "$j")" ||
  fail "missing program: $(reason_of "$j")"

step "a script that never calls the optimizer ends with its own exit code"
j=$(submit "{\"torch\": {\"command\": [\"$py\", \"-c\", \"import offload; offload.report(step=1); raise SystemExit(5)\"]}}")
wait_state "$j" JOB_STATE_FAILED 30
grep -q "exited with code 5" <<<"$(reason_of "$j")" || fail "exit 5: $(reason_of "$j")"
printf 'name: from-offloadctl\ntorch:\n  command: [%s, -c, "print(42)"]\n  env: [A=1]\n' "$py" \
  >"$work/print.yaml"
j=$("$ctl" --controller="$grpc" --token_file="$work/token" submit "$work/print.yaml") ||
  fail "offloadctl submit: $j"
wait_state "$j" JOB_STATE_SUCCEEDED 30
"$ctl" --controller="$grpc" --token_file="$work/token" get "$j" >"$work/get.txt"
grep -q "Command: *$py -c print(42)" "$work/get.txt" || fail "offloadctl get: $(cat "$work/get.txt")"

step "a wrong token in the script's environment: FAILED naming the server, not retried forever"
j=$(submit "{\"name\": \"wrong-token\", \"max_restarts\": 1, \"checkpoint\": {\"dir\": \"$work/ckpt-wrong\"},
  \"torch\": {\"command\": [\"$py\", \"-c\", \"import os, runpy, sys; os.environ['OFFLOAD_TOKEN'] = 'wrong'; sys.argv = ['torch_job.py', '--steps=5']; runpy.run_path('$script', run_name='__main__')\"]}}")
wait_state "$j" JOB_STATE_FAILED 60
reason=$(reason_of "$j")
grep -q "127.0.0.1:" <<<"$reason" && grep -Eq "UNAUTHENTICATED|PERMISSION_DENIED" <<<"$reason" ||
  fail "wrong token reason: $reason"
[ "$(get "/v1/jobs/$j" | json "['restarts']")" = 1 ] || fail "restarts: $(get "/v1/jobs/$j")"

# torch_job JOB_NAME STEPS EXTRA_JSON ARGS...: submits the example script; prints the id.
torch_job() {
  local name=$1 steps=$2 extra=$3
  shift 3
  local args="\"--steps=$steps\", \"--checkpoint_every=10\", \"--out=$work/$name.safetensors\""
  for a in "$@"; do args="$args, \"$a\""; done
  submit "{\"name\": \"$name\", \"torch\": {\"command\": [\"$py\", \"$script\", $args]},
    \"checkpoint\": {\"dir\": \"$work/ckpt-$name\"}, \"max_restarts\": 3 $extra}"
}

step "the example script runs to SUCCEEDED through REST; progress in the job, watch and metrics"
ref=$(torch_job ref 40 "")
wait_state "$ref" JOB_STATE_SUCCEEDED 120
[ "$(get "/v1/jobs/$ref" | json "['progress']['step']")" = 40 ] || fail "ref step: $(get "/v1/jobs/$ref")"
[ "$(get "/v1/jobs/$ref" | json "['progress']['last_checkpoint_step']")" = 40 ] ||
  fail "ref checkpoint: $(get "/v1/jobs/$ref")"
[ -s "$work/ref.safetensors" ] || fail "no final weights"
"$ctl" --controller="$grpc" --token_file="$work/token" watch "$ref" >"$work/watch.txt" 2>&1 ||
  fail "watch: $(cat "$work/watch.txt")"
grep -q "succeeded at step 40" "$work/watch.txt" && grep -q "step 40/40  loss" "$work/watch.txt" ||
  fail "watch output: $(cat "$work/watch.txt")"
curl -sS "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics.txt"
for m in 'offload_trainer_steps_total [1-9]' 'offload_trainer_step 40' 'offload_trainer_loss ' \
  'offload_trainer_tokens_total [1-9]'; do
  grep -Eq "^$m" "$work/metrics.txt" || fail "metric $m: $(grep offload_trainer "$work/metrics.txt")"
done
if command -v promtool >/dev/null; then
  promtool check metrics <"$work/metrics.txt" >"$work/promtool.log" 2>&1 || true
  grep -qi "error" "$work/promtool.log" && fail "promtool: $(cat "$work/promtool.log")"
fi

# wait_for_checkpoint_step JOB STEP: until the job reports a checkpoint at STEP or later (60 s).
wait_for_checkpoint_step() {
  for _ in $(seq 600); do
    [ "$(progress_of "$1" last_checkpoint_step)" -ge "$2" ] && return 0
    sleep 0.1
  done
  fail "job $1 has no checkpoint at step $2 after 60 s: $(get "/v1/jobs/$1")"
}

step "kill -9 of its optimizer server mid-run: restart from the checkpoint, the same final bytes"
j=$(torch_job killserver 40 "" "--step_seconds=0.1")
wait_for_checkpoint_step "$j" 10
address=$(get "/v1/jobs/$j" | json "['shard_addresses'][0]")
if [ "$address" = "127.0.0.1:$server_port_1" ]; then victim=1; else victim=2; fi
eval "kill -9 \$server_pid_$victim"
start_server "$victim"  # as its StatefulSet would
wait_state "$j" JOB_STATE_SUCCEEDED 180
[ "$(get "/v1/jobs/$j" | json "['restarts']")" -ge 1 ] || fail "no restart: $(get "/v1/jobs/$j")"
get "/v1/jobs/$j/events" >"$work/killserver-events.json"
grep -q "restarting from the last checkpoint" "$work/killserver-events.json" ||
  fail "events: $(cat "$work/killserver-events.json")"
cmp "$work/ref.safetensors" "$work/killserver.safetensors" ||
  fail "weights after a server's kill -9 differ from the uninterrupted run's"

step "kill -9 of the script mid-run: restart from the checkpoint, the same final bytes"
j=$(torch_job killscript 40 "" "--step_seconds=0.1")
wait_for_checkpoint_step "$j" 10
pkill -9 -f "out=$work/killscript.safetensors" || fail "no script process to kill"
wait_state "$j" JOB_STATE_SUCCEEDED 180
[ "$(get "/v1/jobs/$j" | json "['restarts']")" -ge 1 ] || fail "no restart: $(get "/v1/jobs/$j")"
cmp "$work/ref.safetensors" "$work/killscript.safetensors" ||
  fail "weights after the script's kill -9 differ from the uninterrupted run's"

step "pause checkpoints and stops the script; resume finishes with the same bytes"
j=$(torch_job pause 40 "" "--step_seconds=0.1")
wait_state "$j" JOB_STATE_RUNNING 60
for _ in $(seq 300); do
  [ "$(progress_of "$j" step)" -ge 5 ] && break
  sleep 0.1
done
# While it runs, the worker's metrics name it (and no finished attempt's).
curl -sS "http://127.0.0.1:$metrics_port/metrics" | grep '^offload_trainer_info' >"$work/info.txt" || true
grep -q "job_id=\"$j\".*model=\"torch\"" "$work/info.txt" && [ "$(wc -l <"$work/info.txt")" = 1 ] ||
  fail "offload_trainer_info while $j runs: $(cat "$work/info.txt")"
post "/v1/jobs/$j:pause" '{"reason": "test"}' >/dev/null
wait_state "$j" JOB_STATE_PAUSED 60
paused_at=$(get "/v1/jobs/$j" | json "['progress']['last_checkpoint_step']")
[ "$paused_at" -ge 5 ] && [ "$paused_at" -lt 40 ] || fail "paused at checkpoint $paused_at"
post "/v1/jobs/$j:resume" '{}' >/dev/null
wait_state "$j" JOB_STATE_SUCCEEDED 120
cmp "$work/ref.safetensors" "$work/pause.safetensors" ||
  fail "weights after pause and resume differ from the uninterrupted run's"

step "two ranks over gloo run to SUCCEEDED"
j=$(torch_job two 20 ", \"parallel\": {\"ranks\": 2, \"optimizer_servers\": 2}")
wait_state "$j" JOB_STATE_SUCCEEDED 180
[ "$(get "/v1/jobs/$j" | json "['progress']['step']")" = 20 ] || fail "two ranks' step: $(get "/v1/jobs/$j")"
for r in 0 1; do
  grep -q "runs rank $r of 2 of torch job $j" "$work/workers.log" || fail "rank $r did not run"
done
grep -q "2 rank(s)" "$work/workers.log" || fail "the script did not see two ranks"
echo "PASS"
