#!/usr/bin/env bash
# Cross-process test of every data plane (grpc, shm, ucx, and ucx under UCX_TLS=tcp) with the real
# cpu_optimizer_server binary and offload_transport_peer as the trainer:
#   (a) the trainer is killed -9 mid-exchange (paused half-way through a step's gradients, and
#       while stepping flat out): the server keeps serving, a new trainer process completes the
#       same step number, and no /dev/shm/offload* entry remains;
#   (b) the server is killed -9 mid-exchange (the same two ways): the trainer exits non-zero with
#       an UNAVAILABLE error within 20 s, never hangs;
#   (c) the server is stopped (SIGSTOP) mid-exchange: the trainer fails within its step timeout
#       saying the shard gave no answer, and the server, continued, serves the next trainer from
#       where the stopped one left off;
#   (d) only the server's Adam threads are stopped (ptrace, tests/freeze_threads.py), so its
#       gRPC threads still answer keepalive: the same, found by the step timeout alone (skipped
#       where ptrace is not allowed).
# A plane the build lacks (ucx without libucx-dev) is skipped (the peer exits 77).
set -euo pipefail
server_bin=$1
peer_bin=$2
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT
bound_s=20
n=1048576

# Segments of the servers this script started (named /offload-<server pid>-...): other tests that
# ctest runs beside this one create and remove their own meanwhile.
server_pids=()
shm_entries() {
  [ ${#server_pids[@]} -eq 0 ] && return 0
  ls /dev/shm 2>/dev/null | grep -E "^offload-($(IFS='|'; echo "${server_pids[*]}"))-" | sort || true
}

# Not process_lib's fail: this one names the plane and shows the end of every log.
fail() {
  echo "FAIL [$plane]: $*" >&2
  for f in "$work"/*.log; do echo "== $f" >&2; tail -5 "$f" >&2; done
  exit 1
}

start_tracked_server() {  # start_tracked_server LOG: start_server, its pid kept for shm_entries
  start_server "$server_bin" "$1" --memory_limit_mib=1024 --threads=2
  server_pids+=("$server_pid")
}

peer() {  # peer LOG ARGS...: runs the peer in the background, sets $peer_pid
  local log=$1
  shift
  "$peer_bin" --address="127.0.0.1:$port" --transport="$transport" --n=$n "$@" >"$log" 2>&1 &
  peer_pid=$!
  pids+=("$peer_pid")
}

wait_for_line() {  # wait_for_line LOG PATTERN [tenths]
  for _ in $(seq "${3:-300}"); do
    grep -q "$2" "$1" && return 0
    sleep 0.1
  done
  fail "no '$2' in $1"
}

# kill -9 and reap, without bash's "Killed" notice.
kill9() {
  kill -9 "$1"
  wait "$1" 2>/dev/null || true
}

# Waits at most $bound_s for pid $1 to exit; sets $rc to its exit status and $waited to the
# tenths of a second it took.
wait_bounded() {
  waited=0
  for _ in $(seq $((bound_s * 10))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
    waited=$((waited + 1))
  done
  if kill -0 "$1" 2>/dev/null; then fail "pid $1 still running ${bound_s}s after its peer died"; fi
  rc=0
  wait "$1" || rc=$?
}

# Waits (5 s at most) until /dev/shm holds no offload entry that was not there at the start.
no_new_shm_entries() {
  for _ in $(seq 50); do
    if [ -z "$(comm -13 "$work/shm_before" <(shm_entries))" ]; then return 0; fi
    sleep 0.1
  done
  fail "left in /dev/shm: $(comm -13 "$work/shm_before" <(shm_entries) | tr '\n' ' ')"
}

# The next step a peer run completes must be $1 (the step the killed peer was in).
completes_step() {  # completes_step LOG STEP
  peer "$1" --steps=1
  wait_bounded "$peer_pid"
  [ "$rc" -eq 0 ] || fail "a new trainer could not step after the old one died (rc=$rc)"
  grep -q "^peer step=$2 applied=1" "$1" || fail "expected step $2 applied in $1"
}

# goes_on_after LOG WHAT: a new trainer on the same server steps twice, and its first step follows
# the last one LOG shows, or the one after it: the interrupted commit may have been applied
# without its answer reaching the old trainer. WHAT says when, for the failure.
goes_on_after() {
  local last first
  last=$(sed -n 's/^peer step=\([0-9]*\) .*/\1/p' "$1" | tail -1)
  peer "${1%.log}-next.log" --steps=2
  wait_bounded "$peer_pid"
  [ "$rc" -eq 0 ] || fail "a new trainer could not step $2 (rc=$rc)"
  first=$(sed -n 's/^peer step=\([0-9]*\) .*/\1/p' "${1%.log}-next.log" | head -1)
  [ "$first" -eq $((last + 1)) ] || [ "$first" -eq $((last + 2)) ] ||
    fail "after step $last the next run began at step $first"
}

run_plane() {
  plane=$1 transport=$2
  echo "--- $plane"
  shm_entries >"$work/shm_before"
  start_tracked_server "$work/$plane-server1.log"
  peer "$work/$plane-warm.log" --steps=2
  wait_bounded "$peer_pid"
  if [ "$rc" -eq 77 ]; then
    echo "$plane: not in this build, skipped"
    kill9 "$server_pid"
    return 0
  fi
  [ "$rc" -eq 0 ] || fail "warm-up steps failed (rc=$rc)"
  grep -q "^peer transport=$transport" "$work/$plane-warm.log" || fail "wrong plane"

  echo "(a1) trainer killed half-way through a step's gradients"
  peer "$work/$plane-a1.log" --steps=1 --pause_mid_step_ms=60000
  wait_for_line "$work/$plane-a1.log" "^peer mid-exchange step=3"
  kill9 "$peer_pid"
  kill -0 "$server_pid" || fail "the server died with its trainer"
  no_new_shm_entries
  completes_step "$work/$plane-a1-next.log" 3

  echo "(a2) trainer killed while stepping flat out"
  peer "$work/$plane-a2.log" --steps=1000000
  wait_for_line "$work/$plane-a2.log" "^peer step=7 "
  kill9 "$peer_pid"
  kill -0 "$server_pid" || fail "the server died with its trainer"
  no_new_shm_entries
  # Whatever step the kill interrupted, the shard is consistent: the next run goes on from it.
  goes_on_after "$work/$plane-a2.log" "after the old one died"

  echo "(b1) server killed while the trainer is half-way through a step's gradients"
  peer "$work/$plane-b1.log" --steps=1 --pause_mid_step_ms=1500
  wait_for_line "$work/$plane-b1.log" "^peer mid-exchange"
  kill9 "$server_pid"
  wait_bounded "$peer_pid"
  [ "$rc" -ne 0 ] || fail "the trainer exited 0 after its server died"
  grep -q "UNAVAILABLE" "$work/$plane-b1.log" || fail "no UNAVAILABLE error: $(tail -2 "$work/$plane-b1.log")"
  echo "trainer gave up $((waited / 10)).$((waited % 10)) s after the kill: $(tail -1 "$work/$plane-b1.log")"
  no_new_shm_entries

  echo "(b2) server killed while the trainer steps flat out"
  start_tracked_server "$work/$plane-server2.log"
  peer "$work/$plane-b2.log" --steps=1000000
  wait_for_line "$work/$plane-b2.log" "^peer step=3 "
  kill9 "$server_pid"
  wait_bounded "$peer_pid"
  [ "$rc" -ne 0 ] || fail "the trainer exited 0 after its server died"
  grep -q "UNAVAILABLE" "$work/$plane-b2.log" || fail "no UNAVAILABLE error: $(tail -2 "$work/$plane-b2.log")"
  no_new_shm_entries
  echo "trainer gave up $((waited / 10)).$((waited % 10)) s after the kill: $(tail -1 "$work/$plane-b2.log")"

  echo "(c) server stopped (SIGSTOP) while the trainer steps flat out, continued after"
  # Alive to the kernel and its sockets open, it answers nothing: only the step timeout (here
  # 10x a step of milliseconds, at least 3 s) finds it before keepalive does (10 s + 5 s).
  start_tracked_server "$work/$plane-server3.log"
  peer "$work/$plane-c.log" --steps=1000000 --step_timeout_floor=3s
  wait_for_line "$work/$plane-c.log" "^peer step=5 "
  kill -STOP "$server_pid"
  wait_bounded "$peer_pid"
  kill -CONT "$server_pid"
  [ "$rc" -ne 0 ] || fail "the trainer exited 0 while its server was stopped"
  grep -q "no answer within 3s" "$work/$plane-c.log" ||
    fail "the error does not say the shard did not answer: $(tail -2 "$work/$plane-c.log")"
  echo "trainer gave up $((waited / 10)).$((waited % 10)) s after the stop: $(tail -1 "$work/$plane-c.log")"
  # Running again, the server is consistent: a new trainer goes on from where the old one stopped.
  goes_on_after "$work/$plane-c.log" "on the continued server"
  kill9 "$server_pid"
  no_new_shm_entries

  echo "(d) the server's Adam threads stall while its other threads answer (ptrace), then go on"
  # A disk that blocks or a wedged lock: keepalive and heartbeats are answered, so only the step
  # timeout can tell.
  start_tracked_server "$work/$plane-server4.log"
  peer "$work/$plane-d.log" --steps=1000000 --step_timeout_floor=3s
  wait_for_line "$work/$plane-d.log" "^peer step=5 "
  /usr/bin/python3 "$(dirname "$0")/freeze_threads.py" "$server_pid" adam- 6 \
    >"$work/$plane-freeze.log" 2>&1 &
  local freezer=$!
  wait_for_line "$work/$plane-freeze.log" "^frozen\|^SKIP"
  if grep -q "^SKIP" "$work/$plane-freeze.log"; then
    echo "(d) skipped: $(cat "$work/$plane-freeze.log")"
    kill9 "$peer_pid"
  else
    wait_bounded "$peer_pid"
    [ "$rc" -ne 0 ] || fail "the trainer exited 0 while its server's Adam threads were stopped"
    grep -q "no answer within 3s" "$work/$plane-d.log" ||
      fail "the error does not say the shard did not answer: $(tail -2 "$work/$plane-d.log")"
    echo "trainer gave up $((waited / 10)).$((waited % 10)) s after the stall: $(tail -1 "$work/$plane-d.log")"
    wait "$freezer" || fail "the threads were not let go: $(cat "$work/$plane-freeze.log")"
    goes_on_after "$work/$plane-d.log" "once the threads went on"
  fi
  wait "$freezer" 2>/dev/null || true
  kill9 "$server_pid"
  no_new_shm_entries
}

planes=${TRANSPORT_KILL_PLANES:-grpc shm ucx ucx-tcp}
for p in $planes; do
  case $p in
    # UCX reads UCX_TLS when a context is made: exported, it reaches the server and the peer.
    ucx-tcp)
      saved_tls=${UCX_TLS-}
      export UCX_TLS=tcp
      run_plane ucx-tcp ucx
      if [ -n "$saved_tls" ]; then export UCX_TLS=$saved_tls; else unset UCX_TLS; fi
      ;;
    *) run_plane "$p" "$p" ;;
  esac
done
echo "transport_kill_test: all passed"
