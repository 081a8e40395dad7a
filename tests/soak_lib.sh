# What the two opt-in soaks share (tests/soak.sh, tests/tenant_soak.sh): the processes they run
# and kill, their cleanup and failure report, and the kill -9 bookkeeping. Sourced after $work is
# made and $soak_name set (the prefix of say's lines).
source "$(dirname "${BASH_SOURCE[0]}")/process_lib.sh"
declare -A proc        # where a process runs ("pool/kind/index", "kind/index") -> its pid now
declare -A killed_kind # kills by kind (server, trainer, controller)
kills=0
shm_before=$(ls /dev/shm | grep '^offload-' | sort || true)
# Not process_lib's cleanup: over a soak the pids of killed processes are reused by others, so
# only what runs now is killed, and whatever is left of the soak (every process of it names $work).
cleanup() {
  for pid in "${proc[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  pkill -9 -f -- "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/logs/*.log; do echo "--- $f" >&2; tail -n 15 "$f" >&2; done
  exit 1
}
say() { echo "$soak_name $(date +%H:%M:%S): $*"; }

free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# kill9 KEY KIND: kill -9 of proc[KEY], reaped and counted under KIND; its pid in $killed_pid.
kill9() {
  killed_pid=${proc[$1]}
  kill -9 "$killed_pid" 2>/dev/null || true
  wait "$killed_pid" 2>/dev/null || true
  kills=$((kills + 1))
  killed_kind[$2]=$((${killed_kind[$2]:-0} + 1))
}

# check_no_orphan_ranks CONTROLLER: a killed trainer worker's rank dies with it
# (PR_SET_PDEATHSIG), so once the dead are gone no more ranks report to CONTROLLER than its two
# workers run.
check_no_orphan_ranks() {
  local ranks
  for _ in $(seq 50); do
    ranks=$( (pgrep -f -- "--report_to=$1" || true) | wc -l)
    [ "$ranks" -le 2 ] && return 0
    sleep 0.1
  done
  fail "$ranks ranks reporting to $1 are running: orphans of killed workers"
}

# Everything stops in order; then nothing of the soak may be left: no process naming $work, no
# /dev/shm segment that was not there when the soak began.
stop_all_and_check_nothing_left() {
  local key left shm_after leaked
  for key in "${!proc[@]}"; do kill "${proc[$key]}" 2>/dev/null || true; done
  for key in "${!proc[@]}"; do wait "${proc[$key]}" 2>/dev/null || true; done
  sleep 1
  left=$(pgrep -f -- "$work" || true)
  [ -z "$left" ] || fail "processes left behind: $(ps -o pid,args -p "$(echo $left | tr ' ' ,)")"
  shm_after=$(ls /dev/shm | grep '^offload-' | sort || true)
  leaked=$(comm -13 <(echo "$shm_before") <(echo "$shm_after") | grep . || true)
  [ -z "$leaked" ] || fail "/dev/shm segments left behind: $leaked"
}
