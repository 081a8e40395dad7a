#!/usr/bin/env bash
# offload_local end to end: the real cpu_optimizer_server and a fake trainer (a bash script that
# records its pid and arguments, connects to every shard and then exits or runs as told). Checks
# exit codes, the trainer's --shards, orderly Ctrl-C, a server dying mid-run, kill -9 of the
# launcher (no orphans), servers that cannot start, and jobs of two trainer ranks (their flags,
# the rendezvous directory, rank 1's prefixed output, a failing rank, Ctrl-C, a dying server).
set -euo pipefail
launch=("$1" --controller=none)  # offload_local; every case here runs without a job controller
server=$2
source "$(dirname "$0")/process_lib.sh"
work=$(mktemp -d)
pids=()  # everything started, for cleanup whatever happens
trap cleanup EXIT
fail_log_lines=+1  # fail shows the whole launcher log

# A zombie counts as gone: whoever inherits orphans here may reap them late, or never.
alive() {
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

wait_for_file() {
  for _ in $(seq 150); do [ -e "$1" ] && return 0; sleep 0.1; done
  fail "no $1 after 15 s"
}

# Its files are named after its rank: trainer.* when the launcher passed no --rank, rankR.*
# otherwise. FAKE_MODE is one mode per rank, comma-separated ("run,exit3": rank 1 fails).
cat >"$work/fake_trainer" <<'EOF'
#!/usr/bin/env bash
dir=$FAKE_DIR
name=trainer rank=0 world=1 rendezvous=
for arg in "$@"; do
  case $arg in
    --rank=*) rank=${arg#--rank=} && name=rank$rank ;;
    --world_size=*) world=${arg#--world_size=} ;;
    --rendezvous=*) rendezvous=${arg#--rendezvous=} ;;
  esac
done
echo $$ >"$dir/$name.pid"
printf '%s\n' "$@" >"$dir/$name.args"
trap 'touch "$dir/$name.sigint"; exit 130' INT
echo "fake $name: to stdout"
echo "fake $name: to stderr" >&2
IFS=, read -ra addrs <<<"${1#--shards=}"
for a in "${addrs[@]}"; do
  if ! { : <>"/dev/tcp/${a%:*}/${a##*:}"; } 2>/dev/null; then
    echo "fake trainer: cannot reach $a" >&2
    exit 99
  fi
done
touch "$dir/$name.reached"
# Waits on a FIFO nobody writes, with builtins only: a `sleep` child would outlive a SIGKILL of
# this script by a moment and show up as a leftover.
mkfifo "$dir/$name.idle"
exec 9<>"$dir/$name.idle"
# A barrier in the rendezvous directory: it only opens if every rank got the same, existing one,
# and it leaves files there for the launcher to remove.
if [ -n "$rendezvous" ]; then
  touch "$rendezvous/rank$rank" || exit 98
  for ((i = 0; ; i++)); do
    ready=("$rendezvous"/rank*)
    [ "${#ready[@]}" -eq "$world" ] && break
    [ "$i" -lt 100 ] || { echo "fake $name: the barrier never opened" >&2; exit 98; }
    read -r -t 0.1 -u 9 _ || true
  done
fi
IFS=, read -ra modes <<<"$FAKE_MODE"
case ${modes[$rank]:-${modes[0]}} in
  exit0) exit 0 ;;
  exit3) exit 3 ;;
  run) while :; do read -r -t 1 -u 9 _ || true; done ;;
esac
EOF
chmod +x "$work/fake_trainer"

# Starts the launcher in the background: start_job NAME MODE SHARDS [launcher flags] [-- trainer
# flags]. Sets dir, log, job. The launcher's TMPDIR is $dir/tmp, where the rendezvous goes.
start_job() {
  dir=$work/$1
  mkdir -p "$dir/tmp"
  log=$dir/launcher.log
  TMPDIR=$dir/tmp FAKE_DIR=$dir FAKE_MODE=$2 "${launch[@]}" --shards="$3" --server_binary="$server" \
    --trainer_binary="$work/fake_trainer" --server_args="--threads=1 --memory_limit_mib=64" \
    "${@:4}" >"$log" 2>&1 &
  job=$!
  pids+=("$job")
}

# Waits (at most 20 s) for the launcher to exit; sets rc.
wait_job() {
  for _ in $(seq 200); do alive "$job" || break; sleep 0.1; done
  alive "$job" && fail "the launcher is still running"
  rc=0
  wait "$job" || rc=$?
  for p in $(server_pids) $(trainer_pids); do pids+=("$p"); done
}

