#!/usr/bin/env bash
# ZeRO-3 as real processes: offload_local with two optimizer servers and W gpu_trainer ranks
# meeting over Gloo on loopback. For W = 1, 2 and 3, fp16 and bf16, with and without
# micro-batches (six jobs here that, with the window jobs, cover every pair of the three, and with
# zero3_trainer_test's eight in-process runs all twelve combinations), a job run with
# --zero_stage=3 (and, at W=1, with a one-layer parameter window; at W=2 with activation
# checkpointing) ends with a checkpoint byte-identical to the same job with --zero_stage=2: the
# model file, every shard's master weights and moments, and the manifest. The sampled text is the
# same too (under stage 3 every rank takes part in sampling, as each forward gathers the layers).
# And a checkpoint of either stage resumes under the other to the same bytes.
set -euo pipefail
launcher=$1
server=$2
trainer=$3
data=$4
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT

steps=6
common=(--data="$data" --layers=3 --heads=2 --channels=32 --context=32 --seq_len=16 --batch=12
  --steps=$steps --warmup_steps=2 --eval_every=3 --eval_batches=1 --sample_tokens=24
  --progress=log --log_every=1 --seed=11 --checkpoint_every=0)

# The sample as printed: from its header to the closing line (the text may hold newlines).
sample() { sed -n '/^gpu_trainer: sample:/,$p' "$1" | sed -n '3,/^---$/p' | od -An -tx1; }

runs=0
# ranks dtype micro_batches [extra stage-3 flags]
while read -r ranks dtype micro extra; do
  name="w${ranks}-${dtype}-m${micro}${extra:+-${extra#--}}"
  for stage in 2 3; do
    flags=(--dtype="$dtype" --micro_batches="$micro" --zero_stage=$stage)
    [ "$stage" = 3 ] && [ -n "$extra" ] && flags+=("$extra")
    job "$work/$name-$stage.log" --ranks="$ranks" --checkpoint_dir="$work/$name-$stage" \
      "${flags[@]}"
    wait "$launched" || fail "$name, stage $stage: the job failed (log: $work/$name-$stage.log)"
  done
  log=$work/$name-3.log
  grep -q "ZeRO stage 3: this rank holds" "$log" || fail "$name: the stage 3 job did not say so"
  same_checkpoint "$work/$name-2" "$work/$name-3" "$name: stage 2 and stage 3"
  s2=$(sample "$work/$name-2.log")
  s3=$(sample "$work/$name-3.log")
  [ -n "$s2" ] && [ "$s2" = "$s3" ] || fail "$name: the samples differ: '$s2' and '$s3'"
  runs=$((runs + 1))
done < <(
  printf '%s\n' "1 fp16 2" "1 bf16 1" "2 bf16 1" "2 fp16 2" "3 fp16 2" "3 bf16 1"
  echo "1 bf16 2 --param_window_layers=1"
  echo "1 fp16 1 --param_window_layers=1"
  # Activation checkpointing recomputes each block in backward: the same bits again.
  echo "2 bf16 2 --activation_checkpointing"
)
# A checkpoint of either stage resumes under the other, W=2: the step-3 checkpoint of a run with
# --checkpoint_every=3, made the latest on its own, resumed to step 6 under the other stage, ends
# with the straight run's step-6 checkpoint byte for byte.
for first in 2 3; do
  then=$((5 - first))
  name=cross-$first-$then
  job "$work/$name-a.log" --ranks=2 --checkpoint_dir="$work/$name-a" --zero_stage=$first \
    --checkpoint_every=3 --keep_checkpoints=2
  wait "$launched" || fail "$name: the straight job failed"
  [ -d "$work/$name-a/step-00000003" ] || fail "$name: no step-3 checkpoint"
  cp -r "$work/$name-a" "$work/$name-b"
  rm -rf "$work/$name-b/step-00000006"
  printf 'step-00000003\n' >"$work/$name-b/latest"
  job "$work/$name-b.log" --ranks=2 --checkpoint_dir="$work/$name-b" --zero_stage=$then --resume
  log=$work/$name-b.log
  wait "$launched" || fail "$name: the resumed job failed"
  grep -q "resumed from .* at step 3" "$log" || fail "$name: the job did not resume at step 3"
  same_checkpoint "$work/$name-a" "$work/$name-b" "stage $first resumed under stage $then"
  runs=$((runs + 1))
done
echo "zero3_process_test: $runs cases, each stage 3 checkpoint byte-identical to stage 2's"
