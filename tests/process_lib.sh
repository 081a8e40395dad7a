# Helpers shared by the cross-process tests. Sourced, never run:
#   source "$(dirname "$0")/process_lib.sh"
# The sourcing script sets `work` (its scratch directory) and `pids` (every process it started)
# and installs `trap cleanup EXIT`. Helpers marked below read further globals of the script.

# Kills everything in $pids and removes $work.
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  # File systems a test mounted under $work (tests/stall_fs.py): away before their files go.
  for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  rm -rf "$work"
}
mounts=()

# fail MESSAGE...: prints it, then the last $fail_log_lines lines (30; "+1" for all) of $log if the
# script set one, and exits 1. A script that wants other context defines its own after sourcing.
fail() {
  echo "FAIL: $*" >&2
  if [ -n "${log:-}" ] && [ -f "$log" ]; then
    tail -n "${fail_log_lines:-30}" "$log" | sed 's/^/  | /' >&2
  fi
  exit 1
}

# The servers start_server starts accept this token (as $OFFLOAD_TOKEN), and every client of them
# presents it ($OFFLOAD_SHARD_TOKEN, what gpu_trainer and the shard tools read): a fresh one per
# script, in the environment, as offload_local does it.
OFFLOAD_SHARD_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export OFFLOAD_SHARD_TOKEN

# start_server BINARY LOG [FLAGS...]: a cpu_optimizer_server on an ephemeral loopback port, in the
# background. Sets $server_pid and $port, adds the pid to $pids; fails if no port within 10 s (with
# LOG as $log, so that fail shows it).
start_server() {
  local log=$2
  # Made here, not by the background redirection, which may open it after the first sed below.
  : >"$log"
  OFFLOAD_TOKEN=$OFFLOAD_SHARD_TOKEN "$1" --listen=127.0.0.1:0 "${@:3}" >"$log" 2>&1 &
  server_pid=$!
  pids+=("$server_pid")
  for _ in $(seq 500); do
    port=$(sed -n 's/.*listening port=\([0-9]*\).*/\1/p' "$log")
    if [ -n "$port" ]; then return 0; fi
    sleep 0.02
  done
  fail "the server did not start (log: $log)"
}

# The launcher tests: offload_local, two optimizer servers and gpu_trainer. They read $launcher,
# $server, $trainer, $steps and the trainer flags every run shares, ${common[@]}.

# job LOG [--ranks=N] [--server_args=ARGS] ARGS...: the launcher with two shards, in the background,
# the trainer given ${common[@]} ARGS. Sets $log and $launched and adds the launcher to $pids.
job() {
  log=$1
  shift
  local launcher_flags=()
  while :; do
    case ${1-} in --ranks=* | --server_args=*) launcher_flags+=("$1") && shift ;; *) break ;; esac
  done
  "$launcher" --controller=none --shards=2 "${launcher_flags[@]}" --server_binary="$server" \
    --trainer_binary="$trainer" --shutdown_timeout=30s -- "${common[@]}" "$@" >"$log" 2>&1 &
  launched=$!
  pids+=("$launched")
}

# final_files DIR: the committed checkpoint of step $steps in DIR (failing if there is none).
final_files() {
  local dir
  dir=$1/$(printf 'step-%08d' "$steps")
  [ -f "$dir/manifest.json" ] || fail "no checkpoint at $dir"
  echo "$dir"
}

# same_checkpoint DIR_A DIR_B WHAT: the two runs' last checkpoints hold the same files, byte for
# byte.
same_checkpoint() {
  local a b f
  a=$(final_files "$1")
  b=$(final_files "$2")
  [ "$(ls "$a")" = "$(ls "$b")" ] || fail "$3: $a and $b hold different files"
  for f in "$a"/*; do
    cmp -s "$f" "$b/${f##*/}" || fail "$3: ${f##*/} differs between $a and $b"
  done
}

# wait_for_checkpoint DIR: waits (12 s at most) until DIR/latest names a checkpoint, failing at
# once if the job $launched ends first.
wait_for_checkpoint() {
  for _ in $(seq 600); do
    [ -s "$1/latest" ] && return 0
    kill -0 "$launched" 2>/dev/null || fail "the job ended before its first checkpoint"
    sleep 0.02
  done
  fail "no checkpoint in $1 after 12 s"
}

# make_tls_files DIR: a CA (ca.pem), a server certificate for localhost and 127.0.0.1
# (server.pem, server.key) and a client certificate (client.pem, client.key), all signed by the
# CA, with the openssl command line.
make_tls_files() {
  (
    cd "$1"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=offload-test-ca" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key \
      -out server.csr 2>/dev/null
    printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" >san.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
      -extfile san.ext -out server.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=client" -keyout client.key \
      -out client.csr 2>/dev/null
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
      -out client.pem 2>/dev/null
  )
}