trainer_pids() { cat "$dir"/*.pid 2>/dev/null || true; }

server_pids() { sed -n 's/^offload_local: shard [0-9]* listening on .* (pid \([0-9]*\))$/\1/p' "$log"; }
server_port() { sed -n "s/^offload_local: shard $1 listening on 127.0.0.1:\([0-9]*\) .*/\1/p" "$log"; }

# Every process of the job is gone: the servers the launcher reported, the trainer ranks, and
# anything else that carries this case's FAKE_DIR in its environment (every child of the launcher
# does). So is the rendezvous directory, if there was one.
expect_all_gone() {
  local p
  for p in $(server_pids); do alive "$p" && fail "server $p still running"; done
  for p in $(trainer_pids); do alive "$p" && fail "trainer $p still running"; done
  for p in $(grep -lzx "FAKE_DIR=$dir" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    alive "$p" && fail "process $p ($(tr '\0' ' ' <"/proc/$p/cmdline")) still running"
  done
  if [ -d "$dir/tmp" ] && [ -n "$(ls -A "$dir/tmp")" ]; then
    fail "left in TMPDIR: $(ls -A "$dir/tmp")"
  fi
  return 0
}

# The --rendezvous rank R was given.
rendezvous_of() { sed -n 's/^--rendezvous=//p' "$dir/rank$1.args"; }

expect_log() { grep -qF -- "$1" "$log" || fail "launcher output lacks '$1'"; }

echo "--- 1. the trainer succeeds"
start_job ok exit0 2 -- --steps=3 "--name=a b"
wait_job
[ "$rc" -eq 0 ] || fail "exit $rc, want 0"
[ "$(server_pids | wc -l)" -eq 2 ] || fail "want 2 servers"
# One rank: exactly --shards and the trainer flags, no --rank, --world_size or --rendezvous.
want="--shards=127.0.0.1:$(server_port 0),127.0.0.1:$(server_port 1)"
printf '%s\n' "$want" --steps=3 "--name=a b" | cmp -s - "$dir/trainer.args" ||
  fail "trainer args: $(cat "$dir/trainer.args"), want $want --steps=3 --name=a b"
[ -e "$dir/trainer.reached" ] || fail "the trainer could not reach the shards"
expect_log "[shard 1] cpu_optimizer_server shutting down"
expect_log "offload_local: trainer exited with status 0"
grep -qx "fake trainer: to stdout" "$log" || fail "the trainer's output is not passed through as is"
expect_all_gone

echo "--- 2. the trainer fails with status 3"
start_job fails exit3 2
wait_job
[ "$rc" -eq 3 ] || fail "exit $rc, want 3"
expect_log "offload_local: trainer exited with status 3"
expect_all_gone

echo "--- 3. SIGINT to the launcher while the trainer runs"
start_job sigint run 2 --shutdown_timeout=10s
wait_for_file "$dir/trainer.reached"
kill -INT "$job"
wait_job
[ "$rc" -eq 130 ] || fail "exit $rc, want 130"
[ -e "$dir/trainer.sigint" ] || fail "the trainer never saw SIGINT"
expect_log "offload_local: stopped on SIGINT; trainer exited with status 130"
expect_all_gone

echo "--- 4. a server is killed mid-run"
start_job server_dies run 2
wait_for_file "$dir/trainer.reached"
victim=$(server_pids | head -1)
kill -9 "$victim"
wait_job
[ "$rc" -ne 0 ] || fail "exit 0 after a server died"
expect_log "shard 0 (pid $victim) was killed by signal 9"
expect_all_gone

echo "--- 5. kill -9 of the launcher leaves no orphans"
start_job launcher_dies run 2
wait_for_file "$dir/trainer.reached"
kill -9 "$job"
wait "$job" 2>/dev/null || true
trainer=$(cat "$dir/trainer.pid")
for _ in $(seq 30); do
  left=0
  for p in $(server_pids) "$trainer"; do alive "$p" && left=1; done
  [ "$left" -eq 0 ] && break
  sleep 0.1
done
for p in $(server_pids); do pids+=("$p"); done
pids+=("$trainer")
expect_all_gone

echo "--- 6a. the server binary does not exist"
dir=$work/missing && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
FAKE_DIR=$dir FAKE_MODE=exit0 "${launch[@]}" --shards=2 --server_binary=/nonexistent/server \
  --trainer_binary="$work/fake_trainer" >"$log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "exit 0 without a server"
expect_log "offload_local: cannot execute the server binary /nonexistent/server: No such file"
[ ! -e "$dir/trainer.pid" ] || fail "the trainer ran without servers"
expect_all_gone

echo "--- 6b. the trainer binary does not exist: nothing starts"
dir=$work/no_trainer && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
"${launch[@]}" --server_binary="$server" --trainer_binary=/nonexistent/trainer >"$log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "exit 0 without a trainer"
expect_log "offload_local: cannot execute the trainer binary /nonexistent/trainer: No such file"
grep -q "listening" "$log" && fail "a server was started for a trainer that cannot run"

echo "--- 6b'. metrics targets without a controller: refused before anything starts"
dir=$work/no_metrics && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
"${launch[@]}" --metrics_targets_dir="$dir/targets" --server_binary="$server" \
  >"$log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || fail "--metrics_targets_dir with --controller=none exited $rc, want 2"
expect_log "offload_local: --metrics_targets_dir needs --controller=local"
[ -e "$dir/targets" ] && fail "targets written without a controller"
grep -q "listening" "$log" && fail "a server was started"

echo "--- 6c. one of two servers exits at once"
# The first server started is real, the second fails: the real one must be stopped too.
cat >"$work/half_server" <<EOF
#!/usr/bin/env bash
if mkdir "\$FAKE_DIR/first" 2>/dev/null; then exec "$server" "\$@"; fi
echo "fake server: bad flag"
exit 2
EOF
chmod +x "$work/half_server"
dir=$work/half && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
FAKE_DIR=$dir FAKE_MODE=exit0 "${launch[@]}" --shards=2 --server_binary="$work/half_server" \
  --trainer_binary="$work/fake_trainer" >"$log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "exit 0 with a failed server"
expect_log "exited with status 2 before it was listening; last output: fake server: bad flag"
[ ! -e "$dir/trainer.pid" ] || fail "the trainer ran without servers"
expect_all_gone

echo "--- 6d. a server never reports its port"
printf '#!/usr/bin/env bash\nexec sleep 30\n' >"$work/silent_server"
chmod +x "$work/silent_server"
dir=$work/silent && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
FAKE_DIR=$dir FAKE_MODE=exit0 "${launch[@]}" --server_binary="$work/silent_server" \
  --trainer_binary="$work/fake_trainer" --startup_timeout=1s >"$log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "exit 0 with a silent server"
expect_log "did not report 'listening port=N' within 1s; it printed nothing"
expect_all_gone

echo "--- 7. two ranks succeed"
start_job ranks_ok exit0 2 --ranks=2 -- --steps=3 "--name=a b"
wait_job
[ "$rc" -eq 0 ] || fail "exit $rc, want 0"
shards="--shards=127.0.0.1:$(server_port 0),127.0.0.1:$(server_port 1)"
rendezvous=$(rendezvous_of 0)
case $rendezvous in
  "$dir/tmp/offload-rendezvous-"??????) ;;
  *) fail "rendezvous '$rendezvous' is not a fresh directory in TMPDIR" ;;
