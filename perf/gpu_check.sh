#!/usr/bin/env bash
# The GPU checks in one run: native kernel tests, the model tests on CUDA, the step path (graph
# replays and host waits per step, plain and speculating, overlapped or not), tensor parallelism on
# one GPU (NCCL world of one in CUDA graphs, two ranks on the GPU), decode-attention and
# small-batch linear bandwidth, end to end vs HF at the 1B and 8B shapes, speculation with a draft
# of set acceptance, host work per step, FP8 weights beside bf16.
# Usage (on a CUDA machine, repo root): OUT=/some/dir bash perf/gpu_check.sh [e2e] [steps] [spec] [e2e8b] [tests]
#   [model] [multigpu] [bandwidth] [host] [fp8]
# (no arguments: all; sections run in the order named). The engine's own dependencies (msgspec,
# pyzmq, xgrammar, tritonclient, ...) travel as wheels: `bash perf/gpu_wheels.sh` here, carry .gpuw,
# and there install them first (the header of gpu_wheels.sh has the line).
set -u
OUT=${OUT:-perf/results/gpu}
STEPS=${*:-e2e steps spec e2e8b tests model multigpu bandwidth host fp8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# what comes back is at most 8 files: gpu.txt, tests.txt, bench_gpu.txt (+ .json), bench_gpu_8b.json,
# step_path.txt, spec.txt, bench_kernels.txt; each section appends to its file as it goes
tests() {
  echo "== kernel tests (native CUDA)" | tee -a "$OUT/tests.txt"
  timeout 90 $PY -m pytest tests/kernels -q -p no:cacheprovider --timeout 60 2>&1 | tee -a "$OUT/tests.txt" | tail -15
}
model() {
  # one file at a time, each under its own limit, so a slow one does not hide the others' failures
  for entry in test_gpu_path:60 test_overlapped_steps:40 test_engine_vs_hf:100 test_speculative:100; do
    name=${entry%%:*}
    echo "== tests/model/$name.py on CUDA" | tee -a "$OUT/tests.txt"
    timeout "${entry##*:}" $PY -m pytest "tests/model/$name.py" -q --tb=short --timeout 60 -p no:cacheprovider \
      > "$OUT/$name.log" 2>&1
    echo "exit $?" | tee -a "$OUT/tests.txt"
    grep -E "passed|failed|^(FAILED|ERROR)|^E  " "$OUT/$name.log" | head -40 | tee -a "$OUT/tests.txt"
    rm -f "$OUT/$name.log"
  done
}
multigpu() {
  echo "== tensor parallelism on one GPU: NCCL world of one in CUDA graphs == unsharded; TP=2 on one GPU (gloo, CUDA tensors)" \
    | tee -a "$OUT/tests.txt"
  timeout 100 $PY -m pytest tests/model/test_cuda_parallel.py -q --timeout 60 -p no:cacheprovider 2>&1 | tail -20 \
    | tee -a "$OUT/tests.txt"
}
steps() {
  echo "== the step path, Llama-3.2-1B shape, bf16: graph replays and host waits per step"
  timeout 100 $PY -m perf.bench_step_path --shape 1b --batch-sizes 1 64 2>&1 \
    | grep -v -E "Loading|Writing" | tail -16 | tee "$OUT/step_path.txt"
}
bandwidth() {
  echo "== decode attention bandwidth"
  timeout 90 $PY -m perf.bench_kernels --num-splits 1 2 4 2>&1 | tail -25 | tee -a "$OUT/bench_kernels.txt"
  echo "== decode attention at the end-to-end shape (1B: head_dim 64, batch 128, contexts 128-1024)"
  timeout 90 $PY -m perf.bench_kernels --head-dim 64 --batch 128 --min-context 128 --context 1024 \
    --num-splits 1 2 --block-n 32 64 128 2>&1 | tail -25 | tee -a "$OUT/bench_kernels.txt"
  echo "== verification attention, batch 1 x 4 queries, 8B shape, context 8192: split-KV (auto) vs none"
  timeout 60 $PY -m perf.bench_kernels --batch 1 --queries 4 --context 8192 --num-splits 1 2>&1 | tail -8 \
    | tee -a "$OUT/bench_kernels.txt"
  echo "== small-batch linears: cuBLAS vs the Triton gemv kernel at the 1B shapes, tile sweep"
  timeout 120 $PY -m perf.bench_gemv --block-n 16 32 64 --block-k 128 256 512 2>&1 | tail -30 | tee -a "$OUT/bench_kernels.txt"
}
e2e() {
  echo "== end to end, Llama-3.2-1B shape, bf16"
  timeout 220 $PY -m perf.bench_gpu --hf-requests 32 --json "$OUT/bench_gpu.json" 2>&1 | grep -v -E "Loading|Writing" \
    | tee -a "$OUT/bench_gpu.txt" | tail -40
}
fp8() {
  echo "== FP8 weights beside bf16, Llama-3.2-1B shape: batch-1 ms/token and 256 requests, each against its floor" \
    | tee -a "$OUT/bench_gpu.txt"
  timeout 300 $PY -m perf.bench_gpu --default-only --quantization fp8 --hf-requests 8 2>&1 \
    | grep -v -E "Loading|Writing" | tee -a "$OUT/bench_gpu.txt" | tail -24
  echo "== FP8 kernel and model tests on CUDA" | tee -a "$OUT/tests.txt"
  timeout 120 $PY -m pytest tests/kernels/test_gemv.py tests/kernels/test_engine_triton_backend.py \
    tests/model/test_quantization.py -q --timeout 60 -p no:cacheprovider -k "fp8" 2>&1 | tail -15 | tee -a "$OUT/tests.txt"
}
e2e8b() {
  echo "== end to end, Llama-3.1-8B shape, bf16: the default engine against its floor (16 GB / 4.25 TB/s = 3.8 ms) and HF" \
    | tee -a "$OUT/bench_gpu.txt"
  timeout 240 $PY -m perf.bench_gpu --shape 8b --default-only --hf-requests 32 --json "$OUT/bench_gpu_8b.json" 2>&1 \
    | grep -v -E "Loading|Writing" | tee -a "$OUT/bench_gpu.txt" | tail -20
}
spec() {
  echo "== speculation with overlapped steps, 1B-shape pair of set acceptance (a one-layer draft), batch 1/8/64/256"
  pair=$(mktemp -d)
  timeout 90 $PY -m perf.spec_pair "$pair" --shape 1b --acceptance 0.7 2>&1 | grep -v -E "Loading|Writing" | tail -2 \
    | tee "$OUT/spec.txt"
  timeout 200 $PY -m perf.bench_speculative --target "$pair/target" --draft "$pair/draft" --dtype bfloat16 \
    --draft-dtype bfloat16 --temperatures 0 --batch-sizes 1 8 64 256 --max-tokens 64 --repeats 1 \
    --async-scheduling on --num-kv-blocks 6000 --methods none "draft k=3" "draft adaptive" 2>&1 \
    | grep -v -E "Loading|Writing|runs:" | tee -a "$OUT/spec.txt" | tail -18
  rm -rf "$pair"
}
host() {
  echo "== host work per decode step (tiny model, forward timed apart)"
  timeout 120 $PY -m perf.bench_host --batch-sizes 1 64 256 2>&1 | tail -12 | tee -a "$OUT/bench_kernels.txt"
}
for section in $STEPS; do
  echo "== section $section, $(date +%T)"
  $section
done
