#!/usr/bin/env bash
# Several hosts on one machine (issue 18): every process of a pool in its own network namespace,
# with its own address on one L2 segment (a bridge in a namespace of its own, one veth per host),
# so that nothing talks over loopback. docs/RELIABILITY.md, "Several hosts on one machine", has
# the topology, the bounds and the measured times. Checks:
#   1. a 2x2 job (2 trainer ranks, 2 optimizer servers, the controller: 5 hosts) succeeds over
#      gRPC and over UCX on TCP (UCX_TLS=tcp on every side), and with ZeRO stage 3 over gRPC (the
#      ranks' parameter gathers meet through the controller's rendezvous), and says which plane
#      auto picks;
#   2. a. an optimizer server's switch port goes down mid-step: both trainer ranks are gone
#         within a bound derived from the heartbeat timeout, and once a replacement server joins
#         (a new host) the job restarts from its checkpoint and succeeds;
#      b. only the trainers' path to a shard is cut (blackhole routes; the server still reaches
#         the controller): a rank fails by itself, UNAVAILABLE naming the shard, within the bound
#         of the shard channel's gRPC keepalive, and the job restarts and succeeds;
#      c. an optimizer server is stopped (SIGSTOP) mid-step: the attempt ends within the bound of
#         2a; the server, continued, rejoins; the job restarts from its checkpoint and ends
#         byte-identical to the same job run without the stop;
#   3. the controller's port goes down during a running attempt:
#      a. for longer than a heartbeat interval and well within the heartbeat timeout: the ranks
#         keep stepping meanwhile, and the same attempt ends SUCCEEDED once the link is back;
#      b. for longer than the heartbeat timeout: the ranks keep stepping meanwhile; then the
#         documented behaviour: the controller has failed the attempt, stops it when the workers
#         are back, and the job resumes from a checkpoint written during the cut and succeeds.
# The measured times are printed; bounds and reasons are next to each case below.
# Needs root (ip netns); without it, or where namespaces cannot be made, it prints a SKIP line and
# exits 0, except with $CI set (or OFFLOAD_REQUIRE_NETNS=1), where it fails instead.
# usage: multihost_test.sh CONTROLLER SERVER TRAINER DATA
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 data=$4
work=$(mktemp -d /tmp/offload-multihost-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"

# Namespace and interface names carry this script's pid: parallel runs do not collide. Interface
# names stay within 15 characters ("om<pid><host>x").
p=om$$
bridge_ns=${p}-br
hosts=()  # the host names given to add_host

cleanup() {
  local h ns pid
  for pid in "${pids[@]}"; do { kill -9 "$pid" && wait "$pid"; } 2>/dev/null || true; done
  # Whatever still runs inside a namespace (a rank a worker spawned), by its pid.
  for ns in "${hosts[@]/#/${p}-}" "$bridge_ns"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  # Deleting a namespace deletes the veth ends in it, and with them their peers.
  for ns in "${hosts[@]/#/${p}-}" "$bridge_ns"; do ip netns del "$ns" 2>/dev/null || true; done
  for h in "${hosts[@]}"; do ip link del "${p}${h}a" 2>/dev/null || true; done
  if [ -n "${MULTIHOST_KEEP:-}" ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do
    [ -f "$f" ] && { echo "--- $f"; tail -n 15 "$f"; } >&2
  done
  exit 1
}
step() { echo "== $*"; }
now() { date +%s.%N; }
since() { printf "%.1f" "$(echo "$(now) - $1" | bc)"; }

skip() {
  if [ -n "${CI:-}" ] || [ "${OFFLOAD_REQUIRE_NETNS:-0}" = 1 ]; then
    fail "$* (CI must run this test: it runs as root there)"
  fi
  echo "multihost_test: SKIP: $*"
  exit 0
}
[ "$(id -u)" = 0 ] || skip "needs root for network namespaces"
ip netns add "$bridge_ns" 2>"$work/netns.err" ||
  skip "ip netns add failed: $(cat "$work/netns.err")"
ip -n "$bridge_ns" link set lo up
ip -n "$bridge_ns" link add br0 type bridge
ip -n "$bridge_ns" link set br0 up

# add_host NAME ADDRESS: a namespace ${p}-NAME whose eth0 (ADDRESS/24) is plugged into the
# bridge through port ${p}NAMEb.
add_host() {
  local ns=${p}-$1
  hosts+=("$1")
  ip netns add "$ns"
  ip link add "${p}$1a" type veth peer name "${p}$1b"
  ip link set "${p}$1a" netns "$ns"
  ip -n "$ns" link set "${p}$1a" name eth0
  ip link set "${p}$1b" netns "$bridge_ns"
  ip -n "$bridge_ns" link set "${p}$1b" master br0 up
  ip -n "$ns" addr add "$2/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
}
# port NAME up|down: the switch port of host NAME (the host's own eth0 stays up and keeps its
# address, as when a cable or a switch port fails: packets vanish, nobody is told).
port() { ip -n "$bridge_ns" link set "${p}$1b" "$2"; }
# on NAME CMD...: CMD inside host NAME's namespace.
on() { local ns=${p}-$1; shift; ip netns exec "$ns" "$@"; }

subnet=10.123.0
declare -A addr=([ctl]=$subnet.1 [s0]=$subnet.11 [s1]=$subnet.12 [s2]=$subnet.13
  [t0]=$subnet.21 [t1]=$subnet.22)
for h in ctl s0 s1 t0 t1; do add_host "$h" "${addr[$h]}"; done
controller=${addr[ctl]}:7070

# UCX, where a job asks for it, runs on TCP over the veths: every pool process reads this.
export UCX_TLS=tcp
echo "secret-token-$$" >"$work/token"
token=$(cat "$work/token")

# bg NAME LOG CMD...: CMD in host NAME, niced, in the background; sets $bg_pid (ip netns exec
# execs the command: the pid is the process's own).
bg() {
  local h=$1 log=$2
  shift 2
  # Made here, not by the background redirection: the caller reads it at once.
  : >"$log"
  ip netns exec "${p}-$h" nice -n 10 "$@" >"$log" 2>&1 &
  bg_pid=$!
  pids+=("$bg_pid")
}

heartbeat_interval=200ms
heartbeat_timeout_s=3
# start_controller LOG: the controller on host ctl; its REST gateway is also on the namespace's
# loopback, so that the test reaches it while the controller's port is down.
start_controller() {
  bg ctl "$1" "$controller_bin" --grpc_address="$controller" --http_address=0.0.0.0:8080 \
    --store="$work/jobs.db" --token_file="$work/token" --heartbeat_interval=$heartbeat_interval \
    --heartbeat_timeout=${heartbeat_timeout_s}s
  controller_pid=$bg_pid
  for _ in $(seq 100); do
    grep -q '^job_controller: grpc ' "$1" && return 0
    sleep 0.1
  done
  fail "the controller did not start"
}
# start_server NAME: an optimizer server on host NAME, in the pool; sets server_pid[NAME].
declare -A server_pid server_worker trainer_pid
start_server() {
  bg "$1" "$work/server-$1.log" "$server_bin" --listen=0.0.0.0:50051 \
    --advertise="${addr[$1]}:50051" --controller="$controller" --token_file="$work/token" \
    --threads=1
  server_pid[$1]=$bg_pid
  for _ in $(seq 100); do
    server_worker[$1]=$(sed -n 's/.* joined controller .* as worker \([^ ]*\) .*/\1/p' \
      "$work/server-$1.log")
    [ -n "${server_worker[$1]}" ] && return 0
    sleep 0.1
  done
  fail "server $1 did not join the pool"
}
# start_trainer NAME [private_shm]: a trainer pool worker on host NAME; its ranks time
# collectives out after $collective_timeout_s and log every 5 steps. With private_shm the worker
# and its ranks get a /dev/shm of their own (a tmpfs in their mount namespace), as on another
# machine.
collective_timeout_s=30
start_trainer() {
  local mount=()
  [ "${2-}" = private_shm ] && mount=(sh -c 'mount -t tmpfs shm /dev/shm && exec "$@"' sh)
  trainer_runs=$((${trainer_runs:-0} + 1))
  bg "$1" "$work/trainer-$1-$trainer_runs.log" "${mount[@]}" "$trainer_bin" \
    --controller="$controller" --token_file="$work/token" --rank_address="${addr[$1]}" -- \
    --collective_timeout=${collective_timeout_s}s --progress=log --log_every=5
  trainer_pid[$1]=$bg_pid
}
# stop_trainer NAME: SIGTERM to the worker (it ends its rank, if any, like a Ctrl-C).
stop_trainer() {
  kill -TERM "${trainer_pid[$1]}"
  wait "${trainer_pid[$1]}" 2>/dev/null || true
}
# The pids of the ranks the trainer workers run now.
rank_pids() { for h in t0 t1; do ps -o pid= --ppid "${trainer_pid[$h]}" || true; done; }

json() {
  /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); print(eval('d'+sys.argv[1]))" "$1"
}
get() { on ctl curl -sS -m 5 -H "Authorization: Bearer $token" "http://127.0.0.1:8080$1"; }
post() {
  on ctl curl -sS -m 5 -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
    -d "$2" "http://127.0.0.1:8080$1"
}
field() { get "/v1/jobs/$1" | json "$2"; }
state_of() { field "$1" "['state']"; }
wait_state() {  # JOB STATE TIMEOUT_S
  local s
  for _ in $(seq $(($3 * 5))); do
    s=$(state_of "$1")
    [ "$s" = "$2" ] && return 0
    case $s in JOB_STATE_SUCCEEDED | JOB_STATE_FAILED | JOB_STATE_CANCELLED)
      fail "job $1 ended $s, not $2: $(field "$1" ".get('reason', '')")" ;;
    esac
    sleep 0.2
  done
  fail "job $1 did not reach $2 in $3 s (now $(state_of "$1"))"
}
# submit NAME TRANSPORT STEPS [CHECKPOINT_DIR [PARALLEL]]: a 2x2 job of the tiny model; prints its
# id. With CHECKPOINT_DIR it checkpoints every 20 steps and may restart once; PARALLEL adds fields
# to the job's parallel section (", \"zero_stage\": 3").
submit() {
  local restart=""
  [ -z "${4-}" ] ||
    restart=", \"checkpoint\": {\"dir\": \"$4\", \"every\": 20}, \"max_restarts\": 1"
  post /v1/jobs "{\"name\": \"$1\", \"data\": {\"path\": \"$data\"},
    \"model\": {\"layers\": 2, \"heads\": 2, \"channels\": 32, \"context\": 32},
    \"training\": {\"steps\": $3, \"batch\": 8, \"seq_len\": 32},
    \"eval\": {\"every\": 0, \"batches\": 1, \"sample_tokens\": 0},
    \"parallel\": {\"ranks\": 2, \"optimizer_servers\": 2, \"transport\": \"$2\"${5-}}$restart}" |
    json "['id']"
}
# attempt_log JOB ATTEMPT: what rank 0 of that attempt printed (from its worker's log).
attempt_log() {
  local f
  for f in "$work"/trainer-*.log; do
    awk -v m="runs rank 0 of 2 of $1 (attempt $2)" '
      /gpu_trainer: worker .* runs rank / { mine = index($0, m) > 0; next }
      mine' "$f"
  done
}
# plane_of JOB ATTEMPT: the data plane that attempt's rank 0 says it uses.
plane_of() { attempt_log "$1" "$2" | sed -n 's/.*, data plane \([a-z]*\);.*/\1/p'; }
# last_step JOB ATTEMPT: the last "step N/M" line that attempt's rank 0 logged (0: none yet).
last_step() {
  local n
  n=$(attempt_log "$1" "$2" | sed -n 's/^step \([0-9]*\)\/.*/\1/p' | tail -n 1)
  echo "${n:-0}"
}
# wait_step JOB ATTEMPT STEP TIMEOUT_S: until that attempt's rank 0 logged step STEP or later.
wait_step() {
  for _ in $(seq $(($4 * 10))); do
    [ "$(last_step "$1" "$2")" -ge "$3" ] && return 0
    sleep 0.1
  done
  fail "attempt $2 of $1 did not reach step $3 in $4 s (at $(last_step "$1" "$2"))"
}
# events JOB: the job's event messages, one a line.
events() {
  get "/v1/jobs/$1/events" |
    /usr/bin/python3 -c 'import json,sys
for e in json.load(sys.stdin)["events"]: print(e["message"])'
}
# attempt_of JOB, restarts_of JOB (protobuf JSON leaves zeros out).
attempt_of() { field "$1" ".get('attempt', 0)"; }
restarts_of() { field "$1" ".get('restarts', 0)"; }
# resumed_at JOB ATTEMPT: the step that attempt's rank 0 resumed from (empty: it did not).
resumed_at() { attempt_log "$1" "$2" | sed -n 's/.*resumed from .* at step \([0-9]*\).*/\1/p'; }
# cut_begins: notes the time of a cut, once both ranks run (their pids are the workers' children).
cut_begins() {
  [ "$(rank_pids | wc -w)" = 2 ] || fail "not two ranks before the cut: $(rank_pids | tr '\n' ' ')"
  cut_at=$(now)
}
# wait_ranks_gone BOUND_S: waits until no trainer worker has a rank, at most BOUND_S (then fails);
# sets $took to the seconds since $cut_at.
wait_ranks_gone() {
  while [ -n "$(rank_pids)" ]; do
    [ "$(echo "$(now) - $cut_at > $1" | bc)" = 0 ] ||
      fail "ranks $(rank_pids | tr '\n' ' ')still run $1 s after the cut"
    sleep 0.05
  done
  took=$(since "$cut_at")
}

