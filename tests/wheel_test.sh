#!/usr/bin/env bash
# The package that installs (issue 43): scripts/build-wheel makes the wheel from this build tree;
# it installs into a fresh virtual environment (Debian's python3-venv, --system-site-packages for
# Debian's torch), and from a directory outside the repository, with no PYTHONPATH,
# OFFLOAD_BUILD_DIR or OFFLOAD_LIBRARY: the library and server it uses are its own, a short
# training script runs (on a server of its own, and on one `python3 -m offload.server` started),
# and `python3 -m offload.server --helpfull` is the program's; the module's process is the
# installed program itself (exec), which SIGTERM stops with exit code 0.
# usage: wheel_test.sh REPO_ROOT BUILD_DIR
set -euo pipefail
root=$1 build=$2
py=/usr/bin/python3
work=$(mktemp -d /tmp/offload-wheel-test-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"  # cleanup, fail
trap cleanup EXIT
"$py" -c 'import torch' 2>/dev/null || { echo "SKIP: wheel_test: $py has no torch"; exit 77; }
"$py" -m venv --help >/dev/null 2>&1 || { echo "SKIP: wheel_test: no python3-venv"; exit 77; }

"$root/scripts/build-wheel" --build_dir="$build" --out="$work/dist" >"$work/build.log" 2>&1 ||
  { log=$work/build.log; fail "build-wheel"; }
wheel=$(ls "$work"/dist/offload-*-py3-none-linux_x86_64.whl)
"$py" -m venv --system-site-packages "$work/env"
"$work/env/bin/pip" install --quiet --no-deps --no-index "$wheel" >"$work/pip.log" 2>&1 ||
  { log=$work/pip.log; fail "pip install $wheel"; }
site=$("$work/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -x "$site/offload/bin/cpu_optimizer_server" ] || fail "the installed server is not executable"

mkdir "$work/elsewhere"
cd "$work/elsewhere"
clean_env=(env -u PYTHONPATH -u OFFLOAD_BUILD_DIR -u OFFLOAD_LIBRARY OMP_NUM_THREADS=1)
clean() { "${clean_env[@]}" "$@"; }
cat >train.py <<'PY'
import sys
import torch
import offload
import offload.native
import offload.torch

site = sys.argv[1]
assert offload.library_path().startswith(site), offload.library_path()
assert offload.native.server_binary().startswith(site), offload.native.server_binary()
assert offload.__file__.startswith(site), offload.__file__
servers = sys.argv[2] if len(sys.argv) > 2 else None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = offload.torch.AdamW(model.parameters(), lr=1e-2, servers=servers)
x = torch.randn(64, 16).to(torch.bfloat16)
y = x.float().sum(1, keepdim=True).to(torch.bfloat16)
losses = []
for _ in range(30):
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
assert losses[-1] < 0.5 * losses[0], losses
print(f"trained: loss {losses[0]:.3f} -> {losses[-1]:.3f} on {opt.transport}")
opt.close()
PY
clean "$work/env/bin/python" train.py "$site" >"$work/train.log" 2>&1 ||
  { log=$work/train.log; fail "training with the installed package"; }
echo "PASS $(tail -1 "$work/train.log") (a server of its own)"

# absl's --helpfull exits 1; the module must answer exactly as the program does.
rc=0; clean "$work/env/bin/python" -m offload.server --helpfull >"$work/help.log" 2>&1 || rc=$?
expected=0; "$build/bin/cpu_optimizer_server" --helpfull >/dev/null 2>&1 || expected=$?
[ "$rc" = "$expected" ] ||
  { log=$work/help.log; fail "--helpfull exited $rc, the program $expected"; }
grep -q -- "-listen" "$work/help.log" ||
  { log=$work/help.log; fail "--helpfull is not the server's"; }
echo "PASS python -m offload.server --helpfull (the program's flags, exit code $rc)"

log=$work/server.log
: >"$log"
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
# A simple command, not the function: $! is then the process that execs python, which execs the
# server, so cleanup's kill reaches the server itself.
OFFLOAD_TOKEN=$token "${clean_env[@]}" "$work/env/bin/python" -m offload.server \
  --listen=127.0.0.1:0 --threads=1 --ucx=false >"$log" 2>&1 &
server_pid=$!
pids+=("$server_pid")
port=""
for _ in $(seq 200); do
  port=$(sed -n 's/.*listening port=\([0-9]*\).*/\1/p' "$log")
  [ -n "$port" ] && break
  sleep 0.05
done
[ -n "$port" ] || fail "python -m offload.server did not announce a port"
OFFLOAD_TOKEN=$token clean "$work/env/bin/python" train.py "$site" "127.0.0.1:$port" \
  >"$work/train2.log" 2>&1 ||
  { log=$work/train2.log; fail "training against python -m offload.server"; }
echo "PASS $(tail -1 "$work/train2.log") (python -m offload.server)"
# The module execs the program: the process is the installed server, and SIGTERM is its own.
exe=$(readlink "/proc/$server_pid/exe")
[ "$exe" = "$site/offload/bin/cpu_optimizer_server" ] ||
  fail "python -m offload.server runs $exe, not the installed server"
kill -TERM "$server_pid"
rc=0; wait "$server_pid" || rc=$?
pids=()
[ "$rc" = 0 ] || fail "python -m offload.server exited $rc on SIGTERM"
grep -q "shutting down" "$log" || fail "python -m offload.server did not shut down on SIGTERM"
echo "PASS python -m offload.server is the installed program; SIGTERM stops it (exit 0)"
echo "PASS wheel $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
