#!/usr/bin/env bash
# The README's own commands, as a user types them:
#   - ./scripts/run-demo, then Ctrl-C once it trains (SIGINT to its whole process group, as a
#     terminal sends it): the trainer checkpoints the step it stopped at and everything exits 130;
#   - ./scripts/run-demo --resume --steps=N continues that run, in its directory, from that step,
#     and ends byte for byte where ./scripts/run-demo --steps=N ends;
#   - ./scripts/run-demo --resume with no demo run to resume says so, and so does the trainer.
# The scripts run as they are, against the build under test (OFFLOAD_BUILD_DIR; their build step
# finds nothing to do), keeping the runs in a scratch directory (OFFLOAD_CHECKPOINTS) instead of
# the user's checkpoints/, on the CPU backend every machine has (OFFLOAD_DEVICE).
set -euo pipefail
src=$1
build=$2
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT
fail_log_lines=+1
export OFFLOAD_BUILD_DIR=$build OFFLOAD_CHECKPOINTS=$work/checkpoints OFFLOAD_DEVICE=cpu
unset OFFLOAD_CMAKE_ARGS OFFLOAD_SHARDS
# At most the demo's --warmup_steps (50): a step's learning rate is then the same whatever --steps
# says, so the interrupted 600-step run and a straight one of $steps train the same steps.
steps=50

demo_runs() { find "$OFFLOAD_CHECKPOINTS" -mindepth 1 -maxdepth 1 -name 'demo-*' | sort; }

echo "--- 1. ./scripts/run-demo, Ctrl-C"
log=$work/first.log
setsid "$src/scripts/run-demo" >"$log" 2>&1 &
launched=$!
pids+=("-$launched")  # the whole group, until it is gone: nothing is left behind if a step fails
for _ in $(seq 1200); do
  grep -q '^step 10/600 ' "$log" && break
  kill -0 "$launched" 2>/dev/null || fail "run-demo ended before step 10"
  sleep 0.05
done
grep -q '^step 10/600 ' "$log" || fail "run-demo did not reach step 10 in 60 s"
kill -INT -- "-$launched"
status=0
wait "$launched" || status=$?
# Its group id may be any new process's from here on: cleanup must not kill it.
pids=()
[ "$status" -eq 130 ] || fail "run-demo exited with status $status after Ctrl-C, not 130"
stopped=$(sed -n 's/^gpu_trainer: interrupted at step \([0-9]*\);.*/\1/p' "$log")
[ -n "$stopped" ] || fail "the trainer did not say where it stopped"
[ "$stopped" -lt "$steps" ] || fail "Ctrl-C came too late to test a resume (step $stopped)"
first=$(demo_runs)
[ "$(echo "$first" | wc -l)" -eq 1 ] || fail "expected one demo run, found: $first"
[ "$(cat "$first/latest")" = "$(printf 'step-%08d' "$stopped")" ] ||
  fail "$first/latest names $(cat "$first/latest"), not the step the run stopped at ($stopped)"
left=$(pgrep -a -g "$launched" -f "$build/" || true)
[ -z "$left" ] || fail "processes of run-demo outlived it: $left"
echo "stopped at step $stopped in $first"

echo "--- 2. ./scripts/run-demo --resume --steps=$steps"
log=$work/resumed.log
"$src/scripts/run-demo" --resume --steps=$steps >"$log" 2>&1 || fail "the resumed demo failed"
checkpoint=$(printf 'step-%08d' "$stopped")
grep -qF "run-demo: resuming the latest demo run, $first ($checkpoint)" "$log" ||
  fail "run-demo did not say which run it resumes"
grep -qF "gpu_trainer: resumed from $first/$checkpoint at step $stopped" "$log" ||
  fail "the trainer did not resume at step $stopped"
grep -q "^gpu_trainer: step $steps val_loss [0-9]" "$log" || fail "the resumed run did not end at step $steps"
[ "$(demo_runs)" = "$first" ] || fail "the resume made a new demo run: $(demo_runs)"

echo "--- 3. ./scripts/run-demo --steps=$steps: the same bytes"
sleep 1  # demo runs are named by the second they start
log=$work/straight.log
"$src/scripts/run-demo" --steps=$steps >"$log" 2>&1 || fail "the straight demo failed"
grep -q "gpu_trainer: started from GPT-2 initialisation" "$log" || fail "the straight run did not start fresh"
straight=$(demo_runs | grep -vxF "$first")
same_checkpoint "$first" "$straight" "Ctrl-C at step $stopped and run-demo --resume"

echo "--- 4. ./scripts/run-demo --resume with no demo run to resume"
log=$work/nothing.log
OFFLOAD_CHECKPOINTS=$work/empty "$src/scripts/run-demo" --resume --steps=2 --sample_tokens=0 \
  >"$log" 2>&1 || fail "run-demo --resume with nothing to resume failed"
grep -qF "run-demo: no demo run with a checkpoint in $work/empty/ to resume; starting a new one in" \
  "$log" || fail "run-demo did not say there was nothing to resume"
grep -q "^gpu_trainer: nothing to resume: no checkpoint in $work/empty/demo-[0-9-]*; started from GPT-2 initialisation" \
  "$log" || fail "the trainer did not say there was nothing to resume"
echo "PASS"
