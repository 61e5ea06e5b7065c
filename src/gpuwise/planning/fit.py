"""Whether a step fits a GPU: its peak tensors plus what a CUDA process holds besides, against the GPU's memory.

>>> fit_on(per_gpu(workload, setup), load_catalog().get("rtx-4090")).status   # doctest: +SKIP
'tight'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.cost.step import all_to_all_time, step_time_floor
from gpuwise.planning.parallel.sharding import PerGpu
from gpuwise.planning.setup import MAX_BATCH
from gpuwise.units import MiB

# Memory a CUDA process holds besides its tensors. Estimates, stated as such: the context with lazy
# module loading (CUDA >= 11.7, PyTorch's default) is a few hundred MiB and grows with the kernels
# loaded (the HF "model memory anatomy" page measured 1,343 MB on a V100 before lazy loading); the
# cuBLAS workspace PyTorch sizes for Hopper is 32 MiB (aten/src/ATen/cuda/CublasHandlePool.cpp,
# getChosenWorkspaceSize). benchmarks/gpu_check.sh measures the real figure on the GPU it runs on.
CUDA_CONTEXT_BYTES = 512 * MiB
CUBLAS_WORKSPACE_BYTES = 32 * MiB
OVERHEAD_BYTES = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES
# Below this headroom the caching allocator's fragmentation (reserved > allocated) can still OOM: HF's
# BERT-large anchor (model_memory_anatomy.md) shows nvml "used" about 20% above our allocated peak + context.
TIGHT_FRACTION = 0.10
# Paged optimizer state (bitsandbytes' paged optimizers) lives in CUDA unified memory, outside the caching
# allocator: the driver evicts its pages to host memory when the GPU runs short (slower steps, no OOM). So a step
# fits when the rest does; the paged bytes are shown beside it (MemoryPlan.paged_bytes).

Status = Literal["fits", "tight", "no"]


@dataclass(frozen=True, kw_only=True)
class GpuFit:
    gpu: str  # catalog key
    name: str
    memory_bytes: int
    required_bytes: int  # peak tensors + overhead, less the paged optimizer state (it can spill to the host)
    headroom_bytes: int
    status: Status
    max_batch: int  # largest micro-batch that fits, same setup otherwise
    step_time_s: float | None  # roofline floor: max(FLOPs / compute rate, bytes / bandwidth); real steps are slower
    rates: str | None  # "datasheet" peaks, or "measured" by gpuwise bench --calibrate on this device
    # --task decode: the per-token latency floor, max(bytes read / bandwidth, FLOPs / peak) (serving.decode_floor),
    # which is then the step's floor too; None for the other tasks
    token_floor_s: float | None = None
    # the dtype the step computes in that this GPU has no rate for ("bf16" on T4 and V100): torch emulates it, many
    # times slower, so the row says so and names the precision that runs instead; None when it has one
    missing_dtype: str | None = None

    @property
    def fits(self) -> bool:
        return self.status != "no"


def status(headroom_bytes: int, memory_bytes: int) -> Status:
    """No room; less room than the allocator's fragmentation can take (tight); or room to spare."""
    if headroom_bytes < 0:
        return "no"
    return "tight" if headroom_bytes < TIGHT_FRACTION * memory_bytes else "fits"


def max_micro_batch(step: PerGpu, acc: Accelerator, *, overhead_bytes: int = OVERHEAD_BYTES) -> int:
    """The largest micro-batch that fits ``acc``, the rest of the run unchanged (0: not even 1).

    The batch model is affine from the captured micro-batch on; at that micro-batch the exact capture decides."""
    if step.batch_model is None:
        return 0
    b = step.setup.micro_batch
    budget = acc.memory_bytes - overhead_bytes + step.paged_bytes
    best = step.batch_model.max_batch(budget, MAX_BATCH)
    return max(best, b) if step.peak_bytes <= budget else min(best, b - 1)


def fit_on(step: PerGpu, acc: Accelerator, *, overhead_bytes: int = OVERHEAD_BYTES,
           calibration: Calibration | None = None, all_to_all=None) -> GpuFit:
    """Whether ``step`` fits on ``acc``, the largest micro-batch that does, and the step's time floor there (plus
    the --ep all-to-alls' time, ``all_to_all``: parallel.AllToAll, where the GPU has a link figure; the experts wait
    on them, so they do not hide under the compute)."""
    required = step.peak_bytes - step.paged_bytes + overhead_bytes
    headroom = acc.memory_bytes - required
    no_fp8 = step.setup.spec.float8 and not acc.fp8  # before Ada and Hopper: no fp8 tensor cores
    floor = step_time_floor(step, acc, calibration)
    step_s, token_s = None if floor is None else floor.seconds, None
    if step_s is not None and all_to_all is not None:
        timed = all_to_all_time(all_to_all, acc)
        if timed is not None:
            step_s += timed[0]
    if step.setup.task == "decode":  # one step is one token: the floor of the bytes it must read
        from gpuwise.planning.cost.serving import DecodeRead, decode_floor

        token = decode_floor(acc, DecodeRead.of(step), calibration=calibration)
        step_s = token_s = None if token is None else token.seconds
    return GpuFit(gpu=acc.key, name=acc.name, memory_bytes=acc.memory_bytes, required_bytes=required,
                  headroom_bytes=headroom, status="no" if no_fp8 else status(headroom, acc.memory_bytes),
                  max_batch=0 if no_fp8 else max_micro_batch(step, acc, overhead_bytes=overhead_bytes),
                  step_time_s=step_s, rates=None if floor is None else floor.basis, token_floor_s=token_s,
                  missing_dtype="bf16" if step.setup.spec.needs_bf16 and not no_fp8
                  and not acc.bf16 else None)
