#!/usr/bin/env bash
# The package that installs anywhere a manylinux torch does (issues 43, 58): scripts/build-wheel
# makes the repaired wheel from this build tree (py3-none-manylinux_2_N_x86_64, its C++ libraries
# vendored in offload/lib/). Checks:
#  - ldd of the installed liboffload_c.so, cpu_optimizer_server and UCX module finds every
#    library, and each is the wheel's own copy or part of the C/C++ runtime a manylinux tag
#    allows (glibc's libraries, libstdc++, libgcc_s, and zlib, which every policy lists): none of
#    the Debian packages scripts/bootstrap installs (gRPC, protobuf, abseil, UCX, OpenSSL...);
#  - it installs with PyPI's torch 2.13 (the CPU build) into a clean venv (`python3 -m venv`
#    without --system-site-packages, so not Debian's python3-torch), and a short training script
#    (tests/wheel_train.py) runs there from a directory outside the repository with no
#    PYTHONPATH, LD_LIBRARY_PATH, UCX_* or OFFLOAD_* variables: the package, library, server and
#    torch it uses are the venv's, and no host copy of the vendored libraries is mapped; on a
#    server of its own, and on one `python3 -m offload.server` started (UCX on), over shared
#    memory and over UCX;
#  - that server maps only the wheel's libraries and the C/C++ runtime, UCX's cma module the
#    wheel's: this host has Debian's UCX modules, which must not be loaded (offload/etc/ucx.conf);
#  - `python3 -m offload.server --helpfull` is the program's, and the module's process is the
#    installed program itself (exec), which SIGTERM stops with exit code 0;
#  - the wheel declares the `hf` extra (transformers, accelerate) and requires nothing else.
# usage: wheel_test.sh REPO_ROOT BUILD_DIR   (OFFLOAD_WHEEL_TEST_PYTHON: the python3 to use)
set -euo pipefail
root=$1 build=$2
work=$(mktemp -d /tmp/offload-wheel-test-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"  # cleanup, fail
trap cleanup EXIT
started=$SECONDS

# A python3 with venv: PATH's (pyenv's here) or Debian's with python3-venv.
py=${OFFLOAD_WHEEL_TEST_PYTHON:-}
if [ -z "$py" ]; then
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c 'import venv, ensurepip' 2>/dev/null; then
      py=$(command -v "$candidate")
      break
    fi
  done
fi
[ -n "$py" ] || { echo "SKIP: wheel_test: no python3 with venv and ensurepip (python3-venv)"
                  exit 77; }
# torch 2.13.0 as PyPI's CPU build. Pinned with +cpu so that it can only be that build (the file
# pip's find-links has here and in CI, or PyTorch's CPU index), never the CUDA build a plain
# torch==2.13.0 from PyPI is, with its gigabytes of NVIDIA libraries.
torch_req=torch==2.13.0+cpu

"$root/scripts/build-wheel" --build_dir="$build" --out="$work/dist" >"$work/build.log" 2>&1 ||
  { log=$work/build.log; fail "build-wheel"; }
wheel=$(ls "$work"/dist/offload-*-py3-none-manylinux_*_x86_64.whl) ||
  { log=$work/build.log; fail "build-wheel made no py3-none-manylinux wheel"; }
echo "PASS build-wheel: $(basename "$wheel") ($(du -h "$wheel" | cut -f1)," \
  "$((SECONDS - started)) s)"

clean_env=(env -u PYTHONPATH -u PYTHONHOME -u OFFLOAD_BUILD_DIR -u OFFLOAD_LIBRARY
           -u OFFLOAD_TRANSPORT -u LD_LIBRARY_PATH -u LD_PRELOAD -u UCX_MODULES -u UCX_MODULE_DIR
           -u UCX_TLS OMP_NUM_THREADS=1)
clean() { "${clean_env[@]}" "$@"; }
env=$work/env
clean "$py" -m venv "$env"
# The venv is clean: no system site-packages, so no torch until pip puts PyPI's there.
clean "$env/bin/python" -c 'import torch' 2>/dev/null &&
  fail "$py -m venv made a venv that imports torch before any is installed"
clean "$env/bin/pip" install --dry-run --no-deps "$torch_req" >"$work/pip-torch.log" 2>&1 || {
  echo "SKIP: wheel_test: pip finds no $torch_req for $("$env/bin/python" -V) (PyPI's torch" \
    "2.13.0 as the CPU build: a find-links file, or https://download.pytorch.org/whl/cpu)"
  tail -3 "$work/pip-torch.log"
  exit 77
}
clean "$env/bin/pip" install "$wheel" "$torch_req" >"$work/pip.log" 2>&1 ||
  { log=$work/pip.log; fail "pip install $(basename "$wheel") $torch_req"; }
site=$(clean "$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
site=$(cd "$site" && pwd -P)
echo "PASS installed into a clean venv ($("$env/bin/python" -V), $torch_req," \
  "$((SECONDS - started)) s)"
[ -x "$site/offload/bin/cpu_optimizer_server" ] || fail "the installed server is not executable"
# Every module of python/offload, its subpackages' too, is in the installed package.
while read -r f; do
  [ -f "$site/$f" ] || fail "the installed package has no $f"
done < <(cd "$root/python" && find offload -name __pycache__ -prune -o -name '*.py' -print)

# What a manylinux policy lets a wheel take from the system, and this test accepts from it: the
# C runtime (glibc's libraries, the loader, the vDSO), the C++ one, and zlib (in every policy's
# list, so auditwheel never vendors it). Everything else must come from the wheel's offload/lib.
allowed=(linux-vdso.so.1 ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2
         librt.so.1 libstdc++.so.6 libgcc_s.so.1 libz.so.1)
runtime_lib() {  # runtime_lib NAME: NAME (a soname, or a file such as libz.so.1.2.13) is allowed
  local a
  for a in "${allowed[@]}"; do
    [[ $1 == "$a" || $1 == "$a".* ]] && return 0
  done
  return 1
}
own=$site/offload/lib
modules=("$own"/ucx/lib*)
[ -f "${modules[0]}" ] || fail "the wheel has no UCX modules in offload/lib/ucx"
for elf in "$own/liboffload_c.so" "$site/offload/bin/cpu_optimizer_server" "${modules[@]}"; do
  name=${elf#"$site"/}
  log=$work/ldd.txt
  clean ldd "$elf" >"$log" 2>&1 || fail "ldd $name"
  if grep -q "not found" "$log"; then fail "ldd $name: a library is not found"; fi
  vendored=0
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || path=$soname  # the loader (a path) and the vDSO: no "=>"
    [ -e "$path" ] && path=$(realpath "$path")  # the RPATH's $ORIGIN/.., resolved
    case $path in
      "$own"/*) vendored=$((vendored + 1)) ;;
      *) runtime_lib "${soname##*/}" ||
           fail "ldd $name: $soname resolves to $path, not to offload/lib" ;;
    esac
  done <"$log"
  [ "$vendored" -gt 0 ] || fail "ldd $name: nothing resolves to offload/lib"
  # Its own NEEDED entries too: each the runtime's or a file the wheel has.
  while read -r needed; do
    runtime_lib "$needed" || [ -f "$own/$needed" ] ||
      fail "$name needs $needed, neither vendored nor the runtime's"
  done < <(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  echo "PASS ldd $name: $vendored libraries from offload/lib, the rest the C/C++ runtime"
done
unset log

clean "$env/bin/python" - >"$work/meta.log" 2>&1 <<'PY' ||
import re
from importlib.metadata import metadata
m = metadata("offload")
assert "hf" in (m.get_all("Provides-Extra") or []), m.get_all("Provides-Extra")
requires = m.get_all("Requires-Dist") or []
names = sorted(re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires)
assert names == ["accelerate", "transformers"], requires
assert all(re.search(r"""extra\s*==\s*["']hf["']""", r) for r in requires), requires
PY
  { log=$work/meta.log; fail "the wheel's metadata"; }
echo "PASS metadata: the hf extra (transformers, accelerate), no other requirement"

mkdir "$work/elsewhere"
cd "$work/elsewhere"
cp "$root/tests/wheel_train.py" train.py  # run from here: the repository is not on sys.path
clean "$env/bin/python" train.py "$site" >"$work/train.log" 2>&1 ||
  { log=$work/train.log; fail "training with the installed package"; }
echo "PASS $(tail -1 "$work/train.log") (a server of its own)"

# absl's --helpfull exits 1; the module must answer exactly as the program does.
rc=0; clean "$env/bin/python" -m offload.server --helpfull >"$work/help.log" 2>&1 || rc=$?
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
# server, so cleanup's kill reaches the server itself. UCX on (the program's default): its
# context, made at start, loads UCX's transport modules.
OFFLOAD_TOKEN=$token "${clean_env[@]}" "$env/bin/python" -m offload.server \
  --listen=127.0.0.1:0 --threads=1 >"$log" 2>&1 &
server_pid=$!
pids+=("$server_pid")
port=""
for _ in $(seq 400); do
  port=$(sed -n 's/.*listening port=\([0-9]*\).*/\1/p' "$log")
  [ -n "$port" ] && break
  kill -0 "$server_pid" 2>/dev/null || fail "python -m offload.server ended at start"
  sleep 0.05
done
[ -n "$port" ] || fail "python -m offload.server did not announce a port"
for transport in auto ucx; do
  OFFLOAD_TOKEN=$token clean "$env/bin/python" train.py "$site" "127.0.0.1:$port" "$transport" \
    >"$work/train-$transport.log" 2>&1 ||
    { log=$work/train-$transport.log
      fail "training against python -m offload.server ($transport)"; }
  echo "PASS $(tail -1 "$work/train-$transport.log") (python -m offload.server, $transport)"
done
# The module execs the program: the process is the installed server, and SIGTERM is its own.
exe=$(readlink "/proc/$server_pid/exe")
[ "$exe" = "$site/offload/bin/cpu_optimizer_server" ] ||
  fail "python -m offload.server runs $exe, not the installed server"
# Every shared object the server mapped (after two jobs, one over UCX) is the wheel's or the
# runtime's: UCX's modules too, none from the host's module folder.
log=$work/server-maps.txt
awk '$6 ~ /\.so/ { print $6 }' "/proc/$server_pid/maps" | sort -u >"$log"
fail_log_lines=+1
grep -q "^$own/ucx/libuct_cma" "$log" || fail "the server did not load the wheel's UCX cma module"
while read -r path; do
  case $path in
    "$own"/*) ;;
    *) runtime_lib "$(basename "$path")" || fail "the server mapped $path" ;;
  esac
done <"$log"
echo "PASS the server maps $(wc -l <"$log") shared objects: the wheel's (UCX's cma module" \
  "included) and the C/C++ runtime"
log=$work/server.log fail_log_lines=30
kill -TERM "$server_pid"
rc=0; wait "$server_pid" || rc=$?
pids=()
[ "$rc" = 0 ] || fail "python -m offload.server exited $rc on SIGTERM"
grep -q "shutting down" "$log" || fail "python -m offload.server did not shut down on SIGTERM"
echo "PASS python -m offload.server is the installed program; SIGTERM stops it (exit 0)"
echo "PASS wheel $(basename "$wheel") ($(du -h "$wheel" | cut -f1)), $((SECONDS - started)) s"
