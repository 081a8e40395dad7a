#!/usr/bin/env bash
# Validates the Kubernetes manifests in k8s/ (ARCHITECTURE.md section 2: "manifest validation").
#
#   tests/k8s_manifests_test.sh [REPO_ROOT [BUILD_DIR]]
#
# For k8s/base and every overlay in k8s/overlays/:
#   - `kubectl kustomize` renders it and prints nothing on stderr (no deprecation warnings);
#   - every object validates against its schema and has no field the schema does not define
#     (tests/k8s/validate.py, jsonschema): the Kubernetes kinds against the strict JSON schemas of
#     kubernetes-validate for every version in $k8s_versions (valid from the oldest to the
#     newest), the Prometheus Operator kinds against the schemas of the
#     cloudcoil-models-prometheus-operator models (CRDs of operator v0.80.1); a kind or API
#     version without a schema is an error;
#   - the policy checks of tests/k8s/check_manifests.py hold (security contexts, resources,
#     probes, Guaranteed optimizer pods, the Indexed trainer Job, /dev/shm, PodMonitor jobs and
#     ports against docs/METRICS.md, the PrometheusRule against monitoring/prometheus/rules/,
#     the example job against the layout: ranks and shards, and for the torch overlay's torch
#     job its program and script in the Dockerfile's torch stage and the torch image on the
#     trainers only); the NetworkPolicies: a default deny, every flow the binaries need admitted
#     (pool to controller, ranks to shards and back, rank to rank, Prometheus to every port a
#     PodMonitor scrapes) and nothing else from outside Offload's pods; the controller's
#     --tenants_file in the optional Secret offload-tenants, whose example is consistent;
#   - k8s/base/tenants-example.yaml (in no kustomization) validates against the schemas too.
# Every case in tests/k8s/broken/ must be rejected with the message in its `expected` file, so
# none of these checks can pass by checking nothing (among them a misspelt field and a wrong type
# in a core kind and in a Prometheus Operator kind, and a removed API version).
# k8s/base/prometheus-rule.yaml must be what k8s/tools/make-prometheus-rule.py generates, and the
# Dockerfile must ship what the manifests run.
#
# Needs kubectl (with kustomize v5) and /usr/bin/python3 with PyYAML (python3-yaml) and venv
# (python3-venv). The validators pinned in tests/k8s/requirements.txt are installed from PyPI with
# pip into a virtual environment outside the source tree: $OFFLOAD_K8S_VENV, default
# BUILD_DIR/k8s_manifests_venv when BUILD_DIR is given, else
# ${XDG_CACHE_HOME:-~/.cache}/offload-k8s-test/venv. The first run installs them (under a lock,
# as ctest runs tests in parallel; that run takes 15-22 s instead of 6-9 s), later runs reuse
# them (a stamp of requirements.txt and the python) and work offline; a missing tool or a failed
# install fails the test, it is never skipped. BUILD_DIR, when given, also holds the scratch
# files (else a temporary directory). OFFLOAD_K8S_TEST_VERBOSE=1 also prints every problem found
# in the broken cases.
set -euo pipefail

root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
build_dir=${2:-}
tests="$root/tests/k8s"
if [ -n "$build_dir" ]; then
  venv=${OFFLOAD_K8S_VENV:-$build_dir/k8s_manifests_venv}
else
  venv=${OFFLOAD_K8S_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/offload-k8s-test/venv}
fi
# The Kubernetes versions every object must be valid in: the oldest we promise and the newest
# that the pinned kubernetes-validate carries.
k8s_versions=1.27,1.37

passed=0
failed=0
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
die() {
  echo "FAIL: $*"
  echo "0 passed, 1 failed"
  exit 1
}

# --- tools ------------------------------------------------------------------------------------
command -v kubectl >/dev/null ||
  die "kubectl not found: install kubectl (it carries kustomize v5) to validate k8s/"
kustomize_version=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\{0,1\}\([0-9][0-9]*\).*/\1/p')
if [ -z "$kustomize_version" ] || [ "$kustomize_version" -lt 5 ]; then
  die "kubectl's kustomize is not v5 or newer ($(kubectl version --client 2>&1 | tr '\n' ' '))"
fi
python=/usr/bin/python3
[ -x "$python" ] || python=$(command -v python3) || die "python3 not found"
"$python" -c 'import yaml' 2>/dev/null || die "$python has no PyYAML (apt-get install python3-yaml)"
"$python" -c 'import venv, ensurepip' 2>/dev/null ||
  die "$python cannot create a virtual environment with pip (apt-get install python3-venv)"

