#!/usr/bin/env bash
# The optimizer server's disk tier (--state_dir) as real processes: offload_local with S optimizer
# servers keeping every job's state on disk, streamed through a ring of a few waves.
#   1. Same bits: a job trained with the disk tier ends with a checkpoint byte-identical to the
#      same job in memory: fp16 on 1 server and bf16 on 3, W=2 with micro-batches, the tier asked
#      for by the servers (--state_tier=disk) and by the job (--optimizer_state=disk). (W=1 without
#      micro-batches against memory: case 3c, and shard_store_test's DiskStateTest.)
#   2. kill -9 of a server mid-run, then a resume from the last checkpoint: the final checkpoint is
#      the uninterrupted run's, byte for byte, and the dead server's directory is cleared by the
#      next server to open the state directory.
#   3. A full disk (a small tmpfs, in a mount namespace of its own): a job too big is refused up
#      front naming the directory and both figures; a resume whose load meets the full disk in its
#      staging file fails naming the file, the checkpoint unchanged; and with room the same resume
#      ends at the in-memory run's bytes.
set -euo pipefail
full_disk=false
[ "$1" = --full-disk ] && full_disk=true && shift
launcher=$1
server=$2
trainer=$3
data=$4
source "$(dirname "$0")/process_lib.sh"
pids=()
if $full_disk; then
  work=$5/full-disk  # the outer run's, removed by it
  mkdir -p "$work"
  trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done' EXIT
else
  work=$(mktemp -d)
  trap cleanup EXIT
fi

steps=6
common=(--data="$data" --layers=2 --heads=2 --channels=32 --context=32 --seq_len=16 --batch=8
  --steps=$steps --warmup_steps=2 --progress=log --log_every=1 --seed=5 --eval_every=0)
# A wave of one tile and a ring of five slots: the small model spans several waves, so reads run
# ahead of the update and write-backs trail it as they do at scale.
disk_args=(--wave_elements=16384 --state_memory_mib=1)

# run LOG SHARDS RANKS STATE_DIR [TRAINER FLAGS...]: the launcher in the background; STATE_DIR
# "-" keeps the state in memory. The servers put every job on disk (--state_tier=disk) unless
# $ask_job is set, when the job asks for it itself (--optimizer_state=disk). Sets $log and
# $launched.
run() {
  log=$1
  local shards=$2 ranks=$3 state=$4
  shift 4
  local server_args="--wave_elements=16384"
  if [ "$state" != - ] && [ -n "${ask_job:-}" ]; then
    server_args="${disk_args[*]} --state_dir=$state"
    set -- "$@" --optimizer_state=disk
  elif [ "$state" != - ]; then
    server_args="${disk_args[*]} --state_dir=$state --state_tier=disk"
  fi
  "$launcher" --controller=none --shards="$shards" --ranks="$ranks" --server_binary="$server" \
    --trainer_binary="$trainer" --server_args="$server_args" --shutdown_timeout=30s -- \
    "${common[@]}" "$@" >"$log" 2>&1 &
  launched=$!
  pids+=("$launched")
}

# 3 (inside the mount namespace). The state directory is a tmpfs; the job's state is 1.4 MB.
#   a. 1 MiB: the job is refused up front, naming the directory and both figures.
#   b. 2 MiB: a resume from a step-3 checkpoint has room for the state files (preallocated at
#      creation) but not for the load's staging files: the load fails mid-way naming its file,
#      the job fails, and the checkpoint is as it was.
#   c. 8 MiB: the same resume runs to the end, to the uninterrupted run's bytes.
if $full_disk; then
  small=$work/small
  mkdir -p "$small"
  mount -t tmpfs -o size=1m tmpfs "$small"
  common+=(--channels=64)
  run "$work/refused.log" 1 1 "$small/state" --checkpoint_dir="$work/refused"
  wait "$launched" && fail "a job bigger than the disk ran"
  grep -q "bytes on disk but $small/state/server-.* has [0-9]* bytes free" "$log" ||
    fail "the refusal does not name the directory and both figures"
  echo "disk_tier_process_test: refused up front: $(grep -m1 -o "needs [0-9]* bytes on disk.*free" "$log")"
  run "$work/straight.log" 1 1 - --checkpoint_dir="$work/straight" --checkpoint_every=3
  wait "$launched" || fail "the job in memory failed"
  cp -r "$work/straight" "$work/resumed"
  rm -rf "$work/resumed/step-00000006"
  printf 'step-00000003\n' >"$work/resumed/latest"
  before=$(cd "$work/resumed" && find . -type f -exec md5sum {} + | sort)
  mount -o remount,size=2m "$small"
  run "$work/full.log" 1 1 "$small/state" --checkpoint_dir="$work/resumed" --resume
  wait "$launched" && fail "a resume with no room for its load ran"
  grep -q "\.load-[0-9]*\.state: No space left on device" "$log" ||
    fail "the full disk's error does not name the file"
  after=$(cd "$work/resumed" && find . -type f -exec md5sum {} + | sort)
  [ "$before" = "$after" ] || fail "the failed resume changed the checkpoint directory"
  echo "disk_tier_process_test: full mid-load: $(grep -m1 -o "writing [^ ]* elements.*device" "$log")"
  mount -o remount,size=8m "$small"
  run "$work/room.log" 1 1 "$small/state" --checkpoint_dir="$work/resumed" --resume
  wait "$launched" || fail "the resume failed once there was room"
  grep -q "resumed from" "$log" || fail "the job did not resume from its checkpoint"
  same_checkpoint "$work/straight" "$work/resumed" "resumed once there was room"
  echo "disk_tier_process_test: resumed once there was room, to the uninterrupted bytes"
  umount "$small"
  exit 0
