#!/usr/bin/env bash
# The tenant soak (opt-in; docs/RELIABILITY.md): tenants, quotas, priorities and preemption
# through a real controller pool while components die. One pool (a job controller with a tenants
# file of two tenants, 2 optimizer servers, 2 trainer workers, on fixed ports so that a restarted
# controller is found where it was). team-a may run one job at a time (max_running_jobs 1), team-b
# may hold one optimizer server (max_optimizer_servers 1); both weigh 1. team-a's jobs are 1x1 or
# 2x2 (ranks x optimizer servers, drawn at random), team-b's 1x1 (a 2x2 is larger than its quota
# and refused at submit). First, with nothing else running, a reference run of each shape
# (submitted by the operator). Then for TENANT_SOAK_MINUTES a seeded loop does one thing every 3
# to 8 s: submit a job for a random tenant with its own token (priority 0 or 10, preemptible or
# not, its own checkpoint.dir, otherwise the reference's spec; at most TENANT_SOAK_MAX_LIVE jobs
# not yet ended), cancel a random job that has not ended (with its tenant's token), or kill -9 an
# optimizer server, a trainer worker or the controller and start a replacement. Throughout, a
# monitor lists the jobs every second with the operator's token: per tenant, the running jobs'
# optimizer servers, ranks and count must stay within the quotas, and no worker may be in two
# running jobs. At the end the chaos stops and every job left is waited for (bounded); then every
# submitted job must still exist and have ended, none FAILED, every SUCCEEDED one's final
# checkpoint byte-identical to the reference of its shape (preempted and resumed ones too), every
# preempted job a preemptible one of priority 0 preempted for a job of priority 10, a tenant's
# token must list its own jobs only, every submit must be in the audit log under the
# tenant that made it, and nothing of the soak may be left running or in /dev/shm.
#
# usage: tests/tenant_soak.sh [BUILD_DIR]   (default: build; the binaries are in BUILD_DIR/bin)
#   TENANT_SOAK_MINUTES=20        how long the chaos loop runs
#   TENANT_SOAK_STEPS=3000        steps of every job
#   TENANT_SOAK_SEED=...          the loop's random seed (printed; the same seed draws the same
#                                 actions, though which job a cancel hits depends on timing)
#   TENANT_SOAK_MAX_LIVE=6        at most this many submitted jobs not yet ended
#   TENANT_SOAK_DRAIN_MINUTES=30  how long the jobs left at the end may take
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bin=$(cd "${1:-build}/bin" && pwd)
minutes=${TENANT_SOAK_MINUTES:-20}
steps=${TENANT_SOAK_STEPS:-3000}
seed=${TENANT_SOAK_SEED:-$RANDOM}
max_live=${TENANT_SOAK_MAX_LIVE:-6}
drain_minutes=${TENANT_SOAK_DRAIN_MINUTES:-30}
RANDOM=$seed
data=$root/data/tinyshakespeare.txt
work=$(mktemp -d /tmp/offload-tenant-soak-XXXXXX)
soak_name=tenant-soak
source tests/soak_lib.sh
mkdir -p "$work/logs" "$work/ckpt"
unset OFFLOAD_TOKEN OFFLOAD_SHARD_TOKEN

# Tokens from /dev/urandom, not $RANDOM: the seeded draws are the loop's alone.
new_token() { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; }
declare -A token_of=([default]=$(new_token) [team-a]=$(new_token) [team-b]=$(new_token))
echo "${token_of[default]}" >"$work/token" # the operator's: admin, tenant "default", the workers'
tenants=$work/tenants.json
cat >"$tenants" <<EOF
{"tenants": [
  {"name": "team-a", "weight": 1, "max_running_jobs": 1, "tokens": ["${token_of[team-a]}"]},
  {"name": "team-b", "weight": 1, "max_optimizer_servers": 1, "tokens": ["${token_of[team-b]}"]}
]}
EOF

grpc=127.0.0.1:$(free_port)
http=127.0.0.1:$(free_port)

