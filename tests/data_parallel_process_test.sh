#!/usr/bin/env bash
# Data-parallel ranks as real processes: offload_local with two optimizer servers and two
# gpu_trainer ranks meeting over Gloo on loopback, on a tiny model and the bundled text. Checks:
#   - the 2x2 job trains, and both ranks end;
#   - Ctrl-C reaches both ranks, which stop at the same step with one checkpoint, and the resumed
#     job's last checkpoint equals the straight job's byte for byte;
#   - resuming with another number of ranks is refused, naming it;
#   - a rank killed with kill -9 makes the other fail with an error within its collective
#     timeout (the ranks started by hand here, so the launcher cannot stop the survivor first).
set -euo pipefail
launcher=$1
server=$2
trainer=$3
data=$4
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT

steps=60
common=(--data="$data" --layers=2 --heads=2 --channels=32 --context=32 --seq_len=32 --batch=8
  --steps=$steps --warmup_steps=10 --eval_every=0 --eval_batches=2 --sample_tokens=0
  --progress=log --log_every=10 --seed=5 --dpu --dpu_warmup_steps=5)

# 1. The straight 2x2 job.
job "$work/a.log" --ranks=2 --checkpoint_dir="$work/a"
wait "$launched" || fail "the 2x2 job failed"
grep -q "all 2 trainer ranks exited with status 0" "$work/a.log" || fail "not every rank ended"
grep -q '"world_size": 2' "$work/a/$(cat "$work/a/latest")/manifest.json" ||
  fail "the checkpoint's partition map is not for 2 ranks"

# 2. Ctrl-C once the job has checkpointed, then resume: the same bytes as the straight job.
job "$work/b1.log" --ranks=2 --checkpoint_dir="$work/b" --checkpoint_every=10
wait_for_checkpoint "$work/b"
kill -INT "$launched"
status=0
wait "$launched" || status=$?
[ "$status" -eq 130 ] || fail "Ctrl-C: the launcher exited with $status, not 130"
stopped0=$(sed -n 's/^gpu_trainer: interrupted at step \([0-9]*\).*/\1/p' "$work/b1.log")
stopped1=$(sed -n 's/^\[rank 1\] gpu_trainer: rank 1 interrupted at step \([0-9]*\).*/\1/p' \
  "$work/b1.log")
[ -n "$stopped0" ] && [ "$stopped0" = "$stopped1" ] ||
  fail "Ctrl-C: the ranks stopped at steps '$stopped0' and '$stopped1'"
job "$work/b2.log" --ranks=2 --checkpoint_dir="$work/b" --resume
wait "$launched" || fail "the resumed 2x2 job failed"
grep -q "resumed from .* at step $stopped0" "$work/b2.log" || fail "the job did not resume"
same_checkpoint "$work/a" "$work/b" "Ctrl-C at step $stopped0 and resume"

# 3. One rank may not continue what two trained.
job "$work/c.log" --ranks=1 --checkpoint_dir="$work/a" --resume --steps=80
wait "$launched" && fail "a single rank resumed a 2-rank checkpoint"
grep -q "ranks=2 but this run asks for ranks=1" "$work/c.log" || fail "the refusal does not say why"

# 4. kill -9 of rank 1: rank 0 fails on its own, with an error, within the timeout.
start_server "$server" "$work/server.log" --threads=1
mkdir "$work/rendezvous"
for r in 0 1; do
  "$trainer" "${common[@]}" --steps=100000 --shards=127.0.0.1:$port --rank=$r --world_size=2 \
    --rendezvous="$work/rendezvous" --collective_timeout=5s >"$work/rank$r.log" 2>&1 &
  pids+=("$!")
  rank_pid[$r]=$!
done
log=$work/rank0.log
for _ in $(seq 1000); do
  grep -q "^step 20/" "$work/rank0.log" && break
  sleep 0.02
done
grep -q "^step 20/" "$work/rank0.log" || fail "the two ranks did not reach step 20"
kill -9 "${rank_pid[1]}"
killed_at=$(date +%s.%N)
status=0
for _ in $(seq 400); do
  kill -0 "${rank_pid[0]}" 2>/dev/null || break
  sleep 0.05
done
kill -0 "${rank_pid[0]}" 2>/dev/null && fail "rank 0 still runs 20 s after rank 1 died"
wait "${rank_pid[0]}" || status=$?
seconds=$(printf "%.2f" "$(echo "$(date +%s.%N) - $killed_at" | bc)")
[ "$status" -ne 0 ] || fail "rank 0 exited 0 after rank 1 died"
grep -q "gpu_trainer rank 0: .*gloo" "$work/rank0.log" || fail "rank 0's error does not say why"
# 5. CUDA ranks over NCCL meet over gloo, then connect NCCL through the same rendezvous: without a
# GPU (or without NCCL in the build) every rank fails saying why, within its timeout, never hangs;
# through the controller, a host with fewer GPUs than NCCL ranks fails the attempt saying so.
mkdir -p "$work/nccl-rendezvous"
for r in 0 1; do
  timeout 60 "$trainer" "${common[@]}" --device=cuda --collectives=nccl --shards=127.0.0.1:1 \
    --rank=$r --world_size=2 --rendezvous="$work/nccl-rendezvous" --collective_timeout=5s \
    >"$work/nccl$r.log" 2>&1 &
  nccl_pid[r]=$!
done
for r in 0 1; do
  rc=0
  wait "${nccl_pid[r]}" || rc=$?
  [ "$rc" -ne 0 ] || fail "rank $r of 2 NCCL ranks started without a GPU"
  [ "$rc" -ne 124 ] || fail "rank $r of 2 NCCL ranks hung: $(tail -2 "$work/nccl$r.log")"
  grep -qiE "gpu_trainer rank $r: .*(nccl|cuda|no NCCL)" "$work/nccl$r.log" ||
    fail "rank $r: $(tail -2 "$work/nccl$r.log")"
done
rc=0
"$trainer" "${common[@]}" --collectives=nccl >"$work/nccl-cpu.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "nccl on the CPU backend started"
grep -q -- "--collectives: nccl needs" "$work/nccl-cpu.log" || fail "$(tail -2 "$work/nccl-cpu.log")"
rc=0
CUDA_VISIBLE_DEVICES=0 timeout 60 "$launcher" --shards=1 --ranks=2 --server_binary="$server" \
  --trainer_binary="$trainer" -- "${common[@]}" --device=cuda --collectives=nccl \
  >"$work/nccl-pool.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "the controller ran 2 NCCL ranks on one GPU"
grep -q "2 CUDA ranks on this host need one GPU per rank with --collectives=nccl" "$work/nccl-pool.log" ||
  fail "the pool's refusal: $(tail -3 "$work/nccl-pool.log")"

echo "data_parallel_process_test: all cases passed (Ctrl-C at step $stopped0; rank 0 failed" \
  "${seconds}s after rank 1 died: $(grep 'gpu_trainer rank 0:' "$work/rank0.log" | head -c 160))"
