"""Whether a step fits a GPU: its peak tensors plus what a CUDA process holds besides, against the GPU's memory;
and how long the step takes there (cost/step.py's ``StepTime``, the one recommend ranks by).

>>> fit_on(per_gpu(workload, setup), load_catalog().get("rtx-4090")).status   # doctest: +SKIP
'tight'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.cost.comm import expert_parallel
from gpuwise.planning.cost.roofline import roofline_bound
from gpuwise.planning.cost.step import StepTime, step_time
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
    step_time_s: float | None  # the step's modelled time (``step.seconds``), the figure recommend ranks by
    # the bound no run of the step beats (``step.bound_s``; for --task decode the token floor), also where no time
    # is modelled (no link figure between the run's GPUs)
    step_time_bound_s: float | None
    rates: str | None  # "datasheet" peaks, or "measured" by gpuwise bench --calibrate on this device
    # --task decode: the per-token latency floor, max(bytes read / bandwidth, FLOPs / peak) (serving.decode_floor),
    # which is then the step's floor too; None for the other tasks
    token_floor_s: float | None = None
    # the dtype the step computes in that this GPU has no rate for ("bf16" on T4 and V100): torch emulates it, many
    # times slower, so the row says so and names the precision that runs instead; None when it has one
    missing_dtype: str | None = None
    # the step's time on this GPU (cost/step.py), as recommend ranks it, with its bound; None: no rate for the run's
    # precision, or no link between its GPUs
    step: StepTime | None = None

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
           calibration: Calibration | None = None, all_to_all=None, timed: bool = True) -> GpuFit:
    """Whether ``step`` fits on ``acc``, the largest micro-batch that does, and the step's time there with its bound
    (plus the --ep all-to-alls' time, ``all_to_all``: expert.AllToAll, where the GPU has a link figure; the experts
    wait on them, so they do not hide under the compute). ``timed=False``: the memory only (a search that asks
    only whether a setting fits need not cost every op)."""
    required = step.peak_bytes - step.paged_bytes + overhead_bytes
    headroom = acc.memory_bytes - required
    no_fp8 = step.setup.spec.float8 and not acc.fp8  # before Ada and Hopper: no fp8 tensor cores
    status_ = "no" if no_fp8 else status(headroom, acc.memory_bytes)
    max_batch = 0 if no_fp8 else max_micro_batch(step, acc, overhead_bytes=overhead_bytes)
    missing = "bf16" if step.setup.spec.needs_bf16 and not no_fp8 and not acc.bf16 else None
    if not timed:
        return GpuFit(gpu=acc.key, name=acc.name, memory_bytes=acc.memory_bytes, required_bytes=required,
                      headroom_bytes=headroom, status=status_, max_batch=max_batch, step_time_s=None,
                      step_time_bound_s=None, rates=None, missing_dtype=missing)
    timed = step_time(step, acc, calibration=calibration, all_to_all=all_to_all)
    bound, rates = (timed.bound_s, timed.rates) if timed is not None else _bound(step, acc, calibration, all_to_all)
    token_s = None
    if step.setup.task == "decode":  # one step is one token: its bound is the floor of the bytes it must read
        from gpuwise.planning.cost.serving import DecodeRead, decode_floor

        token = decode_floor(acc, DecodeRead.of(step), calibration=calibration)
        bound = token_s = None if token is None else token.seconds
        timed = timed if timed is None else replace(timed, bound_s=bound)
    return GpuFit(gpu=acc.key, name=acc.name, memory_bytes=acc.memory_bytes, required_bytes=required,
                  headroom_bytes=headroom, status=status_, max_batch=max_batch,
                  step_time_s=None if timed is None else timed.seconds, step_time_bound_s=bound, rates=rates,
                  token_floor_s=token_s, missing_dtype=missing, step=timed)


def _bound(step: PerGpu, acc: Accelerator, calibration: Calibration | None, all_to_all
           ) -> tuple[float | None, str | None]:
    """Where no step time is modelled (no link figure between the run's GPUs, no bandwidth) the roofline bound still
    is: its seconds plus the all-to-alls, and the rates it rests on."""
    bound = roofline_bound(step, acc, calibration)
    if bound is None:
        return None, None
    s = step.setup
    timed = None if all_to_all is None else expert_parallel(all_to_all, acc, micro_batches=s.grad_accum, tp=s.tp)
    return bound.seconds + (0.0 if timed is None else timed.exposed_s), bound.rates