esac
for r in 0 1; do
  printf '%s\n' "$shards" --rank=$r --world_size=2 --rendezvous="$rendezvous" --steps=3 \
    "--name=a b" | cmp -s - "$dir/rank$r.args" || fail "rank $r args: $(cat "$dir/rank$r.args")"
done
grep -qx "fake rank0: to stdout" "$log" || fail "rank 0's output is not passed through as is"
grep -qx "fake rank0: to stderr" "$log" || fail "rank 0's output is not passed through as is"
expect_log "[rank 1] fake rank1: to stdout"
expect_log "[rank 1] fake rank1: to stderr"
grep -q "^fake rank1" "$log" && fail "rank 1's output is not prefixed"
expect_log "offload_local: all 2 trainer ranks exited with status 0"
expect_all_gone

echo "--- 8. rank 1 fails with status 3: rank 0 is stopped"
start_job rank_fails run,exit3 2 --ranks=2
wait_job
[ "$rc" -eq 3 ] || fail "exit $rc, want 3"
[ -e "$dir/rank0.sigint" ] || fail "rank 0 never saw SIGINT"
expect_log "offload_local: trainer rank 1 (pid $(cat "$dir/rank1.pid")) exited with status 3; stopping"
expect_log "offload_local: trainer rank 1 exited with status 3; trainer rank 0 exited with status 130"
expect_all_gone

