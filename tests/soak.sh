#!/usr/bin/env bash
# The soak (opt-in; docs/RELIABILITY.md): jobs through a real controller pool with checkpoints and
# max_restarts, while a loop kills -9 a random component (an optimizer server, a trainer worker,
# the controller) every few tens of steps and starts a replacement. Beside it, a second pool that
# nobody touches runs the same job. For SOAK_MINUTES (30) it runs round after round; each round
# must end SUCCEEDED with the final checkpoint byte-identical to the untouched pool's. At the end:
# no process of the soak left (no orphan ranks of killed workers), no /dev/shm segment left
# behind, and the controller's memory flat (the untouched pool's controller, which lives the whole
# soak, sampled every few seconds).
#
# usage: tests/soak.sh [BUILD_DIR]      (default: build; the binaries are in BUILD_DIR/bin)
#   SOAK_MINUTES=30   how long the kill loop runs (whole rounds: the last one may run over)
#   SOAK_STEPS=2000   steps of each round's job
#   SOAK_SEED=...     the kill loop's random seed (printed; the same seed kills in the same order)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bin=$(cd "${1:-build}/bin" && pwd)
minutes=${SOAK_MINUTES:-30}
steps=${SOAK_STEPS:-2000}
seed=${SOAK_SEED:-$RANDOM}
RANDOM=$seed
data=$root/data/tinyshakespeare.txt
work=$(mktemp -d /tmp/offload-soak-XXXXXX)
soak_name=soak
source tests/soak_lib.sh
mkdir -p "$work/logs"
echo "soak-token-$RANDOM$RANDOM$RANDOM" >"$work/token"
token=$(cat "$work/token")
unset OFFLOAD_TOKEN OFFLOAD_SHARD_TOKEN

# One pool: a controller on fixed ports (so a restarted one is found where it was), 2 optimizer
# servers and 2 trainer workers. Pool P's processes are in ${P}_server[k], ${P}_trainer[r],
# ${P}_controller.
declare -A grpc_of http_of controller_of
start_controller() {  # POOL
  "$bin/job_controller" --grpc_address="${grpc_of[$1]}" --http_address="${http_of[$1]}" \
    --store="$work/$1.db" --token_file="$work/token" --heartbeat_interval=200ms \
    --heartbeat_timeout=3s >>"$work/logs/$1-controller.log" 2>&1 &
  proc[$1/controller/0]=$!
  for _ in $(seq 100); do
    curl -sf "http://${http_of[$1]}/healthz" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  fail "pool $1: the controller did not come up"
}
start_server() {  # POOL K
  "$bin/cpu_optimizer_server" --listen=127.0.0.1:0 --controller="${grpc_of[$1]}" \
    --token_file="$work/token" --memory_limit_mib=512 --threads=1 \
    >>"$work/logs/$1-server$2.log" 2>&1 &
  proc[$1/server/$2]=$!
}
start_trainer() {  # POOL R
  "$bin/gpu_trainer" --controller="${grpc_of[$1]}" --token_file="$work/token" \
    --rank_address=127.0.0.1 -- --progress=log --log_every=50 \
    >>"$work/logs/$1-trainer$2.log" 2>&1 &
  proc[$1/trainer/$2]=$!
}
start_pool() {  # POOL
  grpc_of[$1]=127.0.0.1:$(free_port)
  http_of[$1]=127.0.0.1:$(free_port)
  start_controller "$1"
  for k in 0 1; do start_server "$1" $k; done
  for r in 0 1; do start_trainer "$1" $r; done
}

rest() {  # POOL PATH [CURL ARGS...]
  local pool=$1 path=$2
  shift 2
  curl -sS -m 5 -H "Authorization: Bearer $token" "$@" "http://${http_of[$pool]}$path"
}
field() {  # POOL JOB PYTHON_EXPR (on the job's JSON as j); empty while the controller is down
  rest "$1" "/v1/jobs/$2" 2>/dev/null |
    /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($3)" 2>/dev/null || true
}
submit() {  # POOL ROUND -> job id
  local dir=$work/ckpt-$1-$2
  rest "$1" /v1/jobs -H 'Content-Type: application/json' -d "{
    \"name\": \"soak-$2\",
    \"model\": {\"layers\": 2, \"heads\": 2, \"channels\": 64, \"context\": 64},
    \"data\": {\"path\": \"$data\", \"seed\": $2},
    \"training\": {\"steps\": $steps, \"batch\": 8, \"seq_len\": 64},
    \"parallel\": {\"ranks\": 2, \"optimizer_servers\": 2},
    \"checkpoint\": {\"dir\": \"$dir\", \"every\": 10},
    \"eval\": {\"every\": 0, \"batches\": 1, \"sample_tokens\": 0},
    \"max_restarts\": 1000}" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'
}

