"""How long a step takes on a GPU. Today a floor: the roofline of the whole step (Williams et al. 2009), its
FLOPs at the compute peak or its bytes at the memory bandwidth, whichever takes longer. Real steps reach
30-60% of it; per-op rooflines, efficiencies and communication are for ``recommend`` to add here.

>>> step_time_floor(per_gpu(workload, setup), load_catalog().get("h100")).seconds   # doctest: +SKIP
0.0123
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator

if TYPE_CHECKING:
    from gpuwise.planning.sharding import PerGpu

Basis = Literal["datasheet", "measured"]


@dataclass(frozen=True, kw_only=True)
class StepTime:
    seconds: float
    basis: Basis  # the catalog's dense peaks, or rates gpuwise bench --calibrate measured on the device


def step_time_floor(step: PerGpu, accelerator: Accelerator,
                    calibration: Calibration | None = None) -> StepTime | None:
    """The roofline floor of one optimizer step of ``step`` on ``accelerator``, at the rate of the run's
    precision (``Setup.spec.rate_key``); measured rates replace the datasheet's. None: the GPU has no such rate
    (bf16 before Ampere)."""
    key = step.setup.spec.rate_key  # the run's: a sharded fp16-mixed step is captured in 16 bits as bf16
    measured = calibration is not None and bool(calibration.tflops.get(key))
    tflops = calibration.tflops[key] if measured else accelerator.peak_tflops.get(key)
    if not tflops:
        return None
    gbps = (calibration.gbps if measured else None) or accelerator.memory_bandwidth_gbps
    compute = step.workload.flops_per_step / (tflops * 1e12)
    memory = step.workload.bytes_per_step / (gbps * 1e9) if gbps else 0.0
    return StepTime(seconds=max(compute, memory), basis="measured" if measured else "datasheet")