test_start=$(now)
start_controller "$work/controller.log"
for h in s0 s1; do start_server "$h"; done
for h in t0 t1; do start_trainer "$h"; done

step "1. a 2x2 job across 5 hosts: gRPC, UCX on TCP, and what auto picks"
for plane in grpc ucx; do
  t=$(now)
  job=$(submit "$plane" "$plane" 30)
  wait_state "$job" JOB_STATE_SUCCEEDED 60
  [ "$(plane_of "$job" 1)" = "$plane" ] || fail "job $job ran on '$(plane_of "$job" 1)'"
  echo "$plane: 30 steps, succeeded in $(since "$t") s"
done
# ZeRO-3 across hosts: the ranks' layer gathers meet through the controller's rendezvous too.
job=$(submit zero3 grpc 30 "" ', "zero_stage": 3')
wait_state "$job" JOB_STATE_SUCCEEDED 60
attempt_log "$job" 1 | grep -q "ZeRO stage 3: this rank holds" ||
  fail "job $job did not run ZeRO stage 3"
echo "zero_stage 3 over gRPC: 30 steps, succeeded"
job=$(submit auto auto 30)
wait_state "$job" JOB_STATE_SUCCEEDED 60
auto_shared=$(plane_of "$job" 1)
echo "auto, every namespace on the one /dev/shm: $auto_shared"
[ "$auto_shared" = shm ] || fail "auto picked '$auto_shared' with a shared /dev/shm"
# The trainers move to hosts with a /dev/shm of their own: the shard's segment is not there, the
# proof fails, and auto falls back to UCX. The controller forgets the old workers a heartbeat
# timeout after their last beat (a stopped worker does not sign off).
for h in t0 t1; do stop_trainer "$h"; done
sleep $((heartbeat_timeout_s + 1))
for h in t0 t1; do start_trainer "$h" private_shm; done
job=$(submit auto-private-shm auto 30)
wait_state "$job" JOB_STATE_SUCCEEDED 60
auto_private=$(plane_of "$job" 1)
echo "auto, trainers with a /dev/shm of their own: $auto_private"
[ "$auto_private" = ucx ] || fail "auto picked '$auto_private' without a shared /dev/shm"

