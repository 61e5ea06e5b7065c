"""On a CUDA GPU only: the timer, fp8 GEMMs and the SDPA backends run for real."""

from __future__ import annotations

import pytest
import torch

from gpuwise.bench import measure
from gpuwise.bench.suite import Case, _attention, _gemm, run_case
from gpuwise.hardware.device import CudaDevice, device_for

pytestmark = pytest.mark.requires_cuda


def test_cuda_timing_waits_for_the_kernels():
    """A large GEMM takes milliseconds: a clock read without a sync would see microseconds of launch."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with measure(device="cuda", warmup=2, repeats=5, flops=2 * 8192**3) as m:
        for _ in m:
            a @ a
    assert isinstance(device_for("cuda"), CudaDevice)
    assert m.result.median_s > 2 * 8192**3 / 3000e12  # no GPU does bf16 at 3 PFLOP/s dense
    assert m.result.peak_memory_bytes >= a.numel() * 2


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 needs compute capability 8.9+")
def test_fp8_gemm_runs():
    m, flops, _ = run_case(_gemm(4096, 4096, 4096, "fp8"), device_for("cuda"), warmup=1, repeats=3)
    assert m.tflops > 0 and flops == 2 * 4096**3


@pytest.mark.parametrize("backend", ["flash", "efficient", "math"])
def test_sdpa_backends_run_when_forced(backend):
    case: Case = _attention(2, 8, 1024, 64, "bf16", backend)
    m, _, _ = run_case(case, device_for("cuda"), warmup=1, repeats=3)
    assert m.median_s > 0