incarnation=0
start_controller() {
  "$bin/job_controller" --grpc_address="$grpc" --http_address="$http" --store="$work/jobs.db" \
    --token_file="$work/token" --tenants_file="$tenants" --heartbeat_interval=200ms \
    --heartbeat_timeout=3s >>"$work/logs/controller.log" 2>&1 &
  proc[controller/0]=$!
  for _ in $(seq 100); do
    curl -sf "http://$http/healthz" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  fail "the controller did not come up"
}
start_server() { # K
  "$bin/cpu_optimizer_server" --listen=127.0.0.1:0 --controller="$grpc" \
    --token_file="$work/token" --memory_limit_mib=512 --threads=1 \
    >>"$work/logs/server$1.log" 2>&1 &
  proc[server/$1]=$!
}
start_trainer() { # R
  "$bin/gpu_trainer" --controller="$grpc" --token_file="$work/token" \
    --rank_address=127.0.0.1 -- --progress=log --log_every=50 \
    >>"$work/logs/trainer$1.log" 2>&1 &
  proc[trainer/$1]=$!
}

rest_as() { # TENANT PATH [CURL ARGS...]: the call with the tenant's token
  local tenant=$1 path=$2
  shift 2
  curl -sS -m 20 -H "Authorization: Bearer ${token_of[$tenant]}" "$@" "http://$http$path"
}
# Every job as the operator lists it, page after page: what jobs_tsv and the monitor read.
cat >"$work/listed_jobs.py" <<'PY'
import json, urllib.request
def list_jobs(http, token, timeout):
    jobs, page = [], ""
    while True:
        url = f"http://{http}/v1/jobs?page_size=1000" + (f"&page_token={page}" if page else "")
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = json.load(r)
        jobs += body.get("jobs", [])
        page = body.get("next_page_token", "")
        if not page:
            return jobs
PY

# jobs_tsv: every job the controller lists to the operator (all pages), a line each: id, tenant,
# state, preemptions, restarts, request. The controller is up whenever it is called (a restarted
# one is waited for); 3 tries, for a slow answer on a loaded machine.
jobs_tsv() {
  PYTHONPATH=$work /usr/bin/python3 - "$http" "${token_of[default]}" <<'PY'
from listed_jobs import list_jobs
import json, sys, time, urllib.request
http, token = sys.argv[1:3]
def listing():
    return list_jobs(http, token, timeout=20)
for attempt in range(3):
    try:
        jobs = listing()
        break
    except Exception as e:
        print(f"list the jobs: {e}", file=sys.stderr)
        if attempt == 2:
            sys.exit(1)
        time.sleep(1)
for j in jobs:
    print(j["id"], j.get("tenant") or "default", j["state"], j.get("preemptions", 0),
          j.get("restarts", 0), j.get("request", "JOB_REQUEST_NONE"))
PY
}
terminal() { case $1 in JOB_STATE_SUCCEEDED | JOB_STATE_FAILED | JOB_STATE_CANCELLED) return 0 ;; esac; return 1; }

# submit TENANT RANKS PRIORITY PREEMPTIBLE NAME -> job id. Every job is the same training run
# (data seed 1, $steps steps, a checkpoint every 50); RANKS ranks and as many optimizer servers.
# The tenant is the token's: spec.tenant stays empty.
submit() {
  local dir=$work/ckpt/$5 out
  out=$(rest_as "$1" /v1/jobs -H 'Content-Type: application/json' -d "{
    \"name\": \"$5\", \"priority\": $3, \"preemptible\": $4,
    \"model\": {\"layers\": 2, \"heads\": 2, \"channels\": 64, \"context\": 64},
    \"data\": {\"path\": \"$data\", \"seed\": 1},
    \"training\": {\"steps\": $steps, \"batch\": 8, \"seq_len\": 64},
    \"parallel\": {\"ranks\": $2, \"optimizer_servers\": $2},
    \"checkpoint\": {\"dir\": \"$dir\", \"every\": 50},
    \"eval\": {\"every\": 0, \"batches\": 1, \"sample_tokens\": 0},
    \"max_restarts\": 1000}") || return 1
  /usr/bin/python3 -c '
import json, sys
j = json.loads(sys.argv[1])
assert (j.get("tenant") or "default") == sys.argv[2], j
print(j["id"])' "$out" "$1" || {
    echo "submit for $1: $out" >&2
    return 1
  }
}

