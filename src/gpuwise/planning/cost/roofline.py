"""The roofline bound of a step: no run of it is faster (Williams et al. 2009), and the rates every FLOP runs at.

``roofline_bound`` is the whole step's FLOPs at the peak of the run's precision, or its bytes at the memory
bandwidth, whichever takes longer; ``StepTime.bound_s`` (cost/step.py) carries it beside the modelled time.

>>> roofline_bound(per_gpu(workload, setup), load_catalog().get("h100-sxm")).seconds   # doctest: +SKIP
0.0123
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.tracker import MATMUL_FP8, MATMUL_FP32

if TYPE_CHECKING:
    from gpuwise.planning.parallel.sharding import PerGpu

Rates = Literal["datasheet", "measured"]


@dataclass(frozen=True, kw_only=True)
class Bound:
    seconds: float
    rates: Rates  # the catalog's dense peaks, or rates gpuwise bench --calibrate measured on the device


def float8_rates(step: PerGpu, acc: Accelerator, fp8_tflops: float, measured: Calibration | None,
                 share: float = 1.0) -> tuple[float, float | None]:
    """--precision fp8: (fp8 GEMM rate, the rate of every other FLOP: the compute dtype's, bf16); only the linear
    layers' ``_scaled_mm`` run at the fp8 rate (attention, the head and the rest stay in bf16)."""
    key = step.setup.spec.compute
    hp = (measured.tflops.get(key) if measured is not None else None) or (acc.peak_tflops.get(key) or 0) * share
    return fp8_tflops, hp or None


def fp32_matmul_rate(step: PerGpu, acc: Accelerator, measured: Calibration | None, share: float = 1.0
                     ) -> tuple[float | None, str]:
    """A 16-bit run's GEMMs on fp32 operands (``MATMUL_FP32``: a Mixture of Experts' grouped matmuls under
    autocast, whose fp32 weights CUDA autocast does not cast, autocast.py) run through cuBLAS in fp32: at the
    catalog's fp32 rate, as PyTorch leaves ``torch.backends.cuda.matmul.allow_tf32`` False (its default since 1.12;
    ``float32_matmul_precision`` "highest") and neither gpuwise's bf16-mixed/fp16-mixed (``PrecisionSpec.tf32``
    False) nor transformers' Trainer (``TrainingArguments.tf32`` None: left alone; only its ``torch_compile`` with bf16
    turns TF32 on, not modelled) turns it on; at the tf32 rate for a precision that does. Measured rates win; the
    board's clock share applies as to the 16-bit rate.
    (rate or None where the catalog has neither: the run's rate is used, and the basis says so; what it is)."""
    key = "tf32" if step.setup.spec.tf32 else "fp32"
    why = "allow_tf32 off, PyTorch's default" if key == "fp32" else "TF32 on"
    got = measured.tflops.get(key) if measured is not None else None
    if got:
        return got, f"{key} {got:g} TFLOPS measured ({why})"
    datasheet = acc.peak_tflops.get(key)
    if not datasheet:
        return None, f"no {key} rate in the catalog: at the run's"
    return datasheet * share, f"{key} {datasheet:g} TFLOPS ({why}) x{share:.2f}"


def roofline_bound(step: PerGpu, accelerator: Accelerator, calibration: Calibration | None = None, *,
                   int8: bool = False) -> Bound | None:
    """The roofline bound of one optimizer step of ``step`` on ``accelerator``: max(FLOPs / peak, bytes /
    bandwidth), at the rate of the run's precision (``Setup.spec.rate_key``; ``int8``: the int8 rate, each byte of
    the captured 16-bit elements one), a 16-bit run's matmuls on fp32 operands at the fp32 rate
    (``fp32_matmul_rate``), over the share of the step a pipeline stage works; measured rates replace the
    datasheet's. None: the GPU has no such rate (bf16 before Ampere)."""
    key = "int8" if int8 else step.setup.spec.rate_key  # the run's: a sharded fp16-mixed step is captured as bf16
    measured = calibration is not None and bool(calibration.tflops.get(key))
    tflops = calibration.tflops[key] if measured else accelerator.peak_tflops.get(key)
    if not tflops:
        return None
    gbps = (calibration.gbps if measured else None) or accelerator.memory_bandwidth_gbps
    compute = step.workload.flops_per_step / (tflops * 1e12)
    rest = tflops  # the rate of every FLOP but fp8's
    c = step.workload.costs
    if step.setup.spec.float8:  # the fp8 GEMMs at the fp8 rate, every other FLOP at bf16's
        fp8, hp = float8_rates(step, accelerator, tflops, calibration if measured else None)
        if hp is None:
            return None
        mask = c.kind == MATMUL_FP8
        fp8_flops = float(c.flops[mask] @ c.count[mask])
        compute = fp8_flops / (fp8 * 1e12) + max(step.workload.flops_per_step - fp8_flops, 0) / (hp * 1e12)
        rest = hp
    wide = c.kind == MATMUL_FP32
    fp32_flops = float(c.flops[wide] @ c.count[wide])
    if not int8 and fp32_flops and step.setup.compute_dtype.itemsize < 4:  # those at the fp32 rate
        fp32 = fp32_matmul_rate(step, accelerator, calibration if measured else None)[0]
        if fp32 is not None:
            compute += fp32_flops / (fp32 * 1e12) - fp32_flops / (rest * 1e12)
    nbytes = step.workload.bytes_per_step / (step.setup.compute_dtype.itemsize if int8 else 1)
    memory = nbytes / (gbps * 1e9) if gbps else 0.0
    idle = 1 - step.setup.pipeline_bubble
    return Bound(seconds=max(compute, memory) / idle, rates="measured" if measured else "datasheet")
