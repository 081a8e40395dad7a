#!/usr/bin/env bash
# The wheel on a machine that has none of this project's C++ dependencies (issue 58): a bare
# Debian 12 container (mmdebstrap's minbase with python3 and python3-venv only: no gRPC,
# protobuf, abseil, UCX, glog or OpenMP runtime), with no network. The wheel scripts/build-wheel
# makes from this build tree and PyPI's torch 2.13.0 CPU build with its dependencies (fetched on
# the host by pip, from the same find-links file wheel_test.sh installs from, and kept in
# BUILD_DIR/wheel-container-deps) are mounted in; inside, pip installs them into a fresh venv
# (--no-index), ldd finds every library of liboffload_c.so and cpu_optimizer_server, and
# tests/wheel_train.py trains from /tmp on a server of its own (the packaged program), and
# `python3 -m offload.server --helpfull` answers with the program's flags.
#
#   tests/wheel_container_test.sh REPO_ROOT BUILD_DIR
#
# Skips (exit 77, with the reason) where neither podman nor docker can run a container
# (scripts/container-engine.sh), or the image is missing and mmdebstrap is not installed to make
# it. The image, localhost/offload-wheel-base:bookworm, is made once (about 90 s) and kept; a run
# with it takes about a minute.
set -euo pipefail
root=$(cd "$1" && pwd) build=$(cd "$2" && pwd)
work=$(mktemp -d /tmp/offload-wheel-container-XXXXXX)
pids=()
source "$root/tests/process_lib.sh"  # cleanup, fail
trap cleanup EXIT
started=$SECONDS

# shellcheck source=../scripts/container-engine.sh
source "$root/scripts/container-engine.sh"
pick_container_engine || { echo "SKIP: wheel_container_test: $WHY"; exit 77; }
image=localhost/offload-wheel-base:bookworm
if ! $ENGINE image inspect "$image" >/dev/null 2>&1; then
  command -v mmdebstrap >/dev/null || {
    echo "SKIP: wheel_container_test: no image $image, and no mmdebstrap to make it" \
      "(apt-get install mmdebstrap)"
    exit 77
  }
  sources=()  # this machine's apt sources, as scripts/build-image takes them
  for s in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$s" ]; then sources=("$s"); break; fi
  done
  log=$work/mmdebstrap.log
  mmdebstrap --variant=minbase --include=python3,python3-venv bookworm "$work/base.tar" \
    "${sources[@]}" >"$log" 2>&1 || fail "mmdebstrap (the image $image)"
  $ENGINE import "$work/base.tar" "$image" >/dev/null 2>"$log" || fail "$ENGINE import"
  rm -f "$work/base.tar"
  echo "PASS made $image with mmdebstrap ($((SECONDS - started)) s)"
fi

log=$work/build.log
"$root/scripts/build-wheel" --build_dir="$build" --out="$work/dist" >"$log" 2>&1 ||
  fail "build-wheel"
wheel=$(basename "$(ls "$work"/dist/offload-*-py3-none-manylinux_*_x86_64.whl)")

# torch and its dependencies for the image's CPython, from the host's pip (its find-links file
# for torch: +cpu, never the CUDA build; see wheel_test.sh). pip download keeps what it finds in
# the folder already.
log=$work/engine.log
version=$($ENGINE run --rm --network=none "$image" python3 -c \
  'import sys; print("%d.%d" % sys.version_info[:2])' 2>"$log") || fail "$ENGINE run $image"
py=""
for candidate in python3 /usr/bin/python3; do
  if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = \
       "$version" ] && "$candidate" -m pip --version >/dev/null 2>&1; then
    py=$candidate
    break
  fi
done
[ -n "$py" ] || { echo "SKIP: wheel_container_test: no python$version with pip here to fetch" \
                    "torch for the image's python3 ($version)"; exit 77; }
deps=$build/wheel-container-deps
mkdir -p "$deps"
log=$work/pip-download.log
"$py" -m pip download --only-binary=:all: -d "$deps" "torch==2.13.0+cpu" >"$log" 2>&1 || {
  echo "SKIP: wheel_container_test: pip finds no torch==2.13.0+cpu (PyPI's torch 2.13.0 as the" \
    "CPU build: a find-links file, or https://download.pytorch.org/whl/cpu)"
  tail -3 "$log"
  exit 77
}

mkdir "$work/in"
cp "$root/tests/wheel_train.py" "$work/in/train.py"
cat >"$work/in/run.sh" <<'SH'
# Inside the container: $1 the wheel's file name (in /wheel); torch's files in /deps.
set -eu
fail() { echo "FAIL (in the container): $*"; exit 1; }
# The image really is bare: none of the libraries the wheel vendors is installed.
bare=$(ls /usr/lib/x86_64-linux-gnu | grep -E '^lib(grpc|protobuf|absl_|ucs|uct|ucp|glog|gomp)' ||
       true)
[ -z "$bare" ] || fail "the image has $bare"
python3 -m venv /tmp/env
/tmp/env/bin/pip install --quiet --no-index --find-links /deps "/wheel/$1" torch==2.13.0+cpu ||
  fail "pip install"
site=$(/tmp/env/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
for elf in "$site/offload/lib/liboffload_c.so" "$site/offload/bin/cpu_optimizer_server"; do
  ldd "$elf" >/tmp/ldd.txt 2>&1 || { cat /tmp/ldd.txt; fail "ldd $elf"; }
  if grep "not found" /tmp/ldd.txt; then fail "ldd $elf: libraries not found"; fi
done
echo "ldd: every library of liboffload_c.so and cpu_optimizer_server found"
cd /tmp
OMP_NUM_THREADS=1 /tmp/env/bin/python /in/train.py "$site" || fail "training"
rc=0
/tmp/env/bin/python -m offload.server --helpfull >/tmp/help.txt 2>&1 || rc=$?
grep -q -- "-listen" /tmp/help.txt || { cat /tmp/help.txt; fail "--helpfull (exit code $rc)"; }
echo "python -m offload.server --helpfull: the program's flags (exit code $rc)"
SH
log=$work/container.log
$ENGINE run --rm --network=none --shm-size=256m \
  -v "$work/dist:/wheel:ro" -v "$deps:/deps:ro" -v "$work/in:/in:ro" \
  "$image" /bin/sh /in/run.sh "$wheel" >"$log" 2>&1 ||
  { fail_log_lines=+1; fail "the wheel in $image"; }
grep -q "^trained: " "$log" || { fail_log_lines=+1; fail "no training in $image"; }
echo "PASS $(grep "^ldd: " "$log") in $image"
echo "PASS $(grep "^trained: " "$log") in $image (no network, $wheel)"
echo "PASS $(grep "^python -m offload.server" "$log")"
echo "PASS wheel_container_test: $((SECONDS - started)) s"