step "2a. an optimizer server's port goes down mid-step; a replacement server joins"
job=$(submit cut-server grpc 200 "$work/ckpt-2a")
wait_step "$job" 1 45 60
port s1 down
cut_begins
# Two things can end the attempt, whichever comes first: the ranks' own shard channels (about
# 6.2 s mid-step, see 2b), or the controller, which vacates the server's slot a heartbeat timeout
# after its last beat and fails the attempt when nobody has taken the slot back twice the timeout
# later (both checked every heartbeat interval), the trainer workers then killing their ranks
# with their next heartbeat: 3 s + 6 s + 3 x 0.2 s.
bound_2a=$((3 * heartbeat_timeout_s + 2))
wait_ranks_gone $bound_2a
took_2a=$took
echo "both ranks gone ${took_2a} s after the cut (bound ${bound_2a} s)"
for _ in $(seq 50); do [ "$(restarts_of "$job")" = 1 ] && break; sleep 0.1; done
[ "$(restarts_of "$job")" = 1 ] || fail "no restart: $(get "/v1/jobs/$job")"
field "$job" "['reason']" |
  grep -Eq "${server_worker[s1]} .*lost its heartbeat|optimizer shard ${addr[s1]}:50051" ||
  fail "the restart does not name the lost server: $(field "$job" "['reason']")"