# Kills the component KIND INDEX and starts its replacement.
kill_one() { # KIND INDEX
  local kind=$1 index=$2
  kill9 "$kind/$index" "$kind"
  say "kill -9 $kind $index (pid $killed_pid); kill $kills"
  case $kind in
    server) start_server "$index" ;;
    trainer)
      start_trainer "$index"
      check_no_orphan_ranks "$grpc"
      ;;
    controller)
      incarnation=$((incarnation + 1))
      start_controller
      ;;
  esac
}
# The monitor: every second, the jobs as the operator sees them; per tenant, the RUNNING and
# CHECKPOINTING jobs' optimizer servers, ranks and count against the tenants file's quotas (the
# controller's own accounting: what a running job's spec asks for), and no worker in two running
# jobs. Every breach is a line of violations.log; at the end (monitor.stop) monitor.json holds the
# samples, the peaks per tenant and the preemption requests seen.
cat >"$work/monitor.py" <<'PY'
import listed_jobs  # beside it in $work
import collections, json, os, sys, time, urllib.request
http, token, tenants_file, out = sys.argv[1:5]
RUNNING = ("JOB_STATE_RUNNING", "JOB_STATE_CHECKPOINTING")
violations = open(os.path.join(out, "violations.log"), "a", buffering=1)
samples = down = 0
peak = collections.defaultdict(lambda: {"jobs": 0, "servers": 0, "ranks": 0})
preempt_requests = set()  # (job, attempt) seen with request PREEMPT
quota_waits = collections.Counter()  # tenant -> samples with a job held back by its quota

def list_jobs():
    return listed_jobs.list_jobs(http, token, timeout=5)

def violation(text):
    violations.write(f"{time.strftime('%H:%M:%S')} {text}\n")

while not os.path.exists(os.path.join(out, "monitor.stop")):
    start = time.time()
    try:
        jobs = list_jobs()
    except Exception:
        down += 1
        time.sleep(1)
        continue
    samples += 1
    quotas = {t["name"]: t for t in json.load(open(tenants_file))["tenants"]}
    load = collections.defaultdict(lambda: {"jobs": 0, "servers": 0, "ranks": 0, "ids": []})
    owner = {}
    for j in jobs:
        if j["state"] == "JOB_STATE_PENDING" and j.get("reason", "").startswith("waiting for quota"):
            quota_waits[j.get("tenant") or "default"] += 1
        if j["state"] not in RUNNING:
            continue
        tenant = j.get("tenant") or "default"
        parallel = j["spec"].get("parallel", {})
        l = load[tenant]
        l["jobs"] += 1
        l["servers"] += parallel.get("optimizer_servers", 1)
        l["ranks"] += parallel.get("ranks", 1)
        l["ids"].append(j["id"])
        for w in j.get("trainer_workers", []) + j.get("server_workers", []):
            if not w:  # a vacant slot: its worker lost its heartbeat, or the controller restarted
                continue
            if w in owner:
                violation(f"worker {w} is in running jobs {owner[w]} and {j['id']}")
            owner[w] = j["id"]
        if j.get("request") == "JOB_REQUEST_PREEMPT":
            preempt_requests.add((j["id"], j.get("attempt", 0)))
    for tenant, l in load.items():
        quota = quotas.get(tenant, {})
        for what, key in (("jobs", "max_running_jobs"), ("servers", "max_optimizer_servers"),
                          ("ranks", "max_ranks")):
            limit = int(quota.get(key, 0))
            if limit and l[what] > limit:
                violation(f"tenant {tenant} runs {l[what]} {what} (quota {limit}): "
                          f"{' '.join(l['ids'])}")
            peak[tenant][what] = max(peak[tenant][what], l[what])
    time.sleep(max(0.0, 1.0 - (time.time() - start)))
json.dump({"samples": samples, "down": down, "peak": peak, "quota_waits": quota_waits,
           "preempt_requests": len(preempt_requests)}, open(os.path.join(out, "monitor.json"), "w"))
PY

say "seed $seed, $minutes minutes, $steps steps a job, at most $max_live live, work $work"
start_controller
for k in 0 1; do start_server $k; done
for r in 0 1; do start_trainer $r; done
: >"$work/violations.log"
/usr/bin/python3 "$work/monitor.py" "$http" "${token_of[default]}" "$tenants" "$work" \
  >>"$work/logs/monitor.log" 2>&1 &
monitor=$!

# A job larger than a quota outright is refused at submit: team-b's 2x2.
refused=$(rest_as team-b /v1/jobs -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' \
  -d "{\"model\": {\"layers\": 2, \"heads\": 2, \"channels\": 64, \"context\": 64},
    \"data\": {\"path\": \"$data\"}, \"training\": {\"steps\": 10},
    \"parallel\": {\"ranks\": 2, \"optimizer_servers\": 2}}")
[ "$refused" = 400 ] || fail "team-b's 2x2 job (over its quota of 1 optimizer server): HTTP $refused, not 400"

