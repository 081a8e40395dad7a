#!/usr/bin/env bash
# The real job end to end: offload_local, two cpu_optimizer_server processes and gpu_trainer on
# loopback, on a tiny model and the bundled text. Checks, by comparing checkpoint files byte for
# byte:
#   - a run behind two servers equals the same run with the optimizer in process;
#   - a run killed with kill -9 after a checkpoint and resumed equals the straight run;
#   - Ctrl-C (SIGINT to the launcher) checkpoints, leaves no processes and no half-written
#     files, and the resumed run equals the straight run too;
#   - a server stopped with SIGSTOP mid-run is named within the step timeout, and the resumed
#     run equals the straight run;
#   - so is a server whose disk tier blocks (its state directory on a FUSE mount that stops
#     answering, where FUSE is available);
#   - a missing data file fails with a message naming it.
set -euo pipefail
launcher=$1
server=$2
trainer=$3
data=$4
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT

steps=160
common=(--data="$data" --layers=2 --heads=2 --channels=32 --context=32 --seq_len=32 --batch=8
  --steps=$steps --warmup_steps=10 --eval_every=0 --eval_batches=2 --sample_tokens=0
  --progress=log --log_every=20 --seed=5)

# The stalling file system of case 5b serves the test, not the job.
fs_pid=
no_processes_left() {
  local p
  for p in $(pgrep -f -- "$work" || true); do
    [ "$p" = "$fs_pid" ] && continue
    fail "process $p ($(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null)) outlived the job"
  done
}

# 1. The straight run behind two servers.
job "$work/a.log" --checkpoint_dir="$work/a"
wait "$launched" || fail "the straight run failed"
grep -q "val_loss" "$work/a.log" || fail "no validation loss in the output"

# 2. The same run with the optimizer in process (two in-process shards): bit-identical.
log=$work/inprocess.log
"$trainer" "${common[@]}" --num_shards=2 --checkpoint_dir="$work/inprocess" >"$log" 2>&1 ||
  fail "the in-process run failed"
same_checkpoint "$work/a" "$work/inprocess" "server vs in-process"

# 3. kill -9 of the whole job after a checkpoint, then resume.
job "$work/b1.log" --checkpoint_dir="$work/b" --checkpoint_every=20
wait_for_checkpoint "$work/b"
kill -9 "$launched"
wait "$launched" 2>/dev/null || true
sleep 1  # the children die of PR_SET_PDEATHSIG
no_processes_left
job "$work/b2.log" --checkpoint_dir="$work/b" --resume
wait "$launched" || fail "the resumed run failed"
resumed_at=$(sed -n 's/.*resumed from .* at step \([0-9]*\).*/\1/p' "$work/b2.log")
[ -n "$resumed_at" ] || fail "the second run did not resume"
[ "$resumed_at" -lt "$steps" ] || fail "the kill came too late to test anything (step $resumed_at)"
same_checkpoint "$work/a" "$work/b" "kill -9 at step >= $resumed_at and resume"

