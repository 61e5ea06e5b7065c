"""Honest measurements: ``measure`` for your own code, and the benchmark suite behind ``gpuwise bench``."""

import os
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.precision import ELEMENT_TYPES

# What the suite can time, named here without torch so gpuwise bench checks --ops and --dtype before it loads.
OPS = ("gemm", "copy", "h2d", "attention", "conv2d", "block", "train-step")  # block: GPT-2 block, fwd + bwd
DTYPES = tuple(ELEMENT_TYPES)  # GEMM element types: fp32, tf32, fp16, bf16, fp8


def saved_run_file(path: str | os.PathLike) -> Path:
    """``path`` as a file from ``gpuwise bench --save``: one that is missing or a folder is refused in one line."""
    hint = "pass a file written by 'gpuwise bench --save FILE'"
    if Path(path).is_dir():
        raise GpuwiseError(f"{path} is a folder", hint)
    if not Path(path).exists():
        raise GpuwiseError(f"no such file: {path}", hint)
    return Path(path)


from gpuwise.bench.measure import Measurement, measure  # noqa: E402  (after the names: measure imports nothing here)

__all__ = ["DTYPES", "OPS", "Measurement", "measure"]