# The controllers' resident sizes, sampled into rss.tsv: "calm" or the chaos controller's
# incarnation, seconds, KiB. The calm pool's controller lives the whole soak and serves the same
# jobs: its curve is the one that must stay flat.
incarnation=0
sample_rss() {
  local who pid kib
  for who in calm chaos; do
    pid=${proc[$who/controller/0]}
    kib=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ "$who" = chaos ] && who=$incarnation
    [ -n "$kib" ] && echo "$who $SECONDS $kib" >>"$work/rss.tsv"
  done
  return 0
}

# Kills one random component of the chaos pool and starts its replacement.
kill_one() {
  local pick=$((RANDOM % 5)) kind index
  case $pick in
    0 | 1) kind=server index=$((RANDOM % 2)) ;;
    2 | 3) kind=trainer index=$((RANDOM % 2)) ;;
    4) kind=controller index=0 ;;
  esac
  kill9 "chaos/$kind/$index" "$kind"
  say "kill -9 $kind $index (pid $killed_pid) at step $1; kill $kills"
  case $kind in
    server) start_server chaos "$index" ;;
    trainer) start_trainer chaos "$index" ;;
    controller)
      incarnation=$((incarnation + 1))
      start_controller chaos
      ;;
  esac
}

say "seed $seed, $minutes minutes, $steps steps a round, work $work"
start_pool chaos
start_pool calm
round=0
end_at=$((SECONDS + minutes * 60))
while [ "$SECONDS" -lt "$end_at" ]; do
  round=$((round + 1))
  chaos_job=$(submit chaos $round) || fail "submit to the chaos pool"
  calm_job=$(submit calm $round) || fail "submit to the calm pool"
  say "round $round: $chaos_job (chaos) beside $calm_job (calm)"
  next_kill=$((20 + RANDOM % 41))
  while :; do
    sample_rss
    state=$(field chaos "$chaos_job" "j['state']")
    [ "$state" = JOB_STATE_SUCCEEDED ] && break
    [ "$state" = JOB_STATE_FAILED ] || [ "$state" = JOB_STATE_CANCELLED ] &&
      fail "round $round: $(field chaos "$chaos_job" "j['state'], j.get('reason')")"
    step=$(field chaos "$chaos_job" "j.get('progress', {}).get('step', 0)")
    if [ -n "$step" ] && [ "$state" = JOB_STATE_RUNNING ] && [ "$step" -ge "$next_kill" ] &&
      [ "$step" -lt "$steps" ]; then
      kill_one "$step"
      check_no_orphan_ranks "${grpc_of[chaos]}"
      next_kill=$((step + 20 + RANDOM % 41))
    fi
    sleep 2
  done
  for _ in $(seq 600); do
    [ "$(field calm "$calm_job" "j['state']")" = JOB_STATE_SUCCEEDED ] && break
    sleep 1
  done
  [ "$(field calm "$calm_job" "j['state']")" = JOB_STATE_SUCCEEDED ] ||
    fail "round $round: the calm job did not succeed"
  restarts=$(field chaos "$chaos_job" "j.get('restarts', 0)")
  same_checkpoint "$work/ckpt-calm-$round" "$work/ckpt-chaos-$round" "round $round"
  say "round $round: SUCCEEDED after $restarts restarts; final checkpoint byte-identical" \
    "($(ls "$(final_files "$work/ckpt-calm-$round")" | wc -l) files)"
  rm -rf "$work/ckpt-chaos-$round" "$work/ckpt-calm-$round"
done

stop_all_and_check_nothing_left

# Memory: the calm controller's resident size in the last quarter of the soak against the second
# quarter (after the warm-up): growth with the jobs, steps and reports would show there. The
# chaos controller's incarnations, each reloading the store, are reported beside it.
memory=$(/usr/bin/python3 - "$work/rss.tsv" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    who, t, kib = line.split()
    runs[who].append((int(t), int(kib)))
calm = runs.pop("calm")
n = len(calm)
second = statistics.median(k for _, k in calm[n // 4: n // 2])
last = statistics.median(k for _, k in calm[3 * n // 4:])
ok = last <= 1.25 * second + 2048
chaos = [k for s in runs.values() for _, k in s]
print(f"{'ok' if ok else 'GREW'}: the calm controller over {calm[-1][0] - calm[0][0]} s "
      f"({n} samples): {second / 1024:.1f} MiB in the second quarter, {last / 1024:.1f} MiB in "
      f"the last; the chaos controller's {len(runs)} incarnations "
      f"{min(chaos) / 1024:.1f}-{max(chaos) / 1024:.1f} MiB")
PY
)
say "controller memory: $memory"
case $memory in ok*) ;; *) fail "the controller's memory grew: $memory" ;; esac
say "PASS: $round rounds in $((SECONDS / 60)) min, $kills kills survived" \
  "(servers ${killed_kind[server]:-0}, trainer workers ${killed_kind[trainer]:-0}," \
  "controller ${killed_kind[controller]:-0}); every round byte-identical to the untouched pool;" \
  "no process or /dev/shm segment left; seed $seed"
