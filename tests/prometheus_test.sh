#!/usr/bin/env bash
# A real Prometheus (Debian's) scraping a local run: offload_local with its controller, one
# optimizer server and one trainer, every process serving /metrics, plus a recorded DCGM exporter
# page (CI has no GPU). Checks that every /metrics page passes `promtool check metrics`, every
# target is up, every dashboard expression of monitoring/ returns data, every metric a rule names
# has data, every rule evaluates, no alert fires in a healthy run, and that killing the optimizer
# server makes OffloadShardDown go pending.
#
# Usage: prometheus_test.sh OFFLOAD_LOCAL REPO_ROOT
set -euo pipefail
launcher=$1
root=$2
py=/usr/bin/python3

fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in prometheus promtool curl; do
  command -v "$tool" >/dev/null || fail "$tool is not installed (scripts/bootstrap installs it)"
done

work=$(mktemp -d /tmp/offload-prometheus-test-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The shipped config, with 1 s intervals so rate() has samples within seconds, and its relative
# targets/ and rules/ next to it.
mkdir -p "$work/targets" "$work/dcgm"
ln -s "$root/monitoring/prometheus/rules" "$work/rules"
sed -e 's/^  scrape_interval: 15s$/  scrape_interval: 1s/' \
    -e 's/^  evaluation_interval: 15s$/  evaluation_interval: 1s/' \
    -e 's/^  scrape_timeout: 10s$/  scrape_timeout: 1s/' \
    "$root/monitoring/prometheus/prometheus.yml" > "$work/prometheus.yml"
grep -q '^  scrape_interval: 1s$' "$work/prometheus.yml" || fail "could not shorten scrape_interval"
promtool check config "$work/prometheus.yml" > /dev/null || fail "promtool check config"

# The DCGM exporter stand-in: its page at /metrics.
cp "$root/tests/prometheus/dcgm-exporter.prom" "$work/dcgm/metrics"
dcgm_port=$(free_port)
"$py" -m http.server --bind 127.0.0.1 --directory "$work/dcgm" "$dcgm_port" > /dev/null 2>&1 &
pids+=($!)
echo "[{\"targets\": [\"127.0.0.1:$dcgm_port\"], \"labels\": {}}]" > "$work/targets/dcgm-exporter.json"

# The job: long enough to outlast the checks; it is killed at the end. Its optimizer state is on
# the server's disk tier, so the disk panels have data too.
"$launcher" --metrics_targets_dir="$work/targets" \
  --server_args="--state_dir=$work/state --state_tier=disk" -- \
  --data="$root/data/tinyshakespeare.txt" \
  --steps=100000 --progress=log --log_every=100 --eval_every=0 --sample_tokens=0 \
  > "$work/job.log" 2>&1 &
launcher_pid=$!
pids+=($launcher_pid)

prom_port=$(free_port)
prom="http://127.0.0.1:$prom_port"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn > "$work/prometheus.log" 2>&1 &
pids+=($!)

query() {  # prints the number of series an instant query returns
  curl -sfG "$prom/api/v1/query" --data-urlencode "query=$1" |
    "$py" -c 'import json, sys; print(len(json.load(sys.stdin)["data"]["result"]))'
}

for _ in $(seq 60); do curl -sf "$prom/-/ready" > /dev/null 2>&1 && break; sleep 1; done
curl -sf "$prom/-/ready" > /dev/null || { cat "$work/prometheus.log"; fail "prometheus not ready"; }
echo "PASS prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}') ready on $prom"

# Enough history for the 1m windows: 20 scrapes of a trainer that is stepping.
ready=0
for _ in $(seq 180); do
  if [[ -f "$work/targets/offload-trainer.json" ]] &&
     [[ "$(query 'count_over_time(offload_trainer_steps_total[1m]) >= 20 and rate(offload_trainer_steps_total[30s]) > 0' 2>/dev/null || echo 0)" -ge 1 ]]; then
    ready=1
    break
  fi
  kill -0 "$launcher_pid" 2>/dev/null || { cat "$work/job.log"; fail "the job ended early"; }
  sleep 1
done
[[ $ready -eq 1 ]] || { tail -20 "$work/job.log"; fail "no trainer samples after 180 s"; }
echo "PASS the trainer has 20 s of samples"

# Every page of ours passes promtool's lint. dcgm-exporter's is NVIDIA's, with camelCase labels
# (modelName, UUID) that the lint rejects; Prometheus scraping it (below) is its check.
targets=$("$py" -c '
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for group in json.load(open(f)):
        for t in group["targets"]:
            print(f.rsplit("/", 1)[1][:-5], t)' "$work/targets")
while read -r job target; do
  [[ "$job" == dcgm-exporter ]] && continue
  page=$(curl -sf "http://$target/metrics") || fail "$job: no /metrics at $target"
  lint=$(printf '%s\n' "$page" | promtool check metrics 2>&1) || fail "$job: promtool check metrics: $lint"
  echo "PASS promtool check metrics: $job ($target, $(printf '%s\n' "$page" | grep -vc '^#') samples)"
done <<< "$targets"

# The optimizer server answers grpc.health.v1 (what Kubernetes' gRPC probes call), no token.
shard_port=$(sed -n 's/.*cpu_optimizer_server listening port=\([0-9]*\).*/\1/p' "$work/job.log" | head -1)
[[ -n "$shard_port" ]] || fail "no optimizer server port in the job's output"
"$py" - "127.0.0.1:$shard_port" <<'PY' || fail "optimizer server health check"
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                            response_deserializer=lambda b: b)
reply = check(b"", timeout=10)
assert reply == b"\x08\x01", reply  # status: SERVING
print("PASS optimizer server grpc.health.v1: SERVING")
PY

# Every target up, as Prometheus sees it.
"$py" - "$prom" <<'PY' || fail "targets"
import json, sys, urllib.request
body = json.load(urllib.request.urlopen(sys.argv[1] + "/api/v1/targets"))
active = body["data"]["activeTargets"]
jobs = sorted({t["labels"]["job"] for t in active})
expected = ["dcgm-exporter", "offload-controller", "offload-optimizer-server", "offload-trainer",
            "offload-trainer-worker"]
bad = [f'{t["labels"]["job"]} {t["scrapeUrl"]}: {t["lastError"]}' for t in active
       if t["health"] != "up"]
if jobs != expected or bad:
    print(f"jobs {jobs}, unhealthy {bad}")
    sys.exit(1)
print(f"PASS {len(active)} targets up: {', '.join(jobs)}")
PY

# Every dashboard expression returns data; every rule evaluates and its metrics exist.
"$py" "$root/monitoring/tools/queries.py" > "$work/queries.jsonl"
"$py" "$root/tests/prometheus/check_queries.py" "$prom" < "$work/queries.jsonl" > "$work/queries.log" ||
  { grep -v '^ok' "$work/queries.log"; fail "dashboard or rule expressions without data"; }
echo "PASS $(tail -1 "$work/queries.log")"
# The check itself catches a dashboard query of a metric no binary serves.
echo '{"source": "planted", "expr": "rate(offload_trainer_no_such_total[1m])", "kind": "dashboard", "selectors": ["offload_trainer_no_such_total"]}' |
  "$py" "$root/tests/prometheus/check_queries.py" "$prom" > /dev/null &&
  fail "a query of a metric that does not exist passed"
echo "PASS a query of a missing metric is caught"

# The rules are loaded and healthy, and none fires while everything runs.
"$py" - "$prom" <<'PY' || fail "rules"
import json, sys, urllib.request
base = sys.argv[1]
groups = json.load(urllib.request.urlopen(base + "/api/v1/rules"))["data"]["groups"]
rules = [r for g in groups for r in g["rules"]]
bad = [f'{r["name"]}: {r.get("lastError")}' for r in rules if r["health"] != "ok"]
if len(rules) < 8 or bad:
    print(f"{len(rules)} rules, unhealthy: {bad}")
    sys.exit(1)
alerts = json.load(urllib.request.urlopen(base + "/api/v1/alerts"))["data"]["alerts"]
firing = [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]
if firing:
    print(f"alerts firing in a healthy run: {firing}")
    sys.exit(1)
print(f"PASS {len(rules)} rules healthy, none firing")
PY

# A torch job (a PyTorch script on the pool, issue 43): its rank's training metrics, relayed from
# the script's reports, come from its pool worker's endpoint under the same names, so the
# dashboards' trainer panels show it. A second local pool runs it; its worker's target joins the
# scrape job offload-trainer-worker for the check.
build_dir=$(cd "$(dirname "$launcher")/.." && pwd)
if "$py" -c 'import torch' 2>/dev/null; then
  printf '{"name": "prom-torch", "torch": {"command": ["%s", "%s", "--steps=3000", "--step_seconds=0.02"]}}\n' \
    "$py" "$root/examples/torch_job.py" > "$work/torch-job.json"
  mkdir -p "$work/targets-torch"
  PYTHONPATH="$root/python" OFFLOAD_BUILD_DIR="$build_dir" OMP_NUM_THREADS=1 \
    "$launcher" --job="$work/torch-job.json" --metrics_targets_dir="$work/targets-torch" \
    > "$work/torch.log" 2>&1 &
  torch_pid=$!
  pids+=($torch_pid)
  for _ in $(seq 100); do [[ -s "$work/targets-torch/offload-trainer-worker.json" ]] && break; sleep 0.2; done
  cp "$work/targets/offload-trainer-worker.json" "$work/workers-demo.json"
  "$py" - "$work/workers-demo.json" "$work/targets-torch/offload-trainer-worker.json" \
    "$work/targets/offload-trainer-worker.json" <<'PY' || fail "merging the torch worker's target"
import json, os, sys
groups = json.load(open(sys.argv[1])) + json.load(open(sys.argv[2]))
with open(sys.argv[3] + ".tmp", "w") as f:
    json.dump(groups, f)
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
PY
  seen=0
  for _ in $(seq 90); do
    if [[ "$(query 'offload_trainer_info{job="offload-trainer-worker", model="torch"}' 2>/dev/null || echo 0)" -ge 1 ]] &&
       [[ "$(query 'rate(offload_trainer_steps_total{job="offload-trainer-worker"}[5s]) > 0 and offload_trainer_loss{job="offload-trainer-worker"} > 0' 2>/dev/null || echo 0)" -ge 1 ]]; then
      seen=1
      break
    fi
    kill -0 "$torch_pid" 2>/dev/null || { tail -20 "$work/torch.log"; fail "the torch job ended early"; }
    sleep 1
  done
  [[ $seen -eq 1 ]] || { tail -20 "$work/torch.log"; fail "no torch job metrics in Prometheus"; }
  echo "PASS a torch job's steps, loss and info scraped from its pool worker"
  kill -9 "$torch_pid" 2>/dev/null || true
  cp "$work/workers-demo.json" "$work/targets/offload-trainer-worker.json.tmp"
  mv "$work/targets/offload-trainer-worker.json.tmp" "$work/targets/offload-trainer-worker.json"
else
  fail "$py has no torch (scripts/bootstrap installs python3-torch): the torch job's metrics"
fi

# A shard dies: Prometheus sees it down and OffloadShardDown goes pending.
server_target=$(awk '$1 == "offload-optimizer-server" {print $2}' <<< "$targets")
server_pid=$(pgrep -f -- "--metrics_address=$server_target" | head -1)
[[ -n "$server_pid" ]] || fail "no optimizer server process for $server_target"
kill -9 "$server_pid"
seen=0
for _ in $(seq 30); do
  state=$(curl -sf "$prom/api/v1/alerts" | "$py" -c '
import json, sys
alerts = json.load(sys.stdin)["data"]["alerts"]
print(" ".join(a["state"] for a in alerts if a["labels"]["alertname"] == "OffloadShardDown"))')
  if [[ "$state" == *pending* || "$state" == *firing* ]]; then seen=1; break; fi
  sleep 1
done
[[ $seen -eq 1 ]] || fail "OffloadShardDown did not go pending after the server was killed"
echo "PASS optimizer server killed: up == 0 and OffloadShardDown $state"
echo "prometheus_test: all checks passed"
