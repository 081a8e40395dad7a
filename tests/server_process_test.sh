#!/usr/bin/env bash
# Cross-process test: the real cpu_optimizer_server binary and the synthetic trainer talking over
# loopback. A short training run must succeed and lower the loss; a server killed mid-run must
# make the trainer fail with a clear error within a bounded time (never hang); SIGTERM must stop
# the server cleanly.
set -euo pipefail
server_bin=$1
train_bin=$2
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()
trap cleanup EXIT
server_flags=(--memory_limit_mib=1024 --threads=2)

echo "--- a short training run"
start_server "$server_bin" "$work/server1.log" "${server_flags[@]}"
server1=$server_pid
"$train_bin" --server="127.0.0.1:$port" --n=1048577 --ranges=2 --steps=6 --job=short \
  | tee "$work/train1.log"
grep -q "^done: loss" "$work/train1.log"

echo "--- the server dies mid-run"
"$train_bin" --server="127.0.0.1:$port" --n=4194304 --steps=100000 --job=long \
  >"$work/train2.log" 2>&1 &
trainer=$!
pids+=($trainer)
for _ in $(seq 300); do
  grep -q "^step   3" "$work/train2.log" && break
  sleep 0.1
done
grep -q "^step   3" "$work/train2.log" || { cat "$work/train2.log"; exit 1; }
kill -9 "$server1"
rc=0
timeout 30 tail --pid="$trainer" -f /dev/null || { echo "trainer hung after the server died"; exit 1; }
wait "$trainer" || rc=$?
cat "$work/train2.log" | tail -3
[ "$rc" -ne 0 ] || { echo "trainer exited 0 after its server died"; exit 1; }
grep -q "offload_synthetic_train: step: " "$work/train2.log"

echo "--- SIGTERM stops the server"
start_server "$server_bin" "$work/server2.log" "${server_flags[@]}"
server2=$server_pid
kill -TERM "$server2"
timeout 10 tail --pid="$server2" -f /dev/null || { echo "server ignored SIGTERM"; exit 1; }
wait "$server2"
grep -q "shutting down" "$work/server2.log"
echo "server_process_test: all passed"
