"""The step-time model's error bar, as its own held-out validation measured it; printed beside every step time.

The figures are benchmarks/RESULTS.md's of 2026-12-03 (``benchmarks/speed_truth.py``): the kernel-time model is fitted
on per-kernel microbenchmarks only (OpenXLA's GEMM tables, NeuSight's kernels: scripts/fit_kernels.py), so every
published end-to-end run is held out. Over 134 of them (Lambda, NVIDIA DeepLearningExamples, torchtitan, llm-foundry,
torchtune, nanoGPT, llama.cpp; 1 to 128 GPUs): median |predicted / measured - 1| 21%; training steps 18% (59 one-GPU
runs) and 22% (57 multi-GPU runs); inference 54% (10 runs, batch-1 ResNet-50 up to 5x too fast: host time not modelled).
"""

HELD_OUT_ERROR = ("held-out error on 134 published runs: median 21% (training 18%, multi-GPU 22%, "
                  "inference 54%)")

# The same median as a number: StepTime.error, printed as the step time's "±" in plan and recommend.
ERROR_BAR = 0.21