fi

# 1. Same bits.
cases=0
while read -r shards ranks dtype micro asks; do
  name="s$shards-w$ranks-$dtype-m$micro-$asks"
  ask_job=""
  [ "$asks" = job ] && ask_job=1
  flags=(--dtype="$dtype" --micro_batches="$micro" --checkpoint_every=0)
  run "$work/$name-mem.log" "$shards" "$ranks" - --checkpoint_dir="$work/$name-mem" "${flags[@]}"
  wait "$launched" || fail "$name: the job in memory failed"
  run "$work/$name-disk.log" "$shards" "$ranks" "$work/state" \
    --checkpoint_dir="$work/$name-disk" "${flags[@]}"
  wait "$launched" || fail "$name: the job on disk failed"
  ask_job=""
  [ "$(grep -c "state on disk ([0-9]* bytes in $work/state/server-" "$log")" = "$shards" ] ||
    fail "$name: not every server kept the job on disk"
  grep -q "state in memory" "$log" && fail "$name: a server kept the job in memory"
  same_checkpoint "$work/$name-mem" "$work/$name-disk" "$name: memory and disk"
  cases=$((cases + 1))
done <<'EOF'
1 2 fp16 2 server
3 2 bf16 2 job
EOF
# Every server removed its directory on the way out (the root's .lock, which servers take to
# sweep and claim, stays).
left=$(find "$work/state" -mindepth 1 -maxdepth 1 ! -name .lock)
[ -z "$left" ] || fail "the state directory is not empty: $left"
echo "disk_tier_process_test: $cases jobs on disk, each checkpoint byte-identical to memory's"

# 2. kill -9 of a server mid-run, resume from the last checkpoint.
steps=12
common=("${common[@]/--steps=6/--steps=12}")
run "$work/straight.log" 3 2 "$work/state" --checkpoint_dir="$work/straight" --checkpoint_every=4
wait "$launched" || fail "the uninterrupted job failed"
run "$work/killed.log" 3 2 "$work/state" --checkpoint_dir="$work/killed" --checkpoint_every=4
wait_for_checkpoint "$work/killed"
victim=$(pgrep -f -- "^$server .*--state_dir=$work/state" | head -1)
[ -n "$victim" ] || fail "no server with the disk tier to kill"
dead_dirs=$(ls "$work/state")
kill -9 "$victim"
if wait "$launched"; then
  # A machine fast enough to finish all 12 steps first: the resume below then only re-checks.
  echo "note: the job finished before the kill landed"
else
  echo "the job failed after the server was killed, as it must:" \
    "$(grep -m1 -oE "(UNAVAILABLE|went away|failed).{0,100}" "$log" || true)"
fi
run "$work/resumed.log" 3 2 "$work/state" --checkpoint_dir="$work/killed" --checkpoint_every=4 \
  --resume
wait "$launched" || fail "the resumed job failed"
grep -q "resumed from" "$log" || fail "the job did not resume from its checkpoint"
same_checkpoint "$work/straight" "$work/killed" "killed and resumed against uninterrupted"
for d in $dead_dirs; do
  [ ! -e "$work/state/$d" ] || fail "the killed server's directory $d was not cleared"
done
echo "disk_tier_process_test: a server killed -9 mid-run, resumed to the uninterrupted bytes"

# 3. A full disk, in a mount namespace of its own with a small tmpfs as the state directory
# (needs root, as CI and the lent machines have): this script again, inside `unshare -m`.
if ! unshare -m --propagation private true 2>/dev/null; then
  echo "disk_tier_process_test: SKIP the full-disk cases: no mount namespace here (needs root)"
  exit 0
fi
unshare -m --propagation private bash "$0" --full-disk "$launcher" "$server" "$trainer" "$data" \
  "$work" || fail "the full-disk cases failed"
