#!/usr/bin/env bash
# Multi-tenancy end to end: a real job_controller with a tenants file, real optimizer servers and
# trainer workers in its pool, REST through curl and gRPC through offloadctl.
#   1. Fair sharing on a pool of 2 servers and 2 trainers: tenant A queues 6 jobs, then B 2; the
#      first workers to free go to B, not to A's third job. A's max_running_jobs (2) and C's (1,
#      binding on an idle pool) are never exceeded (a poller watches the whole time).
#   2. Isolation: A cannot see, cancel or read the events of B's running job (404, job unchanged)
#      nor submit for B (403); the operator sees and acts on everything and reads the audit log of
#      A's refused attempts; tenants get 403 there; a tenants file that does not parse leaves the
#      last good one in use; B's token revoked in the file is refused (401).
#   3. Preemption on a pool of 1 server and 1 trainer: a low-priority job stopped for a
#      high-priority one resumes from its checkpoint and ends with weights byte-identical to an
#      uninterrupted run; a job with "preemptible": false keeps its workers.
# usage: tenancy_process_test.sh CONTROLLER SERVER TRAINER OFFLOADCTL DATA
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 ctl=$4 data=$5
work=$(mktemp -d /tmp/offload-tenancy-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"  # same_checkpoint; cleanup and fail are this script's own
# Kills what this script started (the workers' rank processes die with them: PR_SET_PDEATHSIG),
# children first in case one was stopped before it could see its parent go.
cleanup() {
  local p
  exec 2>/dev/null  # bash's "Killed" notices for the processes below
  for p in "${pids[@]}"; do pkill -9 -P "$p" 2>/dev/null || true; kill -9 "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  local f
  for f in "$work"/*.log "$work"/*.out; do
    [ -f "$f" ] || continue
    echo "--- $f" >&2
    tail -n 30 "$f" >&2
  done
  if [ -f "$work/r.json" ]; then echo "--- the last REST answer: $(cat "$work/r.json")" >&2; fi
  exit 1
}
step() { echo "== $(date +%T) $*"; }
started_at=$SECONDS

hex() { od -An -N12 -tx1 /dev/urandom | tr -d ' \n'; }
op=operator-$(hex) ta=team-a-$(hex) tb=team-b-$(hex) tc=team-c-$(hex)
echo "$op" >"$work/token"

# write_tenants FILE JSON: replaces FILE whole (a temporary file, then mv), as an operator would.
write_tenants() {
  printf '%s\n' "$2" >"$1.tmp"
  mv "$1.tmp" "$1"
}
tenants=$work/tenants.json
write_tenants "$tenants" "{\"tenants\": [
  {\"name\": \"team-a\", \"weight\": 1, \"max_running_jobs\": 2, \"tokens\": [\"$ta\"]},
  {\"name\": \"team-b\", \"weight\": 1, \"tokens\": [\"$tb\"]},
  {\"name\": \"team-c\", \"max_running_jobs\": 1, \"tokens\": [\"$tc\"]}]}"

# start_controller LOG STORE: a controller on ephemeral ports with $tenants; sets grpc and http.
start_controller() {
  "$controller_bin" --grpc_address=127.0.0.1:0 --http_address=127.0.0.1:0 --store="$2" \
    --token_file="$work/token" --tenants_file="$tenants" --heartbeat_interval=200ms \
    --heartbeat_timeout=3s >"$1" 2>&1 &
  controller_pid=$!
  pids+=("$controller_pid")
  local line
  for _ in $(seq 100); do
    if line=$(grep -m1 '^job_controller: grpc ' "$1"); then
      grpc=$(awk '{print $3}' <<<"$line"); http=$(awk '{print $5}' <<<"$line"); return 0
    fi
    sleep 0.1
  done
  fail "controller did not announce its address"
}

# start_pool NAME SERVERS TRAINERS: workers for the controller at $grpc, waited for until they
# joined; their pids in pool_pids.
start_pool() {
  local i log
  pool_pids=()
  for i in $(seq "$2"); do
    log=$work/$1-server$i.log
    "$server_bin" --listen=127.0.0.1:0 --controller="$grpc" --token_file="$work/token" >"$log" 2>&1 &
    pids+=($!); pool_pids+=($!)
  done
  for i in $(seq "$3"); do
    log=$work/$1-trainer$i.log
    # No GPU, whatever the machine has: the jobs are CPU jobs.
    CUDA_VISIBLE_DEVICES= "$trainer_bin" --controller="$grpc" --token_file="$work/token" -- \
      --progress=log >"$log" 2>&1 &
    pids+=($!); pool_pids+=($!)
  done
  for i in $(seq "$2"); do
    log=$work/$1-server$i.log
    for _ in $(seq 100); do grep -q "joined controller" "$log" && break; sleep 0.1; done
    grep -q "joined controller" "$log" || fail "server $i did not join"
  done
  for i in $(seq "$3"); do
    log=$work/$1-trainer$i.log
    for _ in $(seq 100); do grep -q "registered with the job controller" "$log" && break; sleep 0.1; done
    grep -q "registered with the job controller" "$log" || fail "trainer $i did not register"
  done
}

stop_all() {  # the controller and its pool
  local p
  for p in "$controller_pid" "${pool_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "$controller_pid" "${pool_pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
}

# A helper for what bash does badly: JSON, timestamps, and a poller of the job list.
cat >"$work/tool.py" <<'PY'
import json, os, sys, time, urllib.error, urllib.request

def call(http, token, path):
    req = urllib.request.Request("http://%s%s" % (http, path),
                                 headers={"Authorization": "Bearer " + token})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)

def ns(stamp):  # RFC 3339 with 0 to 9 fractional digits, Z: nanoseconds since the epoch
    import calendar
    main, _, frac = stamp.rstrip("Z").partition(".")
    secs = calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S"))
    return secs * 10**9 + int((frac + "000000000")[:9])

cmd = sys.argv[1]
if cmd == "field":  # field EXPR < JSON: EXPR of the document d
    d = json.load(sys.stdin)
    print(eval(sys.argv[2]))
elif cmd == "event_time":  # event_time HTTP TOKEN JOB SUBSTRING: ns of the first event with it
    http, token, job, needle = sys.argv[2:6]
    for e in call(http, token, "/v1/jobs/%s/events" % job).get("events", []):
        if needle in e.get("message", ""):
            print(ns(e["time"]))
            sys.exit(0)
    sys.exit("no event of %s says %r" % (job, needle))
elif cmd == "poll":  # poll HTTP TOKEN OUT STOP QUOTAS_JSON: until STOP exists
    http, token, out, stop, quotas = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6])
    polls, errors, most, over = 0, 0, {}, []
    while not os.path.exists(stop):
        try:
            jobs = call(http, token, "/v1/jobs?page_size=1000").get("jobs", [])
        except Exception as e:  # the controller is busy or restarting: count it, go on
            errors += 1
            time.sleep(0.1)
            continue
        polls += 1
        running = {}
        for j in jobs:
            if j["state"] in ("JOB_STATE_RUNNING", "JOB_STATE_CHECKPOINTING"):
                running.setdefault(j.get("tenant", "default"), []).append(j["id"])
        for tenant, ids in running.items():
            most[tenant] = max(most.get(tenant, 0), len(ids))
            if tenant in quotas and len(ids) > quotas[tenant]:
                over.append("%s ran %s at once (quota %d)" % (tenant, sorted(ids), quotas[tenant]))
        with open(out + ".tmp", "w") as f:
            json.dump({"polls": polls, "errors": errors, "most": most, "over": over[:20]}, f)
        os.replace(out + ".tmp", out)
        time.sleep(0.1)
PY
py() { /usr/bin/python3 "$work/tool.py" "$@"; }
field() { py field "$1"; }

# req TOKEN METHOD PATH [BODY]: the HTTP code; the body in $work/r.json. A POST always sends a
# body ({} by default): without one curl sends no Content-Length, which httplib answers 400.
req() {
  local body=()
  [ "$2" = POST ] && body=(-H 'Content-Type: application/json' -d "${4-{\}}")
  curl -sS -o "$work/r.json" -w '%{http_code}' -X "$2" -H "Authorization: Bearer $1" \
    "${body[@]}" "http://$http$3"
}
# submit TOKEN SPEC: the new job's id.
submit() {
  local code
  code=$(req "$1" POST /v1/jobs "$2")
  [ "$code" = 200 ] || fail "submit gave $code: $(cat "$work/r.json")"
  field "d['id']" <"$work/r.json"
}
job_json() { curl -sS -H "Authorization: Bearer $op" "http://$http/v1/jobs/$1"; }
job_field() { job_json "$1" | field "$2"; }
state_of() { job_field "$1" "d['state']"; }
wait_state() {  # JOB STATE TIMEOUT_S
  local now
  for _ in $(seq $(($3 * 5))); do
    now=$(state_of "$1")
    [ "$now" = "$2" ] && return 0
    case $now in JOB_STATE_FAILED | JOB_STATE_CANCELLED) fail "job $1 is $now: $(job_json "$1")" ;; esac
    sleep 0.2
  done
  fail "job $1 did not reach $2 in $3 s (now $(job_json "$1"))"
}
wait_step() {  # JOB STEP TIMEOUT_S: until its progress reaches STEP
  local now
  for _ in $(seq $(($3 * 5))); do
    now=$(job_field "$1" "d.get('progress', {}).get('step', 0)")
    [ "$now" -ge "$2" ] && return 0
    sleep 0.2
  done
  fail "job $1 did not reach step $2 in $3 s (now $(job_json "$1"))"
}
started() { py event_time "$http" "$op" "$1" "attempt ${2:-1} started"; }

# spec NAME STEPS [MORE]: the demo job of job_control_test.sh with a fixed seed; MORE is extra
# top-level fields ('"priority": 10').
spec() {
  printf '{"name": "%s", "data": {"path": "%s", "seed": 7},
    "training": {"steps": %s, "batch": 8, "seq_len": 64},
    "eval": {"every": 0, "batches": 1, "sample_tokens": 0}%s}' "$1" "$data" "$2" "${3:+, $3}"
}

# ---------------------------------------------------------------------------------------------
step "pool 1: a controller with tenants, 2 optimizer servers and 2 trainers"
start_controller "$work/controller1.log" "$work/jobs1.db"
start_pool pool1 2 2
py poll "$http" "$op" "$work/poll.out" "$work/poll.stop" '{"team-a": 2, "team-c": 1}' &
poller_pid=$!
pids+=("$poller_pid")

step "fair share: A queues 6 jobs, then B 2; the first freed workers go to B"
# A's second job runs longest, so that when its first ends A still holds half the pool and B
# holds none: B is furthest below its share. (Two of A's ending at once would leave both tenants
# at share 0, and the tie goes to the older job.)
a=()
a+=("$(submit "$ta" "$(spec a1 40)")")
a+=("$(submit "$ta" "$(spec a2 160)")")
for i in 3 4 5 6; do a+=("$(submit "$ta" "$(spec "a$i" 40)")"); done
b=()
for i in 1 2; do b+=("$(submit "$tb" "$(spec "b$i" 40)")"); done
[ "$(job_field "${a[0]}" "d['tenant']")" = team-a ] || fail "A's job's tenant: $(job_json "${a[0]}")"
[ "$(job_field "${b[0]}" "d['tenant']")" = team-b ] || fail "B's job's tenant: $(job_json "${b[0]}")"
for j in "${a[@]}" "${b[@]}"; do wait_state "$j" JOB_STATE_SUCCEEDED 150; done
# The premise, from the events' times: A's first two held the whole pool from before B queued
# until after B's last submission.
b_queued=$(py event_time "$http" "$op" "${b[1]}" "submitted")
for j in "${a[0]}" "${a[1]}"; do
  [ "$(started "$j")" -lt "$b_queued" ] && [ "$(py event_time "$http" "$op" "$j" "succeeded")" -gt "$b_queued" ] ||
    fail "A's job $j did not run while B queued: $(curl -sS -H "Authorization: Bearer $op" "http://$http/v1/jobs/$j/events")"
done
declare -A start=()
for j in "${a[@]}" "${b[@]}"; do start[$j]=$(started "$j") || fail "no start event for $j"; done
order=$(for j in "${a[@]}" "${b[@]}"; do echo "${start[$j]} $j"; done | sort -n | awk '{print $2}' | tr '\n' ' ')
echo "   start order: $order (A: ${a[*]}, B: ${b[*]})"
for j in "${a[@]:2}"; do
  [ "${start[${b[0]}]}" -lt "${start[$j]}" ] ||
    fail "A's job $j started before B's first job ${b[0]} (order: $order)"
done

step "quota: C's max_running_jobs 1 keeps its second job waiting on an idle pool"
c1=$(submit "$tc" "$(spec c1 80)")
c2=$(submit "$tc" "$(spec c2 40)")
[ "$(state_of "$c1")" = JOB_STATE_RUNNING ] || fail "C's first job: $(job_json "$c1")"
c2_json=$(job_json "$c2")
[ "$(field "d['state']" <<<"$c2_json")" = JOB_STATE_PENDING ] &&
  field "d['reason']" <<<"$c2_json" | grep -q "waiting for quota" ||
  fail "C's second job does not wait for its quota: $c2_json"
for _ in $(seq 5); do
  [ "$(state_of "$c1")" = JOB_STATE_RUNNING ] || break
  [ "$(state_of "$c2")" = JOB_STATE_PENDING ] || fail "C's second job started beside its first: $(job_json "$c2")"
  sleep 0.2
done
wait_state "$c1" JOB_STATE_SUCCEEDED 60
wait_state "$c2" JOB_STATE_SUCCEEDED 60
[ "$(started "$c2")" -ge "$(py event_time "$http" "$op" "$c1" "succeeded")" ] ||
  fail "C's second job started before its first ended"

step "quotas held the whole time (poller)"
touch "$work/poll.stop"
wait "$poller_pid" || fail "the poller failed"
cat "$work/poll.out"; echo
[ "$(field "d['polls']" <"$work/poll.out")" -ge 50 ] || fail "too few polls: $(cat "$work/poll.out")"
[ "$(field "d['over']" <"$work/poll.out")" = "[]" ] || fail "a quota was exceeded: $(cat "$work/poll.out")"
[ "$(field "d['most'].get('team-a', 0)" <"$work/poll.out")" = 2 ] || fail "A never ran 2 jobs at once"
[ "$(field "d['most'].get('team-c', 0)" <"$work/poll.out")" = 1 ] || fail "C's jobs never ran"

# ---------------------------------------------------------------------------------------------
step "isolation: A cannot see, cancel or read the events of B's running job"
bjob=$(submit "$tb" "$(spec b-long 100000)")
wait_state "$bjob" JOB_STATE_RUNNING 30
before=$(job_field "$bjob" "d['attempt'], d.get('request', 'JOB_REQUEST_NONE'), d['state']")
code=$(req "$ta" GET "/v1/jobs/$bjob"); [ "$code" = 404 ] || fail "A's GET of B's job gave $code"
grep -q "\"NOT_FOUND\"" "$work/r.json" || fail "A's GET body: $(cat "$work/r.json")"
grep -q "team-b\|b-long" "$work/r.json" && fail "the 404 leaks B's job: $(cat "$work/r.json")"
code=$(req "$ta" GET "/v1/jobs/job-999999"); [ "$code" = 404 ] || fail "a missing job gave $code"
missing=$(sed "s/job-999999/$bjob/" "$work/r.json")
code=$(req "$ta" GET "/v1/jobs/$bjob")
[ "$(cat "$work/r.json")" = "$missing" ] || fail "B's job and a missing one differ to A"
code=$(req "$ta" POST "/v1/jobs/$bjob:cancel"); [ "$code" = 404 ] || fail "A's cancel of B's job gave $code"
code=$(req "$ta" POST "/v1/jobs/$bjob:pause"); [ "$code" = 404 ] || fail "A's pause of B's job gave $code"
code=$(req "$ta" GET "/v1/jobs/$bjob/events"); [ "$code" = 404 ] || fail "A's events of B's job gave $code"
sleep 1  # a cancel or pause that slipped through would show by now
after=$(job_field "$bjob" "d['attempt'], d.get('request', 'JOB_REQUEST_NONE'), d['state']")
[ "$before" = "$after" ] || fail "B's job changed: $before -> $after"
[ "$after" = "(1, 'JOB_REQUEST_NONE', 'JOB_STATE_RUNNING')" ] || fail "B's job: $after"
code=$(req "$tb" GET "/v1/jobs/$bjob"); [ "$code" = 200 ] || fail "B's own GET gave $code"

step "isolation: lists, a submission for another tenant, the operator sees all"
code=$(req "$ta" GET "/v1/jobs?page_size=1000"); [ "$code" = 200 ] || fail "A's list gave $code"
a_list=$(field "[j['id'] for j in d.get('jobs', [])]" <"$work/r.json")
for j in "${a[@]}"; do grep -q "'$j'" <<<"$a_list" || fail "A's list lacks its job $j: $a_list"; done
for j in "${b[@]}" "$bjob" "$c1"; do grep -q "'$j'" <<<"$a_list" && fail "A's list shows $j: $a_list"; done
[ "$(field "sorted({j['tenant'] for j in d['jobs']})" <"$work/r.json")" = "['team-a']" ] ||
  fail "A's list holds others' jobs"
code=$(req "$ta" POST /v1/jobs "$(spec a-for-b 10 '"tenant": "team-b"')")
[ "$code" = 403 ] || fail "A submitting for B gave $code: $(cat "$work/r.json")"
grep -q '"PERMISSION_DENIED"' "$work/r.json" || fail "403 body: $(cat "$work/r.json")"
code=$(req "$op" GET "/v1/jobs?page_size=1000"); [ "$code" = 200 ] || fail "operator's list gave $code"
all=$(field "[j['id'] for j in d.get('jobs', [])]" <"$work/r.json")
for j in "${a[@]}" "${b[@]}" "$bjob" "$c1" "$c2"; do
  grep -q "'$j'" <<<"$all" || fail "the operator's list lacks $j: $all"
done
[ "$(field "len(d['jobs'])" <"$work/r.json")" = 11 ] || fail "the operator sees $(field "len(d['jobs'])" <"$work/r.json") jobs, not 11"

step "isolation over gRPC (offloadctl with A's token)"
rc=0; OFFLOAD_TOKEN=$ta "$ctl" --controller="$grpc" get "$bjob" >"$work/ctl.out" 2>&1 || rc=$?
[ "$rc" = 1 ] && grep -qi "not found" "$work/ctl.out" || fail "offloadctl get as A: $rc $(cat "$work/ctl.out")"
OFFLOAD_TOKEN=$ta "$ctl" --controller="$grpc" -o json list >"$work/ctl.out" 2>&1 || fail "offloadctl list as A"
grep -q "\"$bjob\"" "$work/ctl.out" && fail "A's gRPC list shows B's job"
grep -q "\"${a[0]}\"" "$work/ctl.out" || fail "A's gRPC list lacks its own job"
rc=0; OFFLOAD_TOKEN=$ta "$ctl" --controller="$grpc" cancel "$bjob" >"$work/ctl.out" 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "offloadctl cancel as A: $rc $(cat "$work/ctl.out")"
rc=0; OFFLOAD_TOKEN=$ta "$ctl" --controller="$grpc" audit >"$work/ctl.out" 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "offloadctl audit as A: $rc $(cat "$work/ctl.out")"
[ "$(state_of "$bjob")" = JOB_STATE_RUNNING ] || fail "B's job after A's gRPC cancel: $(job_json "$bjob")"

step "audit: the operator reads A's refused attempts; tenants get 403"
code=$(req "$ta" GET /v1/audit); [ "$code" = 403 ] || fail "A's audit gave $code"
code=$(req "$tb" GET /v1/audit); [ "$code" = 403 ] || fail "B's audit gave $code"
code=$(req "$op" GET "/v1/audit?page_size=1000"); [ "$code" = 200 ] || fail "operator's audit gave $code"
cp "$work/r.json" "$work/audit.json"
for want in "get:$bjob:NOT_FOUND" "cancel:$bjob:NOT_FOUND" "pause:$bjob:NOT_FOUND" \
  "events:$bjob:NOT_FOUND" "submit::PERMISSION_DENIED" "audit::PERMISSION_DENIED"; do
  n=$(field "len([r for r in d.get('records', []) if r.get('tenant') == 'team-a' and
      (r.get('action'), r.get('job_id', ''), r.get('code')) == tuple('$want'.split(':'))])" \
    <"$work/audit.json")
  [ "$n" -ge 1 ] || fail "no audit record team-a $want in $(cat "$work/audit.json")"
done
n=$(field "len([r for r in d.get('records', []) if r.get('tenant') == 'team-a' and
    r.get('action') == 'cancel' and r.get('code') == 'NOT_FOUND'])" <"$work/audit.json")
[ "$n" = 2 ] || fail "A's two cancels (REST, gRPC) make $n audit records"
grep -q "$ta\|$tb\|$op" "$work/audit.json" && fail "the audit log holds a token"

step "a tenants file that does not parse keeps the last good one in use"
write_tenants "$tenants" '{"tenants": [{"name": "team-a", "tokens": ["short"]}'
for _ in $(seq 25); do
  grep -q "the last good tenants stay in use" "$work/controller1.log" && break
  sleep 0.2
done
grep -q "the last good tenants stay in use" "$work/controller1.log" || fail "no reload error logged"
code=$(req "$tb" GET "/v1/jobs/$bjob"); [ "$code" = 200 ] || fail "B's token with a broken file gave $code"

step "revocation: B's token removed from the tenants file is refused within a few ticks"
write_tenants "$tenants" "{\"tenants\": [
  {\"name\": \"team-a\", \"weight\": 1, \"max_running_jobs\": 2, \"tokens\": [\"$ta\"]},
  {\"name\": \"team-b\", \"weight\": 1, \"tokens\": []},
  {\"name\": \"team-c\", \"max_running_jobs\": 1, \"tokens\": [\"$tc\"]}]}"
sleep 0.4  # two heartbeat intervals
for _ in $(seq 25); do
  [ "$(req "$tb" GET "/v1/jobs/$bjob")" = 401 ] && break
  sleep 0.2
done
code=$(req "$tb" GET "/v1/jobs/$bjob"); [ "$code" = 401 ] || fail "B's revoked token gave $code"
code=$(req "$tb" GET /v1/jobs); [ "$code" = 401 ] || fail "B's revoked token (list) gave $code"
code=$(req "$ta" GET "/v1/jobs/${a[0]}"); [ "$code" = 200 ] || fail "A's token after the reload gave $code"
grep -q "tenants file .* reloaded" "$work/controller1.log" || fail "no reload in the controller's log"
step "the operator acts on B's job: cancel"
code=$(req "$op" POST "/v1/jobs/$bjob:cancel"); [ "$code" = 200 ] || fail "operator's cancel gave $code"
wait_state "$bjob" JOB_STATE_CANCELLED 60
stop_all

# ---------------------------------------------------------------------------------------------
step "pool 2: a controller, 1 optimizer server and 1 trainer"
write_tenants "$tenants" "{\"tenants\": [
  {\"name\": \"team-a\", \"tokens\": [\"$ta\"]}, {\"name\": \"team-b\", \"tokens\": [\"$tb\"]}]}"
start_controller "$work/controller2.log" "$work/jobs2.db"
start_pool pool2 1 1
steps=200
ckpt() { echo "\"checkpoint\": {\"dir\": \"$work/$1\", \"every\": 20}"; }

step "preemption: the reference run ($steps steps, uninterrupted)"
ref=$(submit "$tb" "$(spec ref $steps "$(ckpt ref)")")
wait_state "$ref" JOB_STATE_SUCCEEDED 120

step "preemption: the same job, then one of priority 10 for its workers"
low=$(submit "$tb" "$(spec low $steps "$(ckpt low)")")
wait_state "$low" JOB_STATE_RUNNING 30
wait_step "$low" 25 60
high=$(submit "$ta" "$(spec high 40 '"priority": 10')")
asked=$SECONDS
for _ in $(seq 150); do
  [ "$(job_field "$low" "d['state'], d.get('preemptions', 0)")" = "('JOB_STATE_PENDING', 1)" ] && break
  sleep 0.2
done
low_json=$(job_json "$low")
[ "$(field "d['state'], d.get('preemptions', 0), d.get('preempted_for')" <<<"$low_json")" = \
  "('JOB_STATE_PENDING', 1, '$high')" ] || fail "the low job was not preempted for $high: $low_json"
wait_state "$high" JOB_STATE_RUNNING 30
echo "   preempted and replaced in $((SECONDS - asked)) s: $(field "d['reason']" <<<"$low_json")"
[ $((SECONDS - asked)) -le 30 ] || fail "the preemption took $((SECONDS - asked)) s"
preempted_at=$(sed -n 's/.*preempted at step \([0-9]*\) .*/\1/p' <<<"$(field "d['reason']" <<<"$low_json")")
[ -n "$preempted_at" ] && [ "$preempted_at" -lt "$steps" ] || fail "preempted at step '$preempted_at'"
[ "$(state_of "$low")" = JOB_STATE_PENDING ] || fail "the low job left PENDING while the high one runs"
wait_state "$high" JOB_STATE_SUCCEEDED 60
wait_state "$low" JOB_STATE_SUCCEEDED 120
low_json=$(job_json "$low")
[ "$(field "d['attempt'], d.get('preemptions', 0), d.get('restarts', 0)" <<<"$low_json")" = "(2, 1, 0)" ] ||
  fail "the low job's record: $low_json"
[ "$(started "$high")" -lt "$(started "$low" 2)" ] || fail "the low job resumed before the high one started"
py event_time "$http" "$op" "$low" "resuming from the latest checkpoint" >/dev/null ||
  fail "the low job's second attempt did not resume"
grep -q "resumed from .* at step $preempted_at" "$work"/pool2-trainer1.log ||
  fail "the trainer did not resume at step $preempted_at"
same_checkpoint "$work/ref" "$work/low" "preempted at step $preempted_at and resumed"
echo "   step $steps weights equal the uninterrupted run's, byte for byte (preempted at step $preempted_at)"

step "preemption: a job with \"preemptible\": false keeps its workers"
keep=$(submit "$tb" "$(spec keep 200 "$(ckpt keep), \"preemptible\": false")")
wait_state "$keep" JOB_STATE_RUNNING 30
wait_step "$keep" 10 60
high2=$(submit "$ta" "$(spec high2 40 '"priority": 10')")
seen=0
for _ in $(seq 15); do
  k=$(job_field "$keep" "d['state'], d.get('request', 'JOB_REQUEST_NONE'), d.get('preemptions', 0)")
  [ "$k" = "('JOB_STATE_RUNNING', 'JOB_REQUEST_NONE', 0)" ] || break
  [ "$(state_of "$high2")" = JOB_STATE_PENDING ] || fail "the high job started: $(job_json "$high2")"
  seen=$((seen + 1))
  sleep 0.2
done
[ "$seen" -ge 10 ] || fail "the kept job changed after $seen polls: $k $(job_json "$keep")"
wait_state "$keep" JOB_STATE_SUCCEEDED 60
wait_state "$high2" JOB_STATE_SUCCEEDED 60
[ "$(job_field "$keep" "d['attempt'], d.get('preemptions', 0)")" = "(1, 0)" ] ||
  fail "the kept job: $(job_json "$keep")"
curl -sS -H "Authorization: Bearer $op" "http://$http/v1/jobs/$keep/events" | grep -qi preempt &&
  fail "the kept job's events mention a preemption"
[ "$(started "$high2")" -ge "$(py event_time "$http" "$op" "$keep" "succeeded")" ] ||
  fail "the high job started before the kept one ended"
stop_all
echo "PASS ($((SECONDS - started_at)) s)"