# 4. Ctrl-C: the trainer finishes its step, checkpoints, everything exits; then resume.
job "$work/c1.log" --checkpoint_dir="$work/c" --checkpoint_every=40
wait_for_checkpoint "$work/c"
kill -INT "$launched"
status=0
wait "$launched" || status=$?
[ "$status" -eq 130 ] || fail "Ctrl-C: the launcher exited with $status, not 130"
grep -q "interrupted at step" "$work/c1.log" || fail "Ctrl-C: the trainer did not say it stopped"
no_processes_left
ls -d "$work"/c/*.tmp 2>/dev/null && fail "Ctrl-C left a half-written checkpoint"
job "$work/c2.log" --checkpoint_dir="$work/c" --resume
wait "$launched" || fail "the run resumed after Ctrl-C failed"
same_checkpoint "$work/a" "$work/c" "Ctrl-C and resume"

# silenced_at: the time (ns) a case made a server go silent; until_named LOG WHAT: waits (30 s at
# most) until the trainer of LOG names a shard that gave no answer within 2 s, and sets named_after
# ("2.108 s") from $silenced_at.
until_named() {
  local waited=0 ms
  until grep -q "no answer within 2s" "$1"; do
    [ "$waited" -lt 300 ] || fail "the trainer did not name $2 within 30 s"
    sleep 0.1
    waited=$((waited + 1))
  done
  ms=$((($(date +%s%N) - silenced_at) / 1000000))
  named_after="$((ms / 1000)).$(printf %03d $((ms % 1000))) s"
}

# resumes_to_the_straight_run LOG DIR WHAT: the job of LOG failed naming the silent shard and left
# nothing running; run again with --resume on new servers, it ends with the straight run's bytes.
resumes_to_the_straight_run() {
  wait "$launched" && fail "the job whose $3 succeeded"
  grep -q "optimizer shard 127.0.0.1:[0-9]*.*no answer within 2s" "$1" ||
    fail "the error does not name the shard: $(grep -m1 "no answer" "$1")"
  no_processes_left
  job "${1%1.log}2.log" --checkpoint_dir="$2" --resume
  wait "$launched" || fail "the run resumed after the $3 failed"
  grep -q "resumed from" "${1%1.log}2.log" || fail "the run after the $3 did not resume"
  same_checkpoint "$work/a" "$2" "$3 mid-run and resume"
}

# 5. A server stopped (SIGSTOP) mid-run: alive to the kernel, its sockets open, silent. The
# trainer gives up within its step timeout (10x its median step, at least 2 s here) naming the
# shard; the stopped server is continued while its job ends; the resumed run (on new servers)
# equals the straight run.
job "$work/e1.log" --checkpoint_dir="$work/e" --checkpoint_every=20 --shard_step_timeout_floor=2s
wait_for_checkpoint "$work/e"
victim=$(pgrep -P "$launched" -f -- "^$server " | head -1)
[ -n "$victim" ] || fail "no server of the job to stop"
kill -STOP "$victim"
silenced_at=$(date +%s%N)
until_named "$work/e1.log" "the stopped server"
stopped_after=$named_after
kill -CONT "$victim"
resumes_to_the_straight_run "$work/e1.log" "$work/e" "server stopped answering"

# 5b. A server whose disk tier blocks: its state on a FUSE directory (tests/stall_fs.py) that stops
# answering every call, as a hung disk or a dead network volume does, while the server's threads
# all run. The trainer gives up within its step timeout naming the shard; the directory answers
# again while the job ends; the resumed run (on new servers, state in memory) equals the straight
# run. Skipped where FUSE cannot be mounted (no fusepy, no /dev/fuse, not root): case (d) of
# transport_kill_test stalls the Adam threads instead.
stall_fs=$(dirname "$0")/stall_fs.py
mkdir -p "$work/fs-backing" "$work/fs"
/usr/bin/python3 "$stall_fs" "$work/fs-backing" "$work/fs" "$work/stall" >"$work/fs.log" 2>&1 &
fs_pid=$!
pids+=($fs_pid)
mounts+=("$work/fs")
for _ in $(seq 100); do
  grep -q "^mounted\|^SKIP" "$work/fs.log" && break
  sleep 0.1
done
disk_stalled_after=skipped
if grep -q "^mounted" "$work/fs.log"; then
  job "$work/f1.log" --server_args="--state_dir=$work/fs --state_tier=disk" \
    --checkpoint_dir="$work/f" --checkpoint_every=20 --shard_step_timeout_floor=2s
  wait_for_checkpoint "$work/f"
  ls "$work"/fs-backing/server-*/*.state >/dev/null 2>&1 || fail "the servers keep no state on the disk tier"
  touch "$work/stall"
  silenced_at=$(date +%s%N)
  until_named "$work/f1.log" "the server whose disk blocks"
  disk_stalled_after="named $named_after after the stall"
  grep -q "^stalled call" "$work/fs.log" || fail "nothing waited on the stalled directory"
  rm "$work/stall"
  resumes_to_the_straight_run "$work/f1.log" "$work/f" "server's disk tier blocked"
  umount "$work/fs" || umount -l "$work/fs"
else
  echo "5b skipped: $(cat "$work/fs.log")"
fi

# 6. Bad input: a clear error, non-zero.
job "$work/d.log" --data="$work/missing.txt"
wait "$launched" && fail "a missing data file did not fail"
grep -q "missing.txt" "$work/d.log" || fail "the error does not name the missing file"
echo "trainer_process_test: all cases passed (killed run resumed at step $resumed_at; a stopped" \
  "server named $stopped_after after the stop; a server whose disk blocked: $disk_stalled_after)"
