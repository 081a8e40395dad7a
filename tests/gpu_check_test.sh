#!/usr/bin/env bash
# scripts/gpu-check runs for the first time on a lent GPU, with minutes to spare: this runs it here
# against a fake bundle (a fake nvidia-smi, GPU test binaries that print gtest's lines, a bench_gpu
# that prints the machine-readable lines) and checks what it decides: each path of the CUDA
# backend is its own run, so one crashing path hides nothing; a path with no tests, a skipped
# test, or the reference attention on a GPU is a failure; the summary reads each model's rows;
# the largest models train in a run of their own, whose failure or hang fails only that line.
#
#   bash tests/gpu_check_test.sh REPO_ROOT
set -euo pipefail
repo=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "gpu_check_test: FAIL: $*"; exit 1; }

mkdir -p "$work/fakebin" "$work/bundle/bin" "$work/bundle/lib"
cat > "$work/fakebin/nvidia-smi" <<'SMI'
#!/usr/bin/env bash
case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)" ;;
  *) echo "NVIDIA H100 80GB HBM3, 580.00, 81559 MiB" ;;
esac
SMI
# python3 without torch: the front end's check reports itself failed, as on a machine without it.
# With FAKE_TORCH=1 it has torch with CUDA: torch_gpt.py prints its line for the arguments given,
# a test class prints unittest's verdict (FAKE_SKIP=NAME: NAME's class skipped), and the memory
# bench its summary line.
cat > "$work/fakebin/python3" <<'PY'
#!/usr/bin/env bash
[ -n "${FAKE_TORCH:-}" ] || exit 1
case "$1" in
  -c) exit 0 ;;
  -m) [ "$2" = pip ] || exit 1 ;;  # pip install --target SITE WHEEL: the wheel installed there
  */tests/wheel_train.py)  # the wheel alone: SITE on the path, none of the build tree's variables
    [ "${PYTHONPATH:-}" = "$2" ] && [ "$PWD" = "$2" ] && [ -z "${OFFLOAD_BUILD_DIR:-}" ] &&
      [ -z "${LD_LIBRARY_PATH:-}" ] && [ "$5" = cuda ] ||
      { echo "wheel_train.py run with the build tree's environment or not on cuda"; exit 1; }
    echo "trained: loss 1.000 -> 0.100 on shm cuda" ;;
  examples/torch_gpt.py)
    opt=offload model=gpt mb=1 dpu=0 uib=0 z=2 extra=
    for a in "$@"; do
      case "$a" in
        --optimizer=*) opt=${a#--optimizer=} ;;
        --hf) model=hf ;;
        --micro_batches=*) mb=${a#--micro_batches=} ;;
        --delay_update) dpu=1 ;;
        --update_in_backward) uib=1 ;;
        --zero_stage=3) z=3 extra="window=2 param_bytes_peak=40000000 param_bytes_all=248000000 " ;;
      esac
    done
    echo "torch_gpt optimizer=$opt model=$model device=cuda params=124000000 batch=8x1024" \
      "micro_batches=$mb dpu=$dpu uib=$uib zero_stage=$z dtype=bf16" \
      "${extra}step_s=0.$z$mb$dpu$uib val_loss=$([ "$model" = hf ] && echo 2.7 || echo 2.5)" ;;
  python/tests/*)
    [[ $1 == *"${FAKE_SKIP:-none}"* ]] && { echo "OK (skipped=1)"; exit 0; }
    echo "OK" ;;
  scripts/bench_torch_memory.py) echo "torch_memory targets_pass=9 targets_over=0" ;;
  *) exit 1 ;;
esac
PY
chmod +x "$work/fakebin/nvidia-smi" "$work/fakebin/python3"
echo 'export FAKE_BUNDLE=1 LD_LIBRARY_PATH=/fake/bundle/lib' > "$work/bundle/env"
mkdir -p "$work/bundle/wheel"
wheel=$work/bundle/wheel/offload-0.1.0-py3-none-manylinux_2_36_x86_64.whl
touch "$wheel"

# A GPU test binary: one test per path, named as the real ones are; a path given in CRASH aborts
# its run (as a segfault in code meeting a GPU for the first time would).
make_test_binary() {
  cat > "$work/bundle/bin/$1" <<'BIN'
#!/usr/bin/env bash
filter=${1#--gtest_filter=}
name=$(basename "$0")
tests=("Gpt2CudaCudnnParity.bf16" "EpilogueTest.GeluAux" "VectorAccess.Layernorm"
       "Gpt2CudaPipeline.Upload" "TrainerCudaDpu.Tracks" "Gpt2CudaGradientBuckets.Flat"
       "TrainerCudaParamWindow.Stage2Bits" "Gpt2CudaNccl.OneRank" "Gpt2CudaParity.fp16")
match() {  # a gtest filter of one positive or one negative list of *X* patterns
  local t=$1 f=$2 neg=0 p
  [ "${f:0:1}" = - ] && { neg=1; f=${f:1}; }
  IFS=: read -ra pats <<< "$f"
  for p in "${pats[@]}"; do
    # shellcheck disable=SC2053
    [[ $t == $p ]] && return $neg
  done
  return $((1 - neg))
}
n=0
for t in "${tests[@]}"; do
  match "$t" "$filter" || continue
  if [ -n "${CRASH:-}" ] && [[ $t == *$CRASH* ]]; then echo "[ RUN      ] $t"; exit 139; fi
  if [ -n "${HANG:-}" ] && [[ $t == *$HANG* ]]; then echo "[ RUN      ] $t"; exec sleep 60; fi
  echo "[       OK ] $t (1 ms)"
  n=$((n + 1))
done
echo "[  PASSED  ] $n tests."
BIN
  chmod +x "$work/bundle/bin/$1"
}
make_test_binary cuda_kernels_test
make_test_binary gpt2_cuda_test
cat > "$work/bundle/bin/bench_gpu" <<'BENCH'
#!/usr/bin/env bash
# As the real one: the lines of the model --model names (gpu-check runs one process per model),
# or with --largest_only only the largest models' (FAKE_LARGEST=oom: the offload side ran out of
# memory at every try; hang: it never ends).
attention=${FAKE_ATTENTION:-cudnn}
model=
for a in "$@"; do
  case "$a" in
    --model=*) model=${a#--model=} ;;
    --largest_only)
      echo "gpu device=0 name=NVIDIA_H100_80GB_HBM3 sm=90 sms=132 memory_gib=79.2 peak_tflops=989.4 peak=datasheet_H100_SXM"
      case "${FAKE_LARGEST:-}" in
        hang) exec sleep 60 ;;
        oom)
          echo "gpu largest side=offload error=cannot_allocate planned_model=L259_C1600_H12_V50257_T1024"
          echo "gpu largest side=gpu_only params=5254103040 layers=6 channels=8192 heads=64 step_s=0.90000 tflops=36.10 peak_device_gib=75.10 planned_device_gib=76.20 binds=gpu planned_layers=6 tries=1 batch=1 seq_len=1024 dtype=bf16 device_free_gib=78.6 host_gib=96.0"
          exit 1 ;;
      esac
      echo "gpu largest side=offload params=6413788800 layers=206 channels=1600 heads=12 step_s=3.20000 tflops=12.30 peak_device_gib=30.10 planned_device_gib=31.00 binds=host planned_layers=206 tries=1 batch=1 seq_len=1024 dtype=bf16 device_free_gib=78.6 host_gib=96.0"
      echo "gpu largest side=gpu_only params=5254103040 layers=6 channels=8192 heads=64 step_s=0.90000 tflops=36.10 peak_device_gib=75.10 planned_device_gib=76.20 binds=gpu planned_layers=6 tries=1 batch=1 seq_len=1024 dtype=bf16 device_free_gib=78.6 host_gib=96.0"
      echo "gpu largest ratio=1.221"
      exit 0 ;;
  esac
done
[ -n "$model" ] || { echo "fake bench_gpu: no --model" >&2; exit 2; }
cat <<LINES | grep -E "model=$model |^gpu (device|transfer)"
gpu device=0 name=NVIDIA_H100_80GB_HBM3 sm=90 sms=132 memory_gib=79.2 peak_tflops=989.4 peak=datasheet_H100_SXM
gpu model=gpt2-124m dtype=bf16 tokens_per_s=400000 mfu=0.4600 step_s=0.02000 batch=8 seq_len=1024 params=124439808 skipped=0 attention=$attention flops_per_token=1e9 peak_tflops=989.4
gpu offload=inprocess_dpu params=124439808 step_s=0.02200 vs_gpu=1.100 model=gpt2-124m dtype=bf16 batch=8 seq_len=1024 shards=0 d2h_exposed_s=0.00010 h2d_in_forward=0.800
gpu offload=server_shm_dpu params=124439808 step_s=0.02300 vs_gpu=1.150 model=gpt2-124m dtype=bf16 batch=8 seq_len=1024 shards=1 d2h_exposed_s=0.00020 h2d_in_forward=0.810
gpu pipeline model=gpt2-124m bytes=248879616 h2d_gbps=50.00 d2h_gbps=49.00 ring_h2d_gbps=20.00 ring_d2h_gbps=10.00 h2d_vs_bound=0.904 d2h_vs_bound=0.886 registered=yes
gpu model=gpt2-xl dtype=bf16 tokens_per_s=40000 mfu=0.4000 step_s=0.20000 batch=8 seq_len=1024 params=1557611200 skipped=0 attention=cudnn flops_per_token=1e10 peak_tflops=989.4
gpu offload=inprocess_dpu params=1557611200 step_s=0.60000 vs_gpu=3.000 model=gpt2-xl dtype=bf16 batch=8 seq_len=1024 shards=0 d2h_exposed_s=0.00300 h2d_in_forward=0.600
gpu transfer bytes=268435456 h2d_gbps=55.30 d2h_gbps=55.28 step_bytes_each_way=248879616 step_h2d_floor_s=0.00450 step_d2h_floor_s=0.00450
LINES
BENCH
chmod +x "$work/bundle/bin/bench_gpu"

run() {  # run LOGDIR [ENV=VALUE...]: gpu-check's output; its exit status in $work/rc
  local logs=$1
  shift
  local rc=0
  env PATH="$work/fakebin:$PATH" GPU_CHECK_LOGS="$logs" "$@" \
    bash "$repo/scripts/gpu-check" --bundle="$work/bundle" > "$logs.out" 2>&1 || rc=$?
  echo "$rc" > "$work/rc"
  cat "$logs.out"
}

# Every path passes; only the front end (no torch here) fails the check.
out=$(run "$work/logs1")
for p in cudnn_attention epilogues vector_loads pipeline dpu gradient_buckets param_window nccl_path other; do
  grep -q "^gpu-check: tests $p: 2 passed, 0 skipped, 0 failed: ok$" <<< "$out" ||
    fail "path $p not reported as 2 passed: $out"
done
grep -q "torch front end: python3 has no torch with CUDA" <<< "$out" || fail "front end: $out"
[ "$(cat "$work/rc")" = 1 ] || fail "no torch must fail the check"
grep -qE '^ +MFU \(target >= 45% for gpt2\) +46\.0%$' <<< "$out" || fail "gpt2 MFU row: $out"
grep -qE '^ +  / GPU-resident \(<= 1\.20\) +1\.150$' <<< "$out" || fail "gpt2 shm DPU ratio: $out"
grep -qE '^ +  / GPU-resident \(<= 1\.15\) +3\.000$' <<< "$out" || fail "xl in-process DPU: $out"
grep -qE '^ +transfers / pinned bound \(>= 0\.8\) +H2D 0\.904, D2H 0\.886$' <<< "$out" ||
  fail "transfer ratio row: $out"
grep -qE '^ +  D2H s after bwd, H2D in fwd +0\.00020 / 0\.810$' <<< "$out" || fail "overlap row: $out"
[ "$(grep -c '^gpu device=' "$work/logs1/bench_gpu.log")" = 2 ] || fail "one bench process per model"
grep -q '^gpu-check: largest: ok$' <<< "$out" || fail "largest run: $out"
grep -qE '^ +largest trained, offload +6413788800 \(L206 C1600\), 3\.20000 s, 12\.30 TFLOP/s, '`
  `'device 30\.10 of 31\.00 GiB planned, binds host$' <<< "$out" || fail "largest offload row: $out"
grep -qE '^ +largest trained, GPU only +5254103040 \(L6 C8192\), ' <<< "$out" ||
  fail "largest GPU-only row: $out"
grep -qE '^ +  size ratio trained \(target >= 8\) +1\.221$' <<< "$out" ||
  fail "largest ratio row: $out"
[ -s "$work/logs1/bench_gpu_largest.log" ] || fail "no log of the largest run"
[ -d "$work/logs1/traces" ] || fail "no trace directory for the bench"

# A crash in the cuDNN path: that path fails, every other path still runs and passes.
out=$(run "$work/logs2" CRASH=Cudnn)
grep -q "^gpu-check: tests cudnn_attention: 0 passed, 0 skipped, 0 failed: FAILED$" <<< "$out" ||
  fail "a crashing path must fail: $out"
for p in epilogues vector_loads pipeline dpu gradient_buckets param_window nccl_path other; do
  grep -q "^gpu-check: tests $p: 2 passed, 0 skipped, 0 failed: ok$" <<< "$out" ||
    fail "path $p hidden by the crash: $out"
done
grep -q "exit 139" <<< "$out" || fail "the crash's exit status is not reported: $out"

# A hang in the pipeline path costs that run its time limit, and nothing else; so does one in the
# largest run.
out=$(run "$work/logs4" HANG=Pipeline GPU_CHECK_TEST_TIMEOUT=2 FAKE_LARGEST=hang \
  GPU_CHECK_LARGEST_TIMEOUT=2)
grep -q "^gpu-check: tests pipeline: 0 passed, 0 skipped, 0 failed: FAILED$" <<< "$out" ||
  fail "a hanging path must fail: $out"
grep -q "^gpu-check: tests dpu: 2 passed, 0 skipped, 0 failed: ok$" <<< "$out" ||
  fail "the paths after the hang must still run: $out"
grep -q "timed out after 2s" "$work/logs4/gpt2_cuda_test_pipeline.log" || fail "timeout not logged"
grep -q '^gpu-check: largest: exit 124: timed out: FAILED' <<< "$out" ||
  fail "a hanging largest run: $out"
grep -qE '^ +MFU \(target >= 45% for gpt2\) +46\.0%$' <<< "$out" ||
  fail "rows after the hang: $out"

# The reference attention on a GPU is a failure, named; a largest run out of memory at every try
# fails that line only, and its error is in the summary.
out=$(run "$work/logs3" FAKE_ATTENTION=reference FAKE_LARGEST=oom)
grep -q "gpt2-124m ran attention=reference, not cudnn" <<< "$out" || fail "reference: $out"
grep -q '^gpu-check: largest: exit 1: FAILED' <<< "$out" || fail "a failed largest run: $out"
grep -qE '^ +largest trained, offload +error: cannot_allocate$' <<< "$out" ||
  fail "largest error: $out"
grep -qE '^ +largest trained, GPU only +5254103040 ' <<< "$out" || fail "the other side: $out"
grep -qE '^ +  size ratio trained \(target >= 8\) +n/a$' <<< "$out" || fail "no ratio: $out"
grep -q "^gpu-check: tests other: 2 passed, 0 skipped, 0 failed: ok$" <<< "$out" ||
  fail "the tests must stand: $out"

# Only some parts: the others do not run, and their rows read n/a; the front end's rows come from
# its own lines (the HF model's, the test classes'), and a skipped test class is a failure.
out=$(run "$work/logs5" GPU_CHECK_PARTS="tests torch" FAKE_TORCH=1)
grep -q "^gpu-check: parts: tests torch $" <<< "$out" || fail "parts not named: $out"
! grep -q "^gpu-check: bench_gpu" <<< "$out" || fail "the bench ran unasked: $out"
[ ! -e "$work/logs5/bench_gpu_largest.log" ] || fail "the largest run ran unasked"
grep -q "^gpu-check: tests other: 2 passed, 0 skipped, 0 failed: ok$" <<< "$out" ||
  fail "the tests part: $out"
grep -qE '^ +MFU \(target >= 45% for gpt2\) +n/a$' <<< "$out" && fail "a model row without a bench"
grep -qE '^ +torch front end step s +0\.2100$' <<< "$out" || fail "stage 2 row: $out"
grep -qE '^ +  ZeRO-3 step s, param bytes peak/all +0\.3100, 40000000/248000000$' <<< "$out" ||
  fail "ZeRO-3 row: $out"
grep -qE '^ +  torch fused AdamW step s +0\.2100$' <<< "$out" || fail "torch row: $out"
grep -qE '^ +HF GPT2 step s, offload / torch +0\.2100 / 0\.2100$' <<< "$out" ||
  fail "HF row: $out"
grep -qE '^ +CUDA test classes z3/models/grads +pass / pass / pass$' <<< "$out" ||
  fail "test classes row: $out"
grep -qE '^ +  HF Trainer / accelerate on CUDA +pass / pass$' <<< "$out" ||
  fail "HF test classes row: $out"
grep -qE '^ +  the wheel, installed alone +pass$' <<< "$out" || fail "wheel row: $out"
grep -q '^trained: loss .* on shm cuda$' "$work/logs5/torch_wheel.log" || fail "wheel log"
grep -q "^gpu-check: ok$" <<< "$out" || fail "all selected parts passed: $out"
[ "$(cat "$work/rc")" = 0 ] || fail "exit status of a passing check"
out=$(run "$work/logs6" GPU_CHECK_PARTS="torch" FAKE_TORCH=1 FAKE_SKIP=torch_models)
grep -qE '^ +CUDA test classes z3/models/grads +pass / fail / pass$' <<< "$out" ||
  fail "a skipped class: $out"
[ "$(cat "$work/rc")" = 1 ] || fail "a skipped class must fail the check"
out=$(run "$work/logs8" GPU_CHECK_PARTS="torch" FAKE_TORCH=1 FAKE_SKIP=hf_accelerate)
grep -qE '^ +  HF Trainer / accelerate on CUDA +pass / fail$' <<< "$out" ||
  fail "a skipped HF class: $out"
grep -q "gpu-check: hf_accelerate on CUDA: exit 1 (log: .*/hf_accelerate_cuda.log)" <<< "$out" ||
  fail "the skipped HF class is not named: $out"
[ "$(cat "$work/rc")" = 1 ] || fail "a skipped HF class must fail the check"
mv "$wheel" "$work/away.whl"
out=$(run "$work/logs9" GPU_CHECK_PARTS="torch" FAKE_TORCH=1)
mv "$work/away.whl" "$wheel"
grep -qE '^ +  the wheel, installed alone +fail$' <<< "$out" || fail "no wheel, no pass: $out"
grep -q "gpu-check: no wheel (scripts/gpu-bundle puts one" <<< "$out" || fail "no wheel named: $out"
[ "$(cat "$work/rc")" = 1 ] || fail "a bundle without its wheel must fail the check"
out=$(run "$work/logs7" GPU_CHECK_PARTS="tests benches")
grep -q "unknown part 'benches'" <<< "$out" || fail "a wrong part: $out"
[ "$(cat "$work/rc")" = 2 ] || fail "a wrong part exits 2"

echo "gpu_check_test: ok"
