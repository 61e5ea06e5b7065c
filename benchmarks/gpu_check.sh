#!/usr/bin/env bash
# One call on a lent GPU machine (see ../.library/device): doctor and local detection on real hardware, the
# tests marked requires_cuda and the attention kernels compiled, the planner against real peak memory, the
# benchmark suite, training throughput and the attention kernel against PyTorch's. Each part has a time cap
# so the whole stays under 9 minutes. Writes its tables to $OUT; prints them too.
# Usage (from the repository root): bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpuwise-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=src
PY=${PYTHON:-python3}
start=$(date +%s)
part() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
part setup
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/nvidia-smi.csv"
$PY -m gpuwise doctor | tee "$OUT/doctor.txt"
$PY -m gpuwise doctor --json >"$OUT/doctor.json"
$PY -m gpuwise gpus --local | tee "$OUT/local.txt"
$PY -m gpuwise gpus --local --json >"$OUT/local.json"
part "tests on the GPU (requires_cuda, and the attention kernels compiled)"
timeout 100 $PY -m pytest -q -p no:cacheprovider -x tests/test_attention.py 2>&1 | tail -5 | tee "$OUT/pytest-attention.txt"
timeout 60 $PY -m pytest -q -p no:cacheprovider -m requires_cuda tests 2>&1 | tail -5 | tee "$OUT/pytest-cuda.txt"
part "planned peak memory vs torch.cuda.max_memory_allocated (issue 3)"
timeout 110 $PY benchmarks/plan_vs_gpu.py 2>&1 | tee "$OUT/plan_vs_gpu.txt"
part "gpuwise bench --quick (issue 4)"
timeout 80 $PY -m gpuwise bench --quick --save "$OUT/bench.json" --plot "$OUT/roofline.png" 2>&1 | tee "$OUT/bench.txt"
timeout 30 $PY benchmarks/measure_vs_torch.py --device cuda 2>&1 | tee "$OUT/measure_vs_torch.txt"
part "gpuwise train: GPT-2 124M bf16, eager and compiled; --auto vs the real largest batch (issue 5)"
timeout 120 $PY benchmarks/train_gpu.py --steps 20 2>&1 | tee "$OUT/train_gpu.txt"
part "gpuwise.ops.attention vs SDPA-flash, SDPA default, FlexAttention; block sparsity (issue 6)"
timeout 150 $PY benchmarks/attention.py --quick --budget 110 2>&1 | tee "$OUT/attention.txt"
part "transformers generate at batch 1, 8, 64 vs the serving model's hf runtime (issue 28)"
timeout 90 $PY benchmarks/hf_generate.py --out "$OUT/hf_generate.md" 2>&1 | tail -8 | tee "$OUT/hf_generate.txt"
part done
