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

no_processes_left() {
  local p
  for p in $(pgrep -f -- "$work" || true); do
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

# 5. A server stopped (SIGSTOP) mid-run: alive to the kernel, its sockets open, silent. The
# trainer gives up within its step timeout (10x its median step, at least 2 s here) naming the
# shard; the stopped server is continued while its job ends; the resumed run (on new servers)
# equals the straight run.
job "$work/e1.log" --checkpoint_dir="$work/e" --checkpoint_every=20 --shard_step_timeout_floor=2s
wait_for_checkpoint "$work/e"
victim=$(pgrep -P "$launched" -f -- "^$server " | head -1)
[ -n "$victim" ] || fail "no server of the job to stop"
kill -STOP "$victim"
waited=0
until grep -q "no answer within 2s" "$work/e1.log"; do
  [ "$waited" -lt 300 ] || fail "the trainer did not name the stopped server within 30 s"
  sleep 0.1
  waited=$((waited + 1))
done
kill -CONT "$victim"
wait "$launched" && fail "the job whose server stopped answering succeeded"
grep -q "optimizer shard 127.0.0.1:[0-9]*.*no answer within 2s" "$work/e1.log" ||
  fail "the error does not name the shard: $(grep -m1 "no answer" "$work/e1.log")"
no_processes_left
job "$work/e2.log" --checkpoint_dir="$work/e" --resume
wait "$launched" || fail "the run resumed after the stopped server failed"
grep -q "resumed from" "$work/e2.log" || fail "the run after the stopped server did not resume"
same_checkpoint "$work/a" "$work/e" "a server stopped mid-run and resume"
stopped_after="$((waited / 10)).$((waited % 10)) s"

# 6. Bad input: a clear error, non-zero.
job "$work/d.log" --data="$work/missing.txt"
wait "$launched" && fail "a missing data file did not fail"
grep -q "missing.txt" "$work/d.log" || fail "the error does not name the missing file"
echo "trainer_process_test: all cases passed (killed run resumed at step $resumed_at; a stopped" \
  "server named $stopped_after after the stop)"