# The cut-off host is gone for good; a new host takes its shard.
{ kill -9 "${server_pid[s1]}" && wait "${server_pid[s1]}"; } 2>/dev/null || true
add_host s2 "${addr[s2]}"
start_server s2
wait_state "$job" JOB_STATE_SUCCEEDED 90
[ "$(attempt_of "$job")" = 2 ] || fail "job $job ended in attempt $(attempt_of "$job")"
resumed=$(resumed_at "$job" 2)
[ -n "$resumed" ] && [ "$resumed" -ge 40 ] ||
  fail "attempt 2 did not resume from a checkpoint at step >= 40: $(attempt_log "$job" 2 | head)"
echo "attempt 2 resumed at step $resumed on ${addr[s0]} and ${addr[s2]}, and succeeded"

step "2b. only the trainers' path to a shard is cut; the server still reaches the controller"
job=$(submit cut-path grpc 300 "$work/ckpt-2b")
wait_step "$job" 1 25 60
# Blackhole routes both ways: the packets vanish, as on a broken path; nothing is reset.
for h in t0 t1; do on "$h" ip route add blackhole "${addr[s2]}/32"; done
for h in t0 t1; do on s2 ip route add blackhole "${addr[$h]}/32"; done
cut_begins
# Only the shard channel can tell (cpu_optimizer_server/grpc/shard_client.cc): keepalive
# pings every 10 s, 5 s to answer, and gRPC sets TCP_USER_TIMEOUT to those 5 s, so a step's data
# left unacknowledged closes the connection when TCP's next retransmission is due after 5 s
# (0.2, 0.6, 1.4, 3.0, 6.2 s after the send): about 6.2 s mid-step, about 10 + 6.2 s on an idle
# connection. The call fails UNAVAILABLE, the rank exits, its worker reports with its next
# heartbeat and the other rank is stopped as in 2a (0.6 s). The ranks' collective timeout
# (30 s) is longer, so that it is not what fires first.
bound_2b=$((10 + 5 + 2))
wait_ranks_gone $bound_2b
took_2b=$took
echo "both ranks gone ${took_2b} s after the cut (bound ${bound_2b} s)"
for h in t0 t1; do on "$h" ip route del blackhole "${addr[s2]}/32"; done
for h in t0 t1; do on s2 ip route del blackhole "${addr[$h]}/32"; done
wait_state "$job" JOB_STATE_SUCCEEDED 90
[ "$(attempt_of "$job")" = 2 ] || fail "job $job ended in attempt $(attempt_of "$job")"
# The rank may be in a checkpoint write when the cut hits: then rank 0's error carries the shard's.
# The job's events keep the first rank's error only, and that can be the other rank's collective
# failing as the first one exits (its worker heartbeat first): then the ranks' own logs say it.
# Only this part cuts the path to ${addr[s2]}, so a rank's error naming it is this job's.
shard_error="UNAVAILABLE: (.*: )?optimizer shard ${addr[s2]}:50051"
grep -qE "$shard_error" <<<"$(events "$job")" ||
  cat "$work"/trainer-*.log | grep -qE "gpu_trainer rank [0-9]+: $shard_error" ||
  fail "no rank failed on its own naming the shard: $(events "$job")"
