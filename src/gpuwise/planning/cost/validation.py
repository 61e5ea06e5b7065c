"""The step-time model's error bar, as its own held-out validation measured it; printed beside every step time.

The figures are benchmarks/RESULTS.md's of 2026-12-04 (``benchmarks/speed_truth.py``): the kernel-time model is fitted
on per-kernel microbenchmarks only (OpenXLA's GEMM tables, NeuSight's kernels: scripts/fit_kernels.py), so every
published end-to-end run is held out. Over 135 of them (Lambda, NVIDIA DeepLearningExamples, torchtitan, llm-foundry,
torchtune, nanoGPT, llama.cpp; 1 to 128 GPUs): median |predicted / measured - 1| 20.5%; training steps 15% (59 one-GPU
runs) and 22% (58 multi-GPU runs); inference 34% (10 runs; batch-1 ResNet-50 up to 65% off: host time).
"""

HELD_OUT_ERROR = ("held-out error on 135 published runs: median 20.5% (training 15%, multi-GPU 22%, "
                  "inference 34%)")

# The same median as a number: StepTime.error, printed as the step time's "±" in plan and recommend.
ERROR_BAR = 0.205

# The serving model's (llm_step, load, replica: recommend --serve), from its own held-out validation: RESULTS.md of
# 2026-12-04, ``benchmarks/serving_truth.py`` (constants fitted on 18 published runs, these held out).
SERVING_HELD_OUT = ("held-out error on published runs (benchmarks/serving_truth.py): median 16% on 111 multi-stream "
                    "servers (TensorRT-LLM, MLPerf, SGLang, vLLM), 12% on 57 one-GPU and 15% on 73 multi-GPU "
                    "llama.cpp streams")
