#!/usr/bin/env bash
# One call on a lent GPU machine (see DEVELOPERS.md): doctor and local detection on real hardware,
# the planner against real peak memory, the benchmark suite,
# and the tests marked requires_cuda. Writes its tables to $OUT; prints them too.
# Usage (from the repository root): bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpuwise-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=src
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/nvidia-smi.csv"
$PY -m gpuwise doctor | tee "$OUT/doctor.txt"
$PY -m gpuwise doctor --json >"$OUT/doctor.json"
$PY -m gpuwise gpus --local | tee "$OUT/local.txt"
$PY -m gpuwise gpus --local --json >"$OUT/local.json"
$PY -m pytest -q -p no:cacheprovider -m requires_cuda tests 2>&1 | tee "$OUT/pytest-cuda.txt"
# Planned peak memory vs torch.cuda.max_memory_allocated() for zoo models (issue 3), about 2 minutes.
$PY benchmarks/plan_vs_gpu.py 2>&1 | tee "$OUT/plan_vs_gpu.txt"
$PY -m gpuwise plan --model llama3-8b --seq 8192 --gpu h200 | tee "$OUT/plan-llama3-8b.txt"
# gpuwise bench (issue 4): the whole suite with CPU baselines, saved and drawn, about 3 minutes;
# then measure against torch.utils.benchmark.Timer on the GPU.
$PY -m gpuwise bench --save "$OUT/bench.json" --plot "$OUT/roofline.png" 2>&1 | tee "$OUT/bench.txt"
$PY benchmarks/measure_vs_torch.py --device cuda 2>&1 | tee "$OUT/measure_vs_torch.txt"
# gpuwise train (issue 5): GPT-2 124M bf16 tokens/s and MFU, eager and compiled; --auto vs the real largest batch.
timeout 300 $PY benchmarks/train_gpu.py 2>&1 | tee "$OUT/train_gpu.txt"
