#!/usr/bin/env bash
# Monitoring config checks (no running binaries, no network; a few seconds): the Prometheus
# config, alert rules and their promtool unit tests, the PromQL of every dashboard panel, the
# generated dashboards being up to date, and monitoring/tools/lint.py (dashboard structure and
# every metric name against docs/METRICS.md). Then negative checks: broken copies of the files
# must make the same tools FAIL, so none of the checks above can pass vacuously.
# tests/prometheus_test.sh is the other half: a real Prometheus scraping a local run.
# usage: monitoring_test.sh [REPO_ROOT]   (default: the parent of this script's folder)
# needs: promtool (Debian package prometheus), /usr/bin/python3 with yaml (python3-yaml)
set -euo pipefail
root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
mon=$root/monitoring
py=/usr/bin/python3
tools=$mon/tools
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree

if ! command -v promtool >/dev/null; then
  echo "FAIL: promtool is not on PATH (Debian: apt-get install prometheus)" >&2
  exit 1
fi
if ! "$py" -c 'import yaml' 2>/dev/null; then
  echo "FAIL: $py cannot import yaml (Debian: apt-get install python3-yaml)" >&2
  exit 1
fi

work=$(mktemp -d /tmp/offload-monitoring-XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

# expect_ok DESCRIPTION CMD...: CMD must exit 0.
expect_ok() {
  local what=$1; shift
  if "$@" >"$work/out" 2>&1; then
    echo "PASS: $what"
  else
    echo "FAIL: $what: \`$*\` exited non-zero:"
    sed 's/^/    /' "$work/out"
    failures=$((failures + 1))
  fi
}

# expect_fail DESCRIPTION REGEX CMD...: CMD must exit non-zero and print a line matching REGEX
# (so it failed for the reason planted, not for an unrelated one).
expect_fail() {
  local what=$1 pattern=$2; shift 2
  if "$@" >"$work/out" 2>&1; then
    echo "FAIL: $what: \`$*\` succeeded on a broken input"
    failures=$((failures + 1))
  elif ! grep -Eq -- "$pattern" "$work/out"; then
    echo "FAIL: $what: \`$*\` failed, but without /$pattern/:"
    sed 's/^/    /' "$work/out"
    failures=$((failures + 1))
  else
    echo "PASS: $what (fails as it should: $(grep -Em1 -- "$pattern" "$work/out" | sed 's/^\s*//' | cut -c1-120))"
  fi
}

# plant SED_SCRIPT IN OUT: OUT is IN with SED_SCRIPT applied, which must change something (a
# negative check whose edit no longer matches would test the unbroken file).
plant() {
  sed "$1" "$2" >"$3"
  if cmp -s "$2" "$3"; then
    echo "FAIL: could not plant \`$1\` in ${2#"$root"/} (the file changed? update this test)"
    failures=$((failures + 1))
  fi
}

# parse_dashboards OUT.yml [DASHBOARD...]: writes every dashboard expression (Grafana variables
# replaced by queries.py) as a recording rule offload_check:expr_N, so `promtool check rules`
# parses the PromQL; on an error, names the dashboard and panel of the rule promtool blames.
parse_dashboards() {
  local out=$1; shift
  "$py" "$tools/queries.py" --root "$root" "$@" | "$py" -c '
import json, sys
items = [e for e in map(json.loads, sys.stdin) if e["kind"] == "dashboard"]
if not items:
    sys.exit("no dashboard expressions")
rules = [{"record": "offload_check:expr_%d" % i, "expr": e["expr"]} for i, e in enumerate(items)]
json.dump({"groups": [{"name": "dashboards", "rules": rules}]}, open(sys.argv[1], "w"))
with open(sys.argv[1] + ".sources", "w") as f:  # JSON is YAML; N-th line: source of expr_N
    f.writelines(e["source"] + "\n" for e in items)
' "$out" || return 1
  promtool check rules "$out" >"$out.log" 2>&1 && return 0
  cat "$out.log"
  grep -o 'offload_check:expr_[0-9]*' "$out.log" | sort -u | while read -r rule; do
    echo "  offload_check:expr_${rule##*_} is $(sed -n "$((${rule##*_} + 1))p" "$out.sources")"
  done
  return 1
}

cd "$root"
shopt -s nullglob
rule_files=("$mon"/prometheus/rules/*.yml)
test_files=("$mon"/prometheus/tests/*.test.yml)
dashboards=("$mon"/grafana/dashboards/*.json)
shopt -u nullglob
if ((${#rule_files[@]} == 0 || ${#test_files[@]} == 0 || ${#dashboards[@]} == 0)); then
  echo "FAIL: no rule files, rule tests or dashboards under $mon" >&2
  exit 1
fi

echo "== positive checks"
expect_ok "promtool check config prometheus.yml (and its target files)" \
  promtool check config "$mon/prometheus/prometheus.yml"
for f in "${rule_files[@]}"; do
  expect_ok "promtool check rules ${f#"$root"/}" promtool check rules "$f"
done
for f in "${test_files[@]}"; do
  expect_ok "promtool test rules ${f#"$root"/}" promtool test rules "$f"
done
expect_ok "dashboard PromQL parses (promtool check rules on every panel expression)" \
  parse_dashboards "$work/dashboards.rules.yml"
expect_ok "dashboards are what monitoring/tools/gen_dashboards.py writes" \
  "$py" "$tools/gen_dashboards.py" --check
expect_ok "lint: dashboards, alert metadata and tests, metric names vs docs/METRICS.md" \
  "$py" "$tools/lint.py" --root "$root"
expect_ok "provisioning files are valid YAML" "$py" -c '
import sys, yaml
for f in sys.argv[1:]:
    doc = yaml.safe_load(open(f))
    assert doc.get("apiVersion") == 1 and (doc.get("datasources") or doc.get("providers")), f
' "$mon"/grafana/provisioning/datasources/*.yml "$mon"/grafana/provisioning/dashboards/*.yml
# queries.py's contract with tests/prometheus_test.sh: JSON lines with these keys, both kinds,
# and `up` among the metric names.
expect_ok "queries.py lists dashboard and rule expressions with their metrics" "$py" -c '
import json, subprocess, sys
tool, root = sys.argv[1:]
lines = subprocess.run([sys.executable, tool, "--root", root], check=True, capture_output=True,
                       text=True).stdout.splitlines()
items = [json.loads(l) for l in lines]
assert {i["kind"] for i in items} == {"dashboard", "rule"}, "want both kinds"
for i in items:
    assert set(i) == {"source", "expr", "kind", "selectors"}, i
    assert i["expr"] and i["selectors"], i
    assert "$" not in i["expr"], "Grafana variable left in " + i["source"]
names = subprocess.run([sys.executable, tool, "--root", root, "--metrics"], check=True,
                       capture_output=True, text=True).stdout.split()
assert names == sorted(set(names)) and "up" in names, names
' "$tools/queries.py" "$root"

echo "== negative checks"
neg=$work/neg
mkdir -p "$neg/prometheus/rules" "$neg/prometheus/tests" "$neg/dashboards"
cp -r "$mon/prometheus/targets" "$mon/prometheus/prometheus.yml" "$neg/prometheus/"
alerts=$mon/prometheus/rules/offload-alerts.yml
alert_tests=$mon/prometheus/tests/offload-alerts.test.yml
job_dash=$mon/grafana/dashboards/offload-job.json

# A PromQL syntax error in a rule (an unclosed parenthesis).
plant 's/^\(\s*expr: \)up{job="offload-controller"} == 0$/\1(up{job="offload-controller"} == 0/' \
  "$alerts" "$neg/prometheus/rules/bad-syntax.yml"
expect_fail "promtool check rules on a rule with a PromQL syntax error" "parse error|unclosed" \
  promtool check rules "$neg/prometheus/rules/bad-syntax.yml"

# A YAML error in the Prometheus config itself.
plant 's/^  scrape_interval: 15s/  scrape_interval 15s/' "$mon/prometheus/prometheus.yml" \
  "$neg/prometheus/prometheus.yml"
expect_fail "promtool check config on a broken prometheus.yml" "FAILED|yaml" \
  promtool check config "$neg/prometheus/prometheus.yml"

# A unit test whose expectation is wrong (the firing rank changed) must fail promtool test.
cp "$alerts" "$neg/prometheus/rules/"
plant 's/instance: opt0:9402/instance: opt9:9402/' "$alert_tests" "$neg/prometheus/tests/wrong.test.yml"
expect_fail "promtool test rules with a wrong expected alert" \
  "alertname: Offload(ShardDown|OptimizerMemoryNearLimit), time" \
  promtool test rules "$neg/prometheus/tests/wrong.test.yml"

# An unknown metric in a dashboard panel: the lint names the file, the panel and the metric.
plant 's/offload_trainer_loss{/offload_trainer_lost{/' "$job_dash" "$neg/dashboards/unknown-metric.json"
expect_fail "lint on a dashboard reading an undocumented metric" \
  "unknown-metric\.json: panel 'Loss': metric offload_trainer_lost is not in docs/METRICS\.md" \
  "$py" "$tools/lint.py" --root "$root" "$neg/dashboards/unknown-metric.json"

# An unknown metric in a rule, and a bare histogram name (only _bucket/_sum/_count exist).
plant 's/offload_trainer_steps_total > 0/offload_trainer_step_seconds > 0/' "$alerts" \
  "$neg/prometheus/rules/unknown-metric.yml"
expect_fail "lint on a rule reading a bare histogram name" \
  "unknown-metric\.yml: rule OffloadTrainerStalled: metric offload_trainer_step_seconds is not in" \
  "$py" "$tools/lint.py" --root "$root" --tests "$mon/prometheus/tests" \
  "$neg/prometheus/rules/unknown-metric.yml"

# An alert without unit tests.
{ cat "$alerts"; cat <<'EOF'
      - alert: OffloadUntested
        expr: up{job="offload-trainer"} == 0
        for: 1m
        labels:
          severity: warning
        annotations:
          summary: "s"
          description: "d"
EOF
} >"$neg/prometheus/rules/untested.yml"
expect_fail "lint on an alert without unit tests" "alert OffloadUntested: no unit test" \
  "$py" "$tools/lint.py" --root "$root" --tests "$mon/prometheus/tests" \
  "$neg/prometheus/rules/untested.yml"

# Dashboard structure: a panel off the ${datasource} variable, a duplicate id, a missing unit.
"$py" - "$job_dash" "$neg/dashboards/bad-structure.json" <<'EOF'
import json, sys
dash = json.load(open(sys.argv[1]))
panels = [p for p in dash["panels"] if p["type"] == "timeseries"]
panels[0]["datasource"] = {"type": "prometheus", "uid": "some-fixed-uid"}
panels[1]["id"] = panels[2]["id"]
del panels[3]["fieldConfig"]["defaults"]["unit"]
json.dump(dash, open(sys.argv[2], "w"))
EOF
expect_fail "lint on a dashboard with a fixed datasource" "not \\$\\{datasource\\}" \
  "$py" "$tools/lint.py" --root "$root" "$neg/dashboards/bad-structure.json"
expect_fail "lint on a dashboard with a duplicate panel id" "duplicate panel id" \
  "$py" "$tools/lint.py" --root "$root" "$neg/dashboards/bad-structure.json"
expect_fail "lint on a dashboard panel without a unit" "no unit" \
  "$py" "$tools/lint.py" --root "$root" "$neg/dashboards/bad-structure.json"
printf '{"uid": "x", ' >"$neg/dashboards/not-json.json"
expect_fail "lint on a dashboard that is not JSON" "not-json\.json: file: not valid JSON" \
  "$py" "$tools/lint.py" --root "$root" "$neg/dashboards/not-json.json"

# A PromQL syntax error in a panel.
plant 's/sum by (instance) (rate(offload_trainer_tokens_total/sum by (instance) (rate(offload_trainer_tokens_total)/' \
  "$job_dash" "$neg/dashboards/bad-promql.json"
expect_fail "promtool on a dashboard panel with a PromQL syntax error" \
  "expr_[0-9]+ is .*bad-promql\.json:Tokens/s per rank" \
  parse_dashboards "$neg/dashboards/rules.yml" "$neg/dashboards/bad-promql.json"

# A hand edit to a generated dashboard.
mkdir "$neg/generated"
cp "${dashboards[@]}" "$neg/generated/"
plant 's/"title": "Loss"/"title": "Loss (edited)"/' "$job_dash" "$neg/generated/offload-job.json"
expect_fail "gen_dashboards.py --check on a hand-edited dashboard" "offload-job\.json is not what" \
  "$py" "$tools/gen_dashboards.py" --check --out "$neg/generated"

echo
if ((failures)); then
  echo "monitoring_test: $failures check(s) FAILED"
  exit 1
fi
echo "monitoring_test: all checks passed"