# The references: each shape once, by the operator, with nothing else running.
declare -A reference
for ranks in 1 2; do
  id=$(submit default $ranks 0 true "ref-$ranks") || fail "submit the $ranks x $ranks reference"
  reference[$ranks]=$work/ckpt/ref-$ranks
  say "reference $ranks x $ranks: $id"
  for _ in $(seq 900); do
    state=$(rest_as default "/v1/jobs/$id" 2>/dev/null |
      /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || true)
    terminal "$state" && break
    sleep 1
  done
  [ "$state" = JOB_STATE_SUCCEEDED ] || fail "the $ranks x $ranks reference: $state"
  final_files "${reference[$ranks]}" >/dev/null
done
ref_ids=$(jobs_tsv | awk '{print $1}' | sort)
say "references done after $SECONDS s; chaos starts"

# The chaos. Each turn draws the same seven numbers whatever it does, so that a seed repeats the
# sequence of actions.
declare -A job_tenant job_ranks job_priority job_preemptible
submitted=() skipped=0 cancels=0
end_at=$((SECONDS + minutes * 60))
n=0
while [ "$SECONDS" -lt "$end_at" ]; do
  action=$((RANDOM % 10)) who=$((RANDOM % 2)) priority=$((RANDOM % 2 * 10))
  preemptible=$((RANDOM % 3)) ranks=$((RANDOM % 2 + 1)) index=$RANDOM delay=$((3 + RANDOM % 6))
  case $action in
    0 | 1 | 2 | 3) # submit
      listing=$(jobs_tsv) || fail "list the jobs"
      live=$(awk '$3 !~ /SUCCEEDED|FAILED|CANCELLED/' <<<"$listing" | wc -l)
      if [ "$live" -ge "$max_live" ]; then
        skipped=$((skipped + 1))
      else
        tenant=team-a
        [ "$who" = 1 ] && tenant=team-b ranks=1
        [ "$preemptible" = 0 ] && preemptible=false || preemptible=true
        n=$((n + 1))
        id=$(submit $tenant $ranks $priority $preemptible "job-$n") || fail "submit job-$n for $tenant"
        submitted+=("$id")
        job_tenant[$id]=$tenant job_ranks[$id]=$ranks job_priority[$id]=$priority
        job_preemptible[$id]=$preemptible
        echo "$id $tenant $ranks $priority $preemptible job-$n" >>"$work/submitted.tsv"
        say "submit $id: $tenant, ${ranks}x$ranks, priority $priority, preemptible $preemptible" \
          "($((live + 1)) live)"
      fi
      ;;
    4) # cancel
      listing=$(jobs_tsv) || fail "list the jobs"
      mapfile -t live_ids < <(awk '$3 !~ /SUCCEEDED|FAILED|CANCELLED/ && $1 !~ /^$/ {print $1}' \
        <<<"$listing" | grep -vxF -f <(echo "$ref_ids") || true)
      if [ "${#live_ids[@]}" -gt 0 ]; then
        id=${live_ids[$((index % ${#live_ids[@]}))]}
        code=$(rest_as "${job_tenant[$id]}" "/v1/jobs/$id:cancel" -X POST -o "$work/cancel.json" \
          -w '%{http_code}' -d '{"reason": "tenant soak"}' || true)
        case $code in
          200) cancels=$((cancels + 1)) && say "cancel $id (${job_tenant[$id]})" ;;
          400) say "cancel $id: refused ($(cat "$work/cancel.json")); it ended first" ;;
          *) fail "cancel $id with ${job_tenant[$id]}'s token: HTTP $code $(cat "$work/cancel.json")" ;;
        esac
      fi
      ;;
    5 | 6) kill_one server $((index % 2)) ;;
    7 | 8) kill_one trainer $((index % 2)) ;;
    9) kill_one controller 0 ;;
  esac
  sleep "$delay"
done
say "chaos over after $minutes min: ${#submitted[@]} jobs submitted, $cancels cancelled," \
  "$kills kills; waiting for the jobs left"

# Every job left runs to its end.
drain_end=$((SECONDS + drain_minutes * 60))
while :; do
  listing=$(jobs_tsv) || fail "list the jobs"
  live=$(awk '$3 !~ /SUCCEEDED|FAILED|CANCELLED/' <<<"$listing" | wc -l)
  [ "$live" = 0 ] && break
  # Nobody pauses a job here: a PAUSED one would wait forever.
  for id in $(awk '$3 == "JOB_STATE_PAUSED" {print $1}' <<<"$listing"); do
    fail "job $id is PAUSED, though nobody paused it: $(rest_as default "/v1/jobs/$id")"
  done
  [ "$SECONDS" -lt "$drain_end" ] || fail "$live jobs still not ended after $drain_minutes min: $listing"
  [ $((SECONDS % 60)) -lt 5 ] && say "$live jobs not ended yet"
  sleep 5
