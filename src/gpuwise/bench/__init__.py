"""Honest measurements: ``measure`` for your own code, and the benchmark suite behind ``gpuwise bench``."""

from gpuwise.precision import ELEMENT_TYPES

# What the suite can time, named here without torch so gpuwise bench checks --ops and --dtype before it loads.
OPS = ("gemm", "copy", "h2d", "attention", "conv2d", "block", "train-step")  # block: GPT-2 block, fwd + bwd
DTYPES = tuple(ELEMENT_TYPES)  # GEMM element types: fp32, tf32, fp16, bf16, fp8

from gpuwise.bench.measure import Measurement, measure  # noqa: E402  (after the names: measure imports nothing here)

__all__ = ["DTYPES", "OPS", "Measurement", "measure"]
