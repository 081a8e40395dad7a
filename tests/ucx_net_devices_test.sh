#!/usr/bin/env bash
# UCX over TCP between two hosts that each have an extra interface the other cannot use, like a
# container bridge (docker0, podman0), and lose it mid-run. Two network namespaces joined by a veth
# pair (server 10.99.0.1, trainer 10.99.0.2); each also has a bridge `extra0` with a port (so it
# has carrier and UCX opens it), 10.213.0.1/24 on the server's host and 10.214.0.1/24 on the
# trainer's, which the other host has no route to. With UCX_TLS=tcp, the real cpu_optimizer_server
# and offload_transport_peer as the trainer:
#   (1) steps complete, and the server's worker for this trainer offers only s0, the interface
#       that routes to it (its log says so), not extra0;
#   (2) both bridges are deleted while a step is paused half-way through its gradients: the step
#       completes, and so do the next steps on a new attachment.
# Needs root and unshare; elsewhere it prints "ucx_net_devices_test: SKIP:" and exits 0. A build
# without UCX skips too (the peer exits 77).
set -euo pipefail
server_bin=$(readlink -f "$1")
peer_bin=$(readlink -f "$2")

skip() {
  echo "ucx_net_devices_test: SKIP: $*"
  exit 0
}

if [ -z "${OFFLOAD_NET_DEVICES_TEST_INSIDE:-}" ]; then
  # The server's host: a network namespace, and a mount namespace for a sysfs of its own (UCX
  # lists the interfaces in /sys/class/net).
  if ! err=$(unshare -n -m --propagation private true 2>&1); then
    skip "unshare -n -m is not permitted here: $err"
  fi
  export OFFLOAD_NET_DEVICES_TEST_INSIDE=1
  exec unshare -n -m --propagation private bash "$0" "$server_bin" "$peer_bin"
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do echo "== $f" >&2; tail -8 "$f" >&2; done
  exit 1
}

mount -t sysfs none /sys || skip "cannot mount sysfs in a mount namespace"
ip link set lo up

# The trainer's host.
unshare -n -m --propagation private sh -c 'mount -t sysfs none /sys && exec sleep 3600' &
trainer_ns=$!
pids+=("$trainer_ns")
T() { nsenter -t "$trainer_ns" -n -m "$@"; }
for _ in $(seq 50); do T true 2>/dev/null && [ -e "/proc/$trainer_ns/ns/net" ] && break; sleep 0.1; done

# extra_bridge NAME ADDRESS [T]: a bridge with a veth port, up, with ADDRESS (made first, so UCX
# lists it before the routed interface).
extra_bridge() {
  local run=("${@:3}")
  "${run[@]}" ip link add "$1" type bridge
  "${run[@]}" ip link add "${1}p" type veth peer name "${1}q"
  "${run[@]}" ip link set "${1}p" master "$1"
  "${run[@]}" ip link set "${1}p" up
  "${run[@]}" ip link set "${1}q" up
  "${run[@]}" ip addr add "$2" dev "$1"
  "${run[@]}" ip link set "$1" up
}
extra_bridge extra0 10.213.0.1/24
extra_bridge extra0 10.214.0.1/24 T
T ip link set lo up
ip link add s0 type veth peer name t0
ip link set t0 netns "$trainer_ns"
ip addr add 10.99.0.1/24 dev s0
ip link set s0 up
T ip addr add 10.99.0.2/24 dev t0
T ip link set t0 up
for _ in $(seq 50); do
  [ "$(cat /sys/class/net/extra0/operstate)" = up ] && [ "$(cat /sys/class/net/s0/operstate)" = up ] &&
    break
  sleep 0.1
done
[ "$(ip route get 10.99.0.2 | grep -o 'dev [a-z0-9]*')" = "dev s0" ] || fail "no route to 10.99.0.2"

export UCX_TLS=tcp
unset UCX_NET_DEVICES
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
: >"$work/server.log"
OFFLOAD_TOKEN=$token "$server_bin" --listen=10.99.0.1:0 --memory_limit_mib=512 --threads=1 \
  >"$work/server.log" 2>&1 &
server_pid=$!
pids+=("$server_pid")
port=
for _ in $(seq 500); do
  port=$(sed -n 's/.*listening port=\([0-9]*\).*/\1/p' "$work/server.log")
  [ -n "$port" ] && break
  sleep 0.02
done
[ -n "$port" ] || fail "the server did not start"

peer() {  # peer LOG ARGS...: the trainer, in its namespace, at most 60 s
  local log=$1
  shift
  OFFLOAD_SHARD_TOKEN=$token T timeout 60 "$peer_bin" --address="10.99.0.1:$port" \
    --transport=ucx --n=1048576 "$@" >"$work/$log" 2>&1
}

echo "(1) steps over the routed interface only"
rc=0
peer warm.log --steps=2 || rc=$?
if [ "$rc" -eq 77 ]; then
  echo "ucx_net_devices_test: no UCX in this build, skipped"
  exit 0
fi
[ "$rc" -eq 0 ] || fail "steps failed (rc=$rc)"
grep -q "^peer step=2 applied=1" "$work/warm.log" || fail "step 2 not applied"
grep -q "UCX worker on network devices s0\b" "$work/server.log" ||
  fail "the server's worker for 10.99.0.2 does not offer s0 alone"
if grep "UCX worker on network devices" "$work/server.log" | grep -q extra0; then
  fail "the server offers extra0"
fi

echo "(2) both extra bridges deleted while a step is paused mid-exchange"
peer paused.log --steps=1 --pause_mid_step_ms=3000 &
paused=$!
for _ in $(seq 200); do grep -q "^peer mid-exchange step=3" "$work/paused.log" && break; sleep 0.05; done
grep -q "^peer mid-exchange step=3" "$work/paused.log" || fail "no mid-exchange line"
ip link del extra0p
ip link del extra0
T ip link del extra0p
T ip link del extra0
rc=0
wait "$paused" || rc=$?
[ "$rc" -eq 0 ] || fail "the paused step failed after the bridges went (rc=$rc)"
grep -q "^peer step=3 applied=1" "$work/paused.log" || fail "step 3 not applied"
rc=0
peer after.log --steps=2 || rc=$?
[ "$rc" -eq 0 ] || fail "a new attachment failed after the bridges went (rc=$rc)"
grep -q "^peer step=5 applied=1" "$work/after.log" || fail "step 5 not applied"
kill -0 "$server_pid" || fail "the server died"
echo "ucx_net_devices_test: PASS"