done
say "every job ended, $SECONDS s into the soak"
touch "$work/monitor.stop"
wait "$monitor" || fail "the monitor failed"

# Nothing lost, everything ended, nothing FAILED.
listing=$(jobs_tsv) || fail "list the jobs"
failed=0
for id in "${submitted[@]}"; do
  line=$(awk -v id="$id" '$1 == id' <<<"$listing")
  [ -n "$line" ] || fail "job $id (${job_tenant[$id]}) is gone: the controller lists it no more"
  read -r _ tenant state _ <<<"$line"
  [ "$tenant" = "${job_tenant[$id]}" ] || fail "job $id: tenant $tenant, submitted by ${job_tenant[$id]}"
  terminal "$state" || fail "job $id: $state after the drain"
  if [ "$state" = JOB_STATE_FAILED ]; then
    echo "FAILED: $id: $(rest_as default "/v1/jobs/$id")" >&2
    failed=$((failed + 1))
  fi
done
[ "$(wc -l <<<"$listing")" = $((${#submitted[@]} + 2)) ] ||
  fail "the controller lists $(wc -l <<<"$listing") jobs; submitted: ${#submitted[@]} and 2 references"
[ "$failed" = 0 ] || fail "$failed jobs FAILED"

# Every SUCCEEDED job's final checkpoint is the reference's of its shape, byte for byte.
succeeded=0 preempted_ok=0
for id in "${submitted[@]}"; do
  read -r _ _ state preemptions _ <<<"$(awk -v id="$id" '$1 == id' <<<"$listing")"
  [ "$state" = JOB_STATE_SUCCEEDED ] || continue
  name=$(awk -v id="$id" '$1 == id {print $6}' "$work/submitted.tsv")
  same_checkpoint "${reference[${job_ranks[$id]}]}" "$work/ckpt/$name" "job $id ($name)"
  succeeded=$((succeeded + 1))
  [ "$preemptions" -gt 0 ] && preempted_ok=$((preempted_ok + 1))
  rm -rf "${work:?}/ckpt/$name"
done

# Preemptions: only preemptible jobs of priority 0 were preempted, and each for a job of ours of
# priority 10 (what the events of the victim name).
echo "$listing" >"$work/final.tsv"
preemption_check=$(/usr/bin/python3 - "$http" "${token_of[default]}" "$work/submitted.tsv" \
  "$work/final.tsv" <<'PY'
import json, re, sys, urllib.request
http, token, submitted, final = sys.argv[1:5]
ours = {}
for line in open(submitted):
    id, tenant, ranks, priority, preemptible, name = line.split()
    ours[id] = (tenant, int(priority), preemptible == "true")
problems, events, across = [], 0, 0
for line in open(final):
    id, tenant, state, preemptions, restarts, request = line.split()
    if int(preemptions) == 0 or id not in ours:
        continue
    _, priority, preemptible = ours[id]
    if priority != 0 or not preemptible:
        problems.append(f"{id} (priority {priority}, preemptible {preemptible}) was preempted")
    req = urllib.request.Request(f"http://{http}/v1/jobs/{id}/events",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        for e in json.load(r).get("events", []):
            m = re.search(r"job (\S+) of priority (\d+) needs its workers", e.get("message", ""))
            if not m:
                continue
            events += 1
            for_id, for_priority = m.group(1), int(m.group(2))
            if for_id not in ours or ours[for_id][1] != for_priority or for_priority <= priority:
                problems.append(f"{id} (priority {priority}) preempted for {for_id} "
                                f"(priority {for_priority}): {e.get('message')}")
            elif ours[for_id][0] != ours[id][0]:
                across += 1
print(f"{events}|{across}|{'; '.join(problems)}")
PY
) || fail "read the preempted jobs' events"
IFS='|' read -r preempt_events preempt_across preempt_problems <<<"$preemption_check"
[ -z "$preempt_problems" ] || fail "preemptions: $preempt_problems"

# A tenant's token lists its own jobs only; every submit is in the audit log under its tenant.
for tenant in team-a team-b; do
  seen=$(rest_as $tenant "/v1/jobs?page_size=1000" | /usr/bin/python3 -c '
import json, sys
print(" ".join(sorted({j.get("tenant") or "default" for j in json.load(sys.stdin).get("jobs", [])})))')
  [ -z "$seen" ] || [ "$seen" = $tenant ] || fail "$tenant's token lists jobs of: $seen"
done
audit=$(/usr/bin/python3 - "$http" "${token_of[default]}" <<'PY'
import json, sys, urllib.request
http, token = sys.argv[1:3]
after = 0
while True:
    req = urllib.request.Request(f"http://{http}/v1/audit?after_sequence={after}&page_size=1000",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        records = json.load(r).get("records", [])
    for a in records:
        if a.get("action") == "submit" and a.get("code") == "OK":
            print(a.get("job_id", ""), a.get("tenant", ""))
    if not records:
        break
    after = int(records[-1]["sequence"])
PY
) || fail "read the audit log"
for id in "${submitted[@]}"; do
  grep -qxF "$id ${job_tenant[$id]}" <<<"$audit" || fail "no audit record of $id's submit by ${job_tenant[$id]}"
done

stop_all_and_check_nothing_left

count() { # STATE [TENANT]: submitted jobs in STATE (of TENANT)
  local c=0 id
  for id in "${submitted[@]}"; do
    [ -n "${2:-}" ] && [ "${job_tenant[$id]}" != "$2" ] && continue
    awk -v id="$id" -v s="$1" '$1 == id && $3 == s {found=1} END {exit !found}' <<<"$listing" &&
      c=$((c + 1))
  done
  echo $c
}
of_tenant() { local c=0 id; for id in "${submitted[@]}"; do [ "${job_tenant[$id]}" = "$1" ] && c=$((c + 1)); done; echo $c; }
preemptions=$(awk '{p += $4} END {print p + 0}' <<<"$listing")
preempted_jobs=$(awk '$4 > 0' <<<"$listing" | wc -l)
restarts=$(awk '{r += $5} END {print r + 0}' <<<"$listing")
monitor_summary=$(/usr/bin/python3 - "$work/monitor.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
peaks = "; ".join(f"{t}: {p['jobs']} job(s), {p['servers']} server(s), {p['ranks']} rank(s)"
                  f" ({m['quota_waits'].get(t, 0)} samples with a job held back by its quota)"
                  for t, p in sorted(m["peak"].items()) if t != "default")
print(f"{m['samples']}|{m['down']}|{m['preempt_requests']}|{peaks}")
PY
)
IFS='|' read -r samples down preempt_requests peaks <<<"$monitor_summary"
violations=$(wc -l <"$work/violations.log")
quota_breaches=$(grep -c ' tenant ' "$work/violations.log" || true)
double_booked=$(grep -c ' worker ' "$work/violations.log" || true)
cat <<EOF

| tenant soak | seed $seed, $((SECONDS / 60)) min ($minutes of chaos), $steps steps a job |
| --- | --- |
| jobs submitted | ${#submitted[@]} (team-a $(of_tenant team-a), team-b $(of_tenant team-b)); $skipped submits skipped at $max_live live |
| succeeded | $succeeded (team-a $(count JOB_STATE_SUCCEEDED team-a), team-b $(count JOB_STATE_SUCCEEDED team-b)), each final checkpoint byte-identical to the reference of its shape; $preempted_ok of them preempted and resumed |
| cancelled | $(count JOB_STATE_CANCELLED) ($cancels cancels accepted) |
| failed | $(count JOB_STATE_FAILED) |
| preemptions | $preemptions, of $preempted_jobs jobs, each of priority 0 and preemptible; $preempt_events preemption events, each for a job of priority 10, $preempt_across of them for another tenant's (the monitor saw $preempt_requests preemption requests in progress) |
| restarts | $restarts |
| kills | $kills: optimizer servers ${killed_kind[server]:-0}, trainer workers ${killed_kind[trainer]:-0}, the controller ${killed_kind[controller]:-0} |
| quota violations | $quota_breaches in $samples samples ($down more while the controller was down); workers in two running jobs at once: $double_booked |
| running at once, at most (quota) | $peaks |
| left behind | no process, no /dev/shm segment |
EOF
# Quotas: no breach seen (after the table, which counts them).
[ "$violations" = 0 ] || fail "quota or worker violations:
$(cat "$work/violations.log")"
say "PASS: seed $seed"
