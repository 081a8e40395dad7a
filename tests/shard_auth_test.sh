#!/usr/bin/env bash
# Who may call an optimizer shard (ARCHITECTURE.md section 7), against real servers, with a foreign
# client (Python grpcio and messages protoc makes here, not our stubs):
#   - pool: a controller, two cpu_optimizer_servers in its pool, two jobs, and the client posing as
#     two trainer workers so that the controller hands it each attempt's secret. Every
#     OptimizerShard RPC is refused without a credential, with a wrong one, with the pool's
#     operator token (DescribeShard aside), with the other attempt's secret, and let in with the
#     attempt's own; DescribeShard shows the attempt only its own job; the secrets appear in no
#     log and no REST answer.
#   - standalone: a server without a token refuses to start unless --allow_unauthenticated; with
#     --token_file every RPC needs the token.
#   - TLS: a standalone server with mutual TLS, and gpu_trainer training through it with the same
#     flags as for the controller; a plaintext client and a client without a certificate fail.
# usage: shard_auth_test.sh CONTROLLER SERVER TRAINER DATA PROTO_DIR
set -euo pipefail
controller_bin=$1 server_bin=$2 trainer_bin=$3 data=$4 proto_dir=$5
work=$(mktemp -d /tmp/offload-shardauth-XXXXXX)
pids=()
source "$(dirname "$0")/process_lib.sh"
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do echo "--- $f" >&2; tail -n 20 "$f" >&2; done
  exit 1
}
step() { echo "== $*"; }

echo "pool-token-$$-$RANDOM" >"$work/token"
pool_token=$(cat "$work/token")
unset OFFLOAD_TOKEN

mkdir -p "$work/py"
protoc --proto_path="$proto_dir" --proto_path=/usr/include --python_out="$work/py" \
  "$proto_dir/offload/v1/job.proto" "$proto_dir/offload/v1/checkpoint.proto" \
  "$proto_dir/offload/v1/optimizer.proto" "$proto_dir/offload/v1/worker.proto"

# The foreign client's RPC calls, shared by the Python programs below.
cat >"$work/py/shard_calls.py" <<'PY'
import grpc
from offload.v1 import optimizer_pb2 as opt

def _md(token):
    return [("authorization", "Bearer " + token)] if token else None

def _code(fn):
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()

def call_every_rpc(address, token, job_id):
    """Each OptimizerShard RPC about job_id with token: {rpc name: status code}."""
    ch = grpc.insecure_channel(address)
    ser = lambda m: m.SerializeToString()
    def unary(method, req, resp):
        return ch.unary_unary("/offload.v1.OptimizerShard/" + method, request_serializer=ser,
                              response_deserializer=resp.FromString)(req, metadata=_md(token),
                                                                     timeout=20)
    create = opt.CreateJobRequest(job_id=job_id, param_dtype=opt.DTYPE_BF16)
    create.ranges.add(offset=0, length=1024)
    create.adam.kind = opt.OPTIMIZER_KIND_ADAMW
    create.adam.lr, create.adam.beta1, create.adam.beta2, create.adam.eps = 1e-3, 0.9, 0.999, 1e-8
    load = opt.LoadStateRequest(job_id=job_id)
    load.chunks.add(tensor=opt.STATE_TENSOR_MASTER_WEIGHTS, dtype=opt.DTYPE_FP32,
                    data=b"\0" * 4096)
    read = opt.ReadStateRequest(job_id=job_id, tensor=opt.STATE_TENSOR_MASTER_WEIGHTS,
                                dtype=opt.DTYPE_FP32)
    read.range.length = 16
    step_open = opt.StepRequest()
    step_open.open.job_id, step_open.open.step = job_id, 1
    attach = opt.AttachRequest()
    attach.open.job_id, attach.open.plane = job_id, opt.DATA_PLANE_SHM
    codes = {}
    codes["CreateJob"] = _code(lambda: unary("CreateJob", create, opt.CreateJobResponse))
    codes["LoadState"] = _code(lambda: ch.stream_unary(
        "/offload.v1.OptimizerShard/LoadState", request_serializer=ser,
        response_deserializer=opt.LoadStateResponse.FromString)(
            iter([load]), metadata=_md(token), timeout=20))
    codes["Step"] = _code(lambda: list(ch.stream_stream(
        "/offload.v1.OptimizerShard/Step", request_serializer=ser,
        response_deserializer=opt.StepResponse.FromString)(
            iter([step_open]), metadata=_md(token), timeout=20)))
    codes["ReadState"] = _code(lambda: list(ch.unary_stream(
        "/offload.v1.OptimizerShard/ReadState", request_serializer=ser,
        response_deserializer=opt.StateChunk.FromString)(read, metadata=_md(token), timeout=20)))
    codes["DescribeShard"] = _code(lambda: unary("DescribeShard", opt.DescribeShardRequest(),
                                                 opt.DescribeShardResponse))
    codes["Attach"] = _code(lambda: list(ch.stream_stream(
        "/offload.v1.OptimizerShard/Attach", request_serializer=ser,
        response_deserializer=opt.AttachResponse.FromString)(
            iter([attach]), metadata=_md(token), timeout=20)))
    codes["DropJob"] = _code(lambda: unary("DropJob", opt.DropJobRequest(job_id=job_id),
                                           opt.DropJobResponse))
    return codes