[ -n "$(resumed_at "$job" 2)" ] || fail "attempt 2 did not resume"
echo "a rank failed UNAVAILABLE naming ${addr[s2]}:50051; attempt 2 resumed at step" \
  "$(resumed_at "$job" 2) and succeeded"

step "2c. an optimizer server stops (SIGSTOP) mid-step; it is continued once the ranks are gone"
# The reference: the same job, uninterrupted, for the bytes the restarted one must end with.
job=$(submit straight-2c grpc 200 "$work/ckpt-2c-straight")
wait_state "$job" JOB_STATE_SUCCEEDED 90
job=$(submit stop-server grpc 200 "$work/ckpt-2c")
wait_step "$job" 1 45 60
kill -STOP "${server_pid[s2]}"
cut_begins
# Its sockets stay open and the kernel still acknowledges what the ranks send, so TCP notices
# nothing; its worker's heartbeats stop with it, so the controller's path of 2a ends the attempt
# (3 s + 6 s + 3 x 0.2 s), before the rank's keepalive (10 s + 5 s) and step timeout (60 s). Here
# no rank cuts it short as in 2a: the whole path runs, and the bound allows it 3 s of delay.
bound_2c=$((3 * heartbeat_timeout_s + 4))
wait_ranks_gone $bound_2c
took_2c=$took
echo "both ranks gone ${took_2c} s after the stop (bound ${bound_2c} s)"
# Continued, the server is a live member again: the old attempt's streams are gone and its job is
# dropped, so whatever it still held must not reach attempt 2, which may well run on it.
kill -CONT "${server_pid[s2]}"
wait_state "$job" JOB_STATE_SUCCEEDED 90
[ "$(attempt_of "$job")" = 2 ] || fail "job $job ended in attempt $(attempt_of "$job")"
[ -n "$(resumed_at "$job" 2)" ] || fail "attempt 2 did not resume"
steps=200 same_checkpoint "$work/ckpt-2c-straight" "$work/ckpt-2c" "a server stopped and continued"
echo "attempt 2 resumed at step $(resumed_at "$job" 2) and ended byte-identical to the" \
  "uninterrupted run"

