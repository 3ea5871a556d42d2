#!/usr/bin/env bash
# The GPU checks in one run: native kernel tests, the model tests on CUDA, the step path (graph
# replays and host waits per step, plain and speculating, overlapped or not), tensor parallelism on
# one GPU (NCCL world of one in CUDA graphs, two ranks on the GPU), decode-attention and
# small-batch linear bandwidth, end to end vs HF, host work per step.
# Usage (on a CUDA machine, repo root): OUT=/some/dir bash perf/gpu_check.sh [tests] [model] [multigpu] [steps]
#   [bandwidth] [e2e] [host]
# (no arguments: all; sections run in the order named). The engine's own dependencies (msgspec,
# pyzmq, xgrammar, tritonclient, ...) travel as wheels: `bash perf/gpu_wheels.sh` here, carry .gpuw,
# and there install them first (the header of gpu_wheels.sh has the line).
set -u
OUT=${OUT:-perf/results/gpu}
STEPS=${*:-tests model multigpu steps bandwidth e2e host}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
tests() {
  echo "== kernel tests (native CUDA)"
  timeout 90 $PY -m pytest tests/kernels -q -p no:cacheprovider --timeout 60 2>&1 | tee "$OUT/kernel_tests.txt" | tail -15
}
model() {
  echo "== model tests on CUDA (engine == HF, overlapped == plain, speculation with overlap, the step path)"
  timeout 150 $PY -m pytest tests/model/test_gpu_path.py tests/model/test_engine_vs_hf.py tests/model/test_overlapped_steps.py \
    tests/model/test_speculative.py -q --timeout 60 -p no:cacheprovider 2>&1 | tee "$OUT/model_tests.txt" | tail -30
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/model_tests.txt"
}
multigpu() {
  echo "== tensor parallelism on one GPU: NCCL world of one in CUDA graphs == unsharded; TP=2 on one GPU (gloo, CUDA tensors)"
  timeout 100 $PY -m pytest tests/model/test_cuda_parallel.py -q --timeout 60 -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/multigpu.txt"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/multigpu.txt"
}
steps() {
  echo "== the step path, Llama-3.2-1B shape, bf16: graph replays and host waits per step"
  timeout 100 $PY perf/bench_step_path.py --shape 1b --batch-sizes 1 64 --json "$OUT/step_path.json" 2>&1 \
    | grep -v -E "Loading|Writing" | tail -16 | tee "$OUT/step_path.txt"
}
bandwidth() {
  echo "== decode attention bandwidth"
  timeout 90 $PY perf/bench_kernels.py --num-splits 1 2 4 2>&1 | tail -25 | tee "$OUT/bench_kernels.txt"
  echo "== decode attention at the end-to-end shape (1B: head_dim 64, batch 128, contexts 128-1024)"
  timeout 90 $PY perf/bench_kernels.py --head-dim 64 --batch 128 --min-context 128 --context 1024 \
    --num-splits 1 2 --block-n 32 64 128 2>&1 | tail -25 | tee -a "$OUT/bench_kernels.txt"
  echo "== verification attention, batch 1 x 4 queries, 8B shape, context 8192: split-KV (auto) vs none"
  timeout 60 $PY perf/bench_kernels.py --batch 1 --queries 4 --context 8192 --num-splits 1 2>&1 | tail -8 \
    | tee -a "$OUT/bench_kernels.txt"
  echo "== small-batch linears: cuBLAS vs the Triton gemv kernel at the 1B shapes, tile sweep"
  timeout 120 $PY perf/bench_gemv.py --block-n 16 32 64 --block-k 128 256 512 2>&1 | tail -30 | tee "$OUT/bench_gemv.txt"
}
e2e() {
  echo "== end to end, Llama-3.2-1B shape, bf16"
  timeout 220 $PY perf/bench_gpu.py --hf-requests 32 --json "$OUT/bench_gpu.json" 2>&1 | grep -v -E "Loading|Writing" | tee "$OUT/bench_gpu.txt" | tail -40
}
host() {
  echo "== host work per decode step (tiny model, forward timed apart)"
  timeout 120 $PY perf/bench_host.py --batch-sizes 1 64 256 2>&1 | tail -12 | tee "$OUT/bench_host.txt"
}
for section in $STEPS; do
  echo "== section $section, $(date +%T)"
  $section
done