def describe(address, token):
    ch = grpc.insecure_channel(address)
    return ch.unary_unary("/offload.v1.OptimizerShard/DescribeShard",
                          request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=opt.DescribeShardResponse.FromString)(
        opt.DescribeShardRequest(), metadata=_md(token), timeout=20)

AUTH_ERRORS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

def expect_all(codes, want, what, skip=()):
    for rpc, code in codes.items():
        if rpc in skip:
            continue
        assert code == want, f"{what}: {rpc} ended {code}, expected {want}"

def expect_let_in(codes, what):
    for rpc, code in codes.items():
        assert code not in AUTH_ERRORS, f"{what}: {rpc} was refused ({code})"
PY

# ---------------------------------------------------------------------------------------------
step "pool: a controller, two servers in its pool"
"$controller_bin" --grpc_address=127.0.0.1:0 --http_address=127.0.0.1:0 --store="$work/jobs.db" \
  --token_file="$work/token" --heartbeat_interval=200ms --heartbeat_timeout=20s \
  >"$work/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  line=$(grep -m1 '^job_controller: grpc ' "$work/controller.log" || true)
  [ -n "$line" ] && break
  sleep 0.1
done
[ -n "$line" ] || fail "the controller did not announce its address"
grpc=$(awk '{print $3}' <<<"$line")
http=$(awk '{print $5}' <<<"$line")
for k in 1 2; do
  "$server_bin" --listen=127.0.0.1:0 --controller="$grpc" --token_file="$work/token" \
    --memory_limit_mib=256 --threads=1 >"$work/server$k.log" 2>&1 &
  pids+=($!)
done

step "pool: the client poses as two trainer workers, gets two attempts, and calls their shards"
cat >"$work/pool.py" <<PY
import sys, time, grpc
sys.path.insert(0, "$work/py")
from offload.v1 import job_pb2, worker_pb2
from shard_calls import *
ctl = grpc.insecure_channel("$grpc")
def call(service, method, req, resp):
    return ctl.unary_unary(f"/offload.v1.{service}/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=resp.FromString)(req, metadata=[("authorization",
                                               "Bearer $pool_token")], timeout=10)
jobs = []
for name in ("a", "b"):
    spec = job_pb2.JobSpec(name=name)
    spec.data.path = "$data"
    spec.training.steps, spec.training.batch, spec.training.seq_len = 1000, 8, 64
    spec.eval.every, spec.eval.batches, spec.eval.sample_tokens = 0, 1, 0
    jobs.append(call("JobService", "SubmitJob", job_pb2.SubmitJobRequest(spec=spec),
                     job_pb2.Job).id)