echo "--- 9. SIGINT to the launcher reaches both ranks"
start_job ranks_sigint run 2 --ranks=2 --shutdown_timeout=10s
wait_for_file "$dir/rank0.reached"
wait_for_file "$dir/rank1.reached"
[ -d "$(rendezvous_of 0)" ] || fail "no rendezvous directory while the ranks run"
kill -INT "$job"
wait_job
[ "$rc" -eq 130 ] || fail "exit $rc, want 130"
[ -e "$dir/rank0.sigint" ] || fail "rank 0 never saw SIGINT"
[ -e "$dir/rank1.sigint" ] || fail "rank 1 never saw SIGINT"
expect_log "offload_local: stopped on SIGINT; trainer rank 0 exited with status 130, trainer rank 1 exited with status 130"
expect_all_gone

echo "--- 10. a server is killed under two ranks"
start_job ranks_server_dies run 2 --ranks=2
wait_for_file "$dir/rank0.reached"
wait_for_file "$dir/rank1.reached"
victim=$(server_pids | tail -1)
kill -9 "$victim"
wait_job
[ "$rc" -eq 1 ] || fail "exit $rc, want 1"
[ -e "$dir/rank0.sigint" ] && [ -e "$dir/rank1.sigint" ] || fail "a rank never saw SIGINT"
expect_log "shard 1 (pid $victim) was killed by signal 9 (Killed) while the trainer was running; trainer rank 0 exited with status 130, trainer rank 1 exited with status 130"
expect_all_gone

echo "--- 11. --ranks=0 is refused"
dir=$work/no_ranks && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
"${launch[@]}" --ranks=0 --server_binary="$server" --trainer_binary="$work/fake_trainer" \
  >"$log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || fail "exit $rc, want 2"
expect_log "offload_local: --ranks must be at least 1 (got 0)"
grep -q "listening" "$log" && fail "a server was started for --ranks=0"

echo "--- 12. CUDA ranks: each takes its own GPU over nccl; over gloo they may share one"
# No GPU is needed: CUDA_VISIBLE_DEVICES says how many the host has, and the fake trainer only
# records the --cuda_device it was given.
CUDA_VISIBLE_DEVICES=0,1 start_job gpus_nccl exit0 1 --ranks=2 -- --device=cuda --collectives=nccl
wait_job
[ "$rc" -eq 0 ] || fail "exit $rc, want 0"
for r in 0 1; do
  [ "$(grep -c '^--cuda_device=' "$dir/rank$r.args")" = 1 ] &&
    grep -qx -- "--cuda_device=$r" "$dir/rank$r.args" || fail "rank $r: $(cat "$dir/rank$r.args")"
done
expect_all_gone
CUDA_VISIBLE_DEVICES=0 start_job gpus_gloo exit0 1 --ranks=2 -- --device=cuda --collectives=gloo
wait_job
[ "$rc" -eq 0 ] || fail "exit $rc, want 0"
for r in 0 1; do
  grep -qx -- "--cuda_device=0" "$dir/rank$r.args" || fail "rank $r: $(cat "$dir/rank$r.args")"
done
expect_all_gone
# A device the user chose is every rank's; the CPU backend gets none.
CUDA_VISIBLE_DEVICES=0,1 start_job gpus_given exit0 1 --ranks=2 -- --device=cuda --cuda_device=1
wait_job
[ "$rc" -eq 0 ] || fail "exit $rc, want 0"
for r in 0 1; do
  [ "$(grep -c '^--cuda_device=' "$dir/rank$r.args")" = 1 ] || fail "rank $r: $(cat "$dir/rank$r.args")"
done
start_job gpus_cpu exit0 1 --ranks=2 -- --steps=1
wait_job
grep -q -- "--cuda_device" "$dir/rank0.args" && fail "a CPU rank was given a GPU"
expect_all_gone

echo "--- 13. more NCCL ranks than GPUs: refused before anything starts"
dir=$work/too_few_gpus && mkdir -p "$dir" && log=$dir/launcher.log
rc=0
CUDA_VISIBLE_DEVICES=0 FAKE_DIR=$dir FAKE_MODE=exit0 "${launch[@]}" --ranks=2 \
  --server_binary="$server" --trainer_binary="$work/fake_trainer" -- --device=cuda \
  --collectives=nccl >"$log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || fail "exit $rc, want 1"
expect_log "2 CUDA ranks on this host need one GPU per rank with --collectives=nccl, but 1 is visible"
grep -q "listening" "$log" && fail "a server was started"
[ ! -e "$dir/rank0.pid" ] || fail "a rank was started"

echo "PASS"