# cut_controller JOB SECONDS: the controller's port goes down for SECONDS while attempt 1 of JOB
# runs; checks that its rank 0 keeps stepping meanwhile. Sets $before and $stepped.
cut_controller() {
  local after
  before=$(last_step "$1" 1)
  port ctl down
  sleep "$2"
  after=$(last_step "$1" 1)
  port ctl up
  stepped=$((after - before))
  [ "$stepped" -ge 5 ] ||
    fail "the ranks did not step while the controller was cut off (steps $before to $after)"
  echo "rank 0 stepped from $before to $after while the controller was unreachable"
}

# A heartbeat lost in the cut reaches the controller only with TCP's next retransmission after
# the link is back, and those back off (0.2, 0.6, 1.4, 3.0 s after the send): a cut of D silences
# a worker for up to about 2 D. 1 s stays well inside the 3 s timeout; 2 s does not (see
# docs/RELIABILITY.md).
cut_3a=${MULTIHOST_CUT_3A:-1}
step "3a. the controller's port goes down for $cut_3a s (heartbeat $heartbeat_interval," \
  "timeout ${heartbeat_timeout_s} s)"
job=$(submit cut-controller grpc 300 "$work/ckpt-3a")
wait_step "$job" 1 20 60
cut_controller "$job" "$cut_3a"
wait_state "$job" JOB_STATE_SUCCEEDED 90
[ "$(attempt_of "$job")" = 1 ] && [ "$(restarts_of "$job")" = 0 ] ||
  fail "the cut stopped the attempt: $(events "$job")"
echo "attempt 1 went on and succeeded"

# Longer than the heartbeat timeout: the controller declares every worker dead and vacates their
# slots, for twice the timeout; the ranks do not know and keep training. When the link is back the
# workers' next beats are answered NOT_FOUND, they register again with what they run, and the
# controller gives them their slots back: attempt 1 goes on and succeeds, with no restart.
cut_3b=$((heartbeat_timeout_s + 2))
step "3b. the controller's port goes down for $cut_3b s, longer than the heartbeat timeout"
job=$(submit cut-controller-long grpc 500 "$work/ckpt-3b")
wait_step "$job" 1 20 60
cut_controller "$job" "$cut_3b"
wait_state "$job" JOB_STATE_SUCCEEDED 90
[ "$(attempt_of "$job")" = 1 ] && [ "$(restarts_of "$job")" = 0 ] ||
  fail "the long cut stopped the attempt: $(events "$job")"
history=$(events "$job")  # whole, before grep -q closes the pipe
grep -q "lost its heartbeat; the attempt goes on" <<<"$history" ||
  fail "the controller did not notice the cut: $history"
grep -q "is back on" <<<"$history" || fail "no worker came back: $history"
echo "the controller lost every worker for the cut and took them back; attempt 1 went on and" \
  "succeeded"

echo "multihost_test: PASS in $(since "$test_start") s (server cut: ranks gone in ${took_2a} s," \
  "bound ${bound_2a} s; path cut: ${took_2b} s, bound ${bound_2b} s; server stopped:" \
  "${took_2c} s, bound ${bound_2c} s; auto picks" \
  "$auto_shared with a shared /dev/shm, $auto_private without)"