workers = []
for i in range(2):
    info = worker_pb2.WorkerInfo(kind=worker_pb2.WORKER_KIND_TRAINER, name=f"py-{i}",
                                 hostname="127.0.0.1")
    workers.append(call("WorkerService", "RegisterWorker",
                        worker_pb2.RegisterWorkerRequest(worker=info),
                        worker_pb2.RegisterWorkerResponse).worker_id)
got = {}  # worker id -> Assignment
def heartbeat():
    for w in workers:
        running = [worker_pb2.AttemptRef(job_id=a.job_id, attempt=a.attempt)
                   for x, a in got.items() if x == w]
        r = call("WorkerService", "Heartbeat",
                 worker_pb2.HeartbeatRequest(worker_id=w, running=running),
                 worker_pb2.HeartbeatResponse)
        for a in r.start:
            got[w] = a
deadline = time.time() + 60
while len(got) < 2:
    assert time.time() < deadline, "the controller never assigned both attempts"
    heartbeat()
    time.sleep(0.2)
a, b = sorted(got.values(), key=lambda x: x.job_id)
assert a.shard_secret and b.shard_secret and a.shard_secret != b.shard_secret
assert len(a.shard_secret) >= 32, "a secret of fewer than 128 bits"
shard_a, shard_b = a.shard_addresses[0], b.shard_addresses[0]
assert shard_a != shard_b, "both attempts on one server"
with open("$work/secrets", "w") as f:
    f.write(a.shard_secret + "\n" + b.shard_secret + "\n")

expect_all(call_every_rpc(shard_a, "", a.shard_job_id), grpc.StatusCode.UNAUTHENTICATED,
           "no credential")
expect_all(call_every_rpc(shard_a, "wrong", a.shard_job_id), grpc.StatusCode.UNAUTHENTICATED,
           "a wrong credential")
heartbeat()
codes = call_every_rpc(shard_a, "$pool_token", a.shard_job_id)
expect_all(codes, grpc.StatusCode.PERMISSION_DENIED, "the operator token", skip=("DescribeShard",))
assert codes["DescribeShard"] == grpc.StatusCode.OK, codes
# B's secret where B has no attempt: unknown there. On B's own server, about A's job: denied.
expect_all(call_every_rpc(shard_a, b.shard_secret, a.shard_job_id),
           grpc.StatusCode.UNAUTHENTICATED, "another attempt's secret on a server not its own")
expect_all(call_every_rpc(shard_b, b.shard_secret, a.shard_job_id),
           grpc.StatusCode.PERMISSION_DENIED, "another attempt's secret about another job",
           skip=("DescribeShard",))
heartbeat()
assert not describe(shard_a, "$pool_token").jobs, "a refused call left a job behind"
expect_let_in(call_every_rpc(shard_a, a.shard_secret, a.shard_job_id), "the attempt's secret")
# Its own job, and only that, is what DescribeShard shows the attempt.
codes = call_every_rpc(shard_b, b.shard_secret, b.shard_job_id)  # creates, then drops
expect_let_in(codes, "B's secret on B's shard")
heartbeat()
create = opt.CreateJobRequest(job_id=b.shard_job_id, param_dtype=opt.DTYPE_BF16)
create.ranges.add(offset=0, length=1024)
create.adam.kind, create.adam.lr, create.adam.beta1, create.adam.beta2, create.adam.eps = (
    opt.OPTIMIZER_KIND_ADAM, 1e-3, 0.9, 0.999, 1e-8)
grpc.insecure_channel(shard_b).unary_unary("/offload.v1.OptimizerShard/CreateJob",
    request_serializer=lambda m: m.SerializeToString(),
    response_deserializer=opt.CreateJobResponse.FromString)(
        create, metadata=[("authorization", "Bearer " + b.shard_secret)], timeout=10)
assert [j.job_id for j in describe(shard_b, b.shard_secret).jobs] == [b.shard_job_id]
assert [j.job_id for j in describe(shard_b, "$pool_token").jobs] == [b.shard_job_id]
print("pool: every RPC refused without, with a wrong, an operator and another attempt's "
      "credential; let in with its own")
PY
/usr/bin/python3 "$work/pool.py" || fail "the pool checks"