if [ -n "$build_dir" ]; then
  mkdir -p "$build_dir"
  work=$(mktemp -d "$build_dir/k8s_manifests_test.XXXXXX")
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/k8s_manifests_test.XXXXXX")
fi
trap 'rm -rf "$work"' EXIT

# --- the validators (pinned by tests/k8s/requirements.txt) -----------------------------------
install_validators() {
  local want
  want=$( { cat "$tests/requirements.txt"; "$python" -c 'import sys; print(sys.executable, sys.version)'; } |
    sha256sum | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "installing tests/k8s/requirements.txt into $venv (python3 -m venv, pip)"
  rm -rf "$venv"
  if ! "$python" -m venv "$venv" >"$work/venv.log" 2>&1; then
    sed 's/^/  venv: /' "$work/venv.log" | tail -20
    die "$python -m venv $venv failed (apt-get install python3-venv)"
  fi
  if ! "$venv/bin/python" -m pip install --no-deps --only-binary=:all: --no-input \
      --disable-pip-version-check -r "$tests/requirements.txt" >"$work/pip.log" 2>&1; then
    { grep -v "^WARNING: Location '.*' is ignored" "$work/pip.log" || true; } | sed 's/^/  pip: /' | tail -20
    die "pip install -r tests/k8s/requirements.txt into $venv failed (is PyPI reachable?)"
  fi
  if ! "$venv/bin/python" -m pip check >"$work/pip.log" 2>&1; then
    sed 's/^/  pip check: /' "$work/pip.log"
    die "tests/k8s/requirements.txt does not pin a consistent set of packages"
  fi
  echo "$want" >"$venv/.installed"
}
mkdir -p "$(dirname "$venv")"
command -v flock >/dev/null || die "flock not found (util-linux): the install runs under a lock"
exec 9>"$venv.lock"
flock 9
install_validators
flock -u 9
exec 9>&-

# --- render -----------------------------------------------------------------------------------
: >"$work/problems.txt"
rendered=()   # name=file.yaml of the cases that rendered
render() {
  local name=$1 dir=$2
  if ! kubectl kustomize "$dir" >"$work/$name.yaml" 2>"$work/$name.err"; then
    printf '%s\tkubectl kustomize failed: %s\n' "$name" "$(tr '\n' ' ' <"$work/$name.err")" \
      >>"$work/problems.txt"
    return 0
  fi
  if [ -s "$work/$name.err" ]; then
    printf '%s\tkubectl kustomize printed warnings: %s\n' "$name" "$(tr '\n' ' ' <"$work/$name.err")" \
      >>"$work/problems.txt"
  fi
  rendered+=("$name=$work/$name.yaml")
}

good=(base)
render base "$root/k8s/base"
for dir in "$root"/k8s/overlays/*/; do
  name=$(basename "$dir")
  good+=("$name")
  render "$name" "$dir"
done
broken=()
for dir in "$tests"/broken/*/; do
  name=broken-$(basename "$dir")
  broken+=("$name")
  render "$name" "$dir"
done
# Named, so that an overlay removed (or renamed) fails here instead of going unchecked.
for overlay in single-node multi-node rdma multi-gpu torch; do
  [ -d "$root/k8s/overlays/$overlay" ] || die "expected the overlay k8s/overlays/$overlay"
done
[ ${#broken[@]} -ge 3 ] || die "expected the negative cases in tests/k8s/broken/"

# --- policy (also writes the objects as JSON) and schemas ------------------------------------
if [ ${#rendered[@]} -gt 0 ]; then
  if ! "$python" "$tests/check_manifests.py" --repo "$root" --json-dir "$work" "${rendered[@]}" \
      >>"$work/problems.txt" 2>"$work/policy.err"; then
    cat "$work/policy.err"
    die "tests/k8s/check_manifests.py crashed"
  fi
  json=()
  for r in "${rendered[@]}"; do json+=("${r%%=*}=$work/${r%%=*}.json"); done
  # The tenants example is applied by hand, not rendered: its Secret gets the schemas too.
  if "$python" -c 'import json, sys, yaml
json.dump([o for o in yaml.safe_load_all(open(sys.argv[1])) if o], open(sys.argv[2], "w"))' \
      "$root/k8s/base/tenants-example.yaml" "$work/tenants-example.json" 2>"$work/tenants.err"; then
    json+=("tenants-example=$work/tenants-example.json")
  else
    printf 'tenants-example\tdoes not parse: %s\n' "$(tr '\n' ' ' <"$work/tenants.err")" \
      >>"$work/problems.txt"
  fi
  if ! "$venv/bin/python" "$tests/validate.py" --kubernetes "$k8s_versions" "${json[@]}" \
      >>"$work/problems.txt" 2>"$work/schema.err"; then
    cat "$work/schema.err"
    die "tests/k8s/validate.py crashed"
  fi
fi

problems_of() { awk -F'\t' -v c="$1" '$1 == c { sub(/^[^\t]*\t/, ""); print }' "$work/problems.txt"; }
objects_in() { grep -c '^kind:' "$work/$1.yaml" 2>/dev/null || echo 0; }

for name in "${good[@]}"; do
  problems=$(problems_of "$name")
  if [ -z "$problems" ]; then
    pass "$name: renders without warnings; $(objects_in "$name") objects pass the schemas, the unknown-field check and the policy checks"
  else
    fail "$name:"
    printf '%s\n' "$problems" | sed 's/^/    /'
  fi
done

problems=$(problems_of tenants-example)
if [ -z "$problems" ]; then
  pass "k8s/base/tenants-example.yaml: its Secret passes the schemas and the unknown-field check"
else
  fail "k8s/base/tenants-example.yaml:"
  printf '%s\n' "$problems" | sed 's/^/    /'
fi

for name in "${broken[@]}"; do
  dir="$tests/broken/${name#broken-}"
  expected=$(head -n 1 "$dir/expected")
  problems=$(problems_of "$name")
  if [ -z "$problems" ]; then
    fail "$name: accepted, but must be rejected with: $expected"
  elif printf '%s\n' "$problems" | grep -qF -- "$expected"; then
    pass "$name: rejected: $expected"
    if [ -n "${OFFLOAD_K8S_TEST_VERBOSE:-}" ]; then printf '%s\n' "$problems" | sed 's/^/    /'; fi
  else
    fail "$name: rejected, but not with: $expected"
    printf '%s\n' "$problems" | sed 's/^/    /'
  fi
done

# --- the PrometheusRule is generated from monitoring/prometheus/rules -------------------------
if "$python" "$root/k8s/tools/make-prometheus-rule.py" --check >"$work/rule.diff" 2>&1; then
  pass "k8s/base/prometheus-rule.yaml is up to date with monitoring/prometheus/rules/*.yml"
else
  fail "k8s/base/prometheus-rule.yaml is out of date: run k8s/tools/make-prometheus-rule.py"
  head -40 "$work/rule.diff" | sed 's/^/    /'
fi
# ... and its --check notices a change of the rules.
mkdir -p "$work/rules"
cp "$root"/monitoring/prometheus/rules/*.yml "$work/rules/"
printf 'groups:\n  - name: offload-k8s-test-extra\n    rules:\n      - record: x\n        expr: vector(1)\n' \
  >"$work/rules/zz-offload-k8s-test-extra.yml"
if "$python" "$root/k8s/tools/make-prometheus-rule.py" --rules-dir "$work/rules" --check \
    >/dev/null 2>&1; then
  fail "make-prometheus-rule.py --check accepted a PrometheusRule that lacks a rule group"
else
  pass "make-prometheus-rule.py --check rejects a PrometheusRule that lacks a rule group"
fi

# --- the image ships what the manifests run ---------------------------------------------------
dockerfile="$root/Dockerfile"
if [ ! -f "$dockerfile" ]; then
  fail "no Dockerfile at the repository root"
else
  missing=()
  while read -r bin; do
    grep -q "/${bin##*/}\( \|$\)" "$dockerfile" || missing+=("$bin")
  done < <(cat "$work"/*.yaml | grep -o '/opt/offload/bin/[a-z_]*' | sort -u)
  grep -q '^USER 10001' "$dockerfile" || missing+=("USER 10001")
  grep -q 'data/tinyshakespeare.txt' "$dockerfile" || missing+=("/opt/offload/data/tinyshakespeare.txt")
  if [ ${#missing[@]} -eq 0 ]; then
    pass "the Dockerfile installs every binary the manifests run, the demo corpus, and runs as uid 10001"
  else
    fail "the Dockerfile lacks: ${missing[*]}"
  fi
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
