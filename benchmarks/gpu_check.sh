#!/usr/bin/env bash
# One call on a lent GPU machine (see DEVELOPERS.md): doctor and local detection on real hardware,
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