step "pool: the secrets appear in no log and no REST answer"
for id in $(curl -sS -H "Authorization: Bearer $pool_token" "http://$http/v1/jobs" |
  /usr/bin/python3 -c 'import json,sys; print(" ".join(j["id"] for j in json.load(sys.stdin)["jobs"]))'); do
  curl -sS -H "Authorization: Bearer $pool_token" "http://$http/v1/jobs/$id" >>"$work/rest.out"
  curl -sS -H "Authorization: Bearer $pool_token" "http://$http/v1/jobs/$id/events" >>"$work/rest.out"
done
grep -q "attempt 1 started" "$work/rest.out" || fail "the REST answers are not what was expected"
while read -r secret; do
  if grep -l -- "$secret" "$work"/*.log "$work/rest.out"; then fail "a secret leaked"; fi
done <"$work/secrets"

# ---------------------------------------------------------------------------------------------
step "standalone: no token, no start (unless --allow_unauthenticated)"
rc=0
timeout 20 "$server_bin" --listen=127.0.0.1:0 >"$work/notoken.log" 2>&1 || rc=$?
[ "$rc" -eq 2 ] && grep -q "allow_unauthenticated" "$work/notoken.log" ||
  fail "a standalone server without a token: exit $rc"

step "standalone: every RPC needs one of its tokens"
echo "standalone-token-$RANDOM" >"$work/standalone_token"
start_server "$server_bin" "$work/standalone.log" --token_file="$work/standalone_token" \
  --memory_limit_mib=256 --threads=1
cat >"$work/standalone.py" <<PY
import sys, grpc
sys.path.insert(0, "$work/py")
from shard_calls import *
address, token = "127.0.0.1:$port", open("$work/standalone_token").read().strip()
expect_all(call_every_rpc(address, "", "job.1"), grpc.StatusCode.UNAUTHENTICATED, "no token")
expect_all(call_every_rpc(address, "wrong", "job.1"), grpc.StatusCode.UNAUTHENTICATED, "wrong")
expect_let_in(call_every_rpc(address, token, "job.1"), "the token")
print("standalone: refused without the token, let in with it")
PY
/usr/bin/python3 "$work/standalone.py" || fail "the standalone checks"
kill "$server_pid"

# ---------------------------------------------------------------------------------------------
step "TLS: gpu_trainer trains through a shard with mutual TLS"
make_tls_files "$work"
tls_server=(--tls_cert="$work/server.pem" --tls_key="$work/server.key" --tls_ca="$work/ca.pem"
  --tls_client_auth=require)
tls_client=(--tls_ca="$work/ca.pem" --tls_cert="$work/client.pem" --tls_key="$work/client.key"
  --tls_server_name=localhost)
start_server "$server_bin" "$work/tls_server.log" "${tls_server[@]}" --memory_limit_mib=256 \
  --threads=1
train=("$trainer_bin" --data="$data" --layers=1 --heads=2 --channels=32 --context=32 --seq_len=32
  --batch=4 --steps=5 --eval_every=0 --eval_batches=1 --sample_tokens=0 --progress=log
  --shards=127.0.0.1:$port --transport=grpc)
"${train[@]}" "${tls_client[@]}" >"$work/tls_trainer.log" 2>&1 || fail "training over mTLS"
grep -q "step 5/5" "$work/tls_trainer.log" || fail "the mTLS run did not reach step 5"
rc=0
"${train[@]}" --tls_ca="$work/ca.pem" --tls_server_name=localhost --shard_timeout=10s \
  >"$work/tls_nocert.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "a trainer without a client certificate got through"
rc=0
"${train[@]}" --shard_timeout=10s >"$work/tls_plain.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "a plaintext trainer got through"
/usr/bin/python3 - <<PY || fail "a plaintext Python client got through"
import sys, grpc
sys.path.insert(0, "$work/py")
from shard_calls import describe
try:
    describe("127.0.0.1:$port", "$OFFLOAD_SHARD_TOKEN")
    sys.exit(1)
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.code()
PY
echo "shard_auth_test: all cases passed"
