"""A Workload on GPUs: peak memory, whether it fits, the largest micro-batch, and what to change if not.

>>> from gpuwise.planning import plan_model
>>> p = plan_model("gpt2", Setup(micro_batch=4, seq=256), gpu="rtx-4090")   # doctest: +SKIP
>>> p.gpus[0].fits, p.max_batch                                        # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

import numpy as np

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.planning.scaling import Timeline
from gpuwise.planning.setup import MAX_ACCUM, MAX_BATCH, Setup
from gpuwise.planning.sharding import capture_setup, shard
from gpuwise.planning.source import resolve_source
from gpuwise.planning.tracker import CATEGORIES
from gpuwise.planning.workload import Workload, simulate
from gpuwise.precision import half_precision
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
DEFAULT_GPU = "h100-sxm"

Status = Literal["fits", "tight", "no"]


@dataclass(frozen=True, kw_only=True)
class GpuFit:
    gpu: str  # catalog key
    name: str
    memory_bytes: int
    required_bytes: int  # peak tensors + overhead
    headroom_bytes: int
    status: Status
    max_batch: int  # largest micro-batch that fits, same setup otherwise
    step_time_s: float | None  # roofline floor: max(FLOPs / compute rate, bytes / bandwidth); real steps are slower
    rates: str | None  # "datasheet" peaks, or "measured" by gpuwise bench --calibrate on this device

    @property
    def fits(self) -> bool:
        return self.status != "no"


@dataclass(frozen=True, kw_only=True)
class Remedy:
    name: str
    flags: str  # every flag to add to the user's command for this setup
    setup: Setup
    peak_bytes: int
    required_bytes: int
    status: Status

    @property
    def fits(self) -> bool:
        return self.status != "no"


def setup_flags(setup: Setup, base: Setup) -> str:
    """The command-line flags that turn ``base`` into ``setup``."""
    flags = []
    for f in fields(Setup):
        value, old = getattr(setup, f.name), getattr(base, f.name)
        lora = f.name == "lora_rank" and setup.task == "finetune-lora" and base.task != "finetune-lora"
        if value == old and not lora:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "")
        else:
            flags.append(f"{flag} {value}")
    return " ".join(f for f in flags if f)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The itemised plan: every figure in bytes or FLOPs, per GPU."""

    model: str
    setup: Setup
    params: int
    trainable_params: int
    flops_per_step: int
    bytes_per_step: int
    tokens_per_step: int
    peak_bytes: int  # the step's tensors: torch.cuda.max_memory_allocated() less library workspaces
    overhead_bytes: int  # CUDA context and library workspaces
    activations_bytes: int  # saved for backward at the end of the forward pass
    breakdown: dict[str, int]  # by category, at the peak
    peak_at: str  # phase (and block) of the peak
    gpu: str  # the GPU that fits, max_batch and remedies refer to
    fits: bool
    max_batch: int
    gpus: tuple[GpuFit, ...]
    remedies: tuple[Remedy, ...]
    uncosted: dict[str, int]
    captured_blocks: tuple[int, ...] | None
    timeline: np.ndarray = field(repr=False, compare=False)  # (samples, categories) bytes at this batch
    timeline_phases: tuple[str, ...] = field(repr=False, compare=False)


def _per_gpu(w: Workload, tl: Timeline) -> Timeline:
    """``tl`` as one of the setup's GPUs holds it."""
    return shard(tl, w.setup, trainable_params=w.trainable_params, block_bytes=w.block_bytes,
                 block_trainable_params=w.block_trainable_params)


def step_time_floor(w: Workload, acc: Accelerator,
                    calibration: Calibration | None = None) -> tuple[float | None, str | None]:
    """The roofline floor of one step on ``acc``: its FLOPs at the compute rate or its bytes at the memory
    bandwidth, whichever takes longer. Measured rates (a Calibration) replace the datasheet's."""
    dtype = w.setup.spec.rate_key
    measured = calibration is not None and calibration.tflops.get(dtype)
    tflops = calibration.tflops.get(dtype) if measured else acc.peak_tflops.get(dtype)
    gbps = (calibration.gbps if measured and calibration.gbps else None) or acc.memory_bandwidth_gbps
    if not tflops:
        return None, None
    compute = w.flops_per_step / (tflops * 1e12)
    memory = w.bytes_per_step / (gbps * 1e9) if gbps else 0.0
    return max(compute, memory), "measured" if measured else "datasheet"


def fit_on(w: Workload, acc: Accelerator, *, overhead_bytes: int = OVERHEAD_BYTES, calibration=None) -> GpuFit:
    """Whether ``w`` fits on ``acc``, and the largest micro-batch that does (0: not even 1)."""
    peak = int(_per_gpu(w, w.timeline).live(w.setup.micro_batch).sum(axis=1).max())
    required = peak + overhead_bytes
    headroom = acc.memory_bytes - required
    status: Status = "no" if headroom < 0 else "tight" if headroom < TIGHT_FRACTION * acc.memory_bytes else "fits"
    max_batch = 0
    if w.batch_model is not None:
        b = w.setup.micro_batch
        max_batch = _per_gpu(w, w.batch_model).max_batch(acc.memory_bytes - overhead_bytes, MAX_BATCH)
        max_batch = max(max_batch, b) if headroom >= 0 else min(max_batch, b - 1)  # the exact capture decides at b
    step_s, rates = step_time_floor(w, acc, calibration)
    return GpuFit(gpu=acc.key, name=acc.name, memory_bytes=acc.memory_bytes, required_bytes=required,
                  headroom_bytes=headroom, status=status, max_batch=max_batch, step_time_s=step_s, rates=rates)


class _Planner:
    """Simulates setups of one model, each once."""

    def __init__(self, source) -> None:
        self.source = source
        self._cache: dict[tuple[Setup, bool], Workload] = {}

    def workload(self, setup: Setup, *, batch_model: bool = False) -> Workload:
        key = capture_setup(setup)  # sharding is applied after the capture
        hit = self._cache.get((key, True)) or (None if batch_model else self._cache.get((key, False)))
        if hit is None:
            hit = self._cache[key, batch_model] = simulate(self.source, key, batch_model=batch_model)
        return replace(hit, setup=setup)

    def remedy(self, name: str, setup: Setup, base: Setup, acc: Accelerator) -> Remedy:
        f = fit_on(self.workload(setup), acc)
        return Remedy(name=name, flags=setup_flags(setup, base), setup=setup,
                      peak_bytes=f.required_bytes - OVERHEAD_BYTES, required_bytes=f.required_bytes, status=f.status)


def _micro(planner: _Planner, s: Setup, total: int, acc: Accelerator) -> int:
    """The largest micro-batch that fits ``acc`` and divides ``total`` samples per GPU (0 if none)."""
    if total == 1 or not s.training:
        fit = fit_on(planner.workload(replace(s, micro_batch=1, grad_accum=1), batch_model=total > 1), acc)
        return 0 if not fit.fits else 1 if total == 1 else min(fit.max_batch, total)
    fit = fit_on(planner.workload(replace(s, micro_batch=total, grad_accum=2), batch_model=True), acc)
    return next((m for m in range(min(fit.max_batch, total), 0, -1) if total % m == 0), 0)


def _with_micro(s: Setup, micro: int, total: int) -> Setup:
    return replace(s, micro_batch=micro, grad_accum=total // micro)


def _remedies(planner: _Planner, setup: Setup, acc: Accelerator) -> list[Remedy]:
    """bf16, checkpointing, a smaller micro-batch with accumulation, sharding, then LoRA/QLoRA; cumulative.

    A remedy that does not apply to this model (LoRA on a network without linear layers in its blocks,
    checkpointing without blocks, more accumulation steps than we allow) is left out.
    """
    out: list[Remedy] = []

    def attempt(name: str, s: Setup) -> Remedy | None:
        try:
            r = planner.remedy(name, s, setup, acc)
        except GpuwiseError:
            return None
        out.append(r)
        return r

    def fitted() -> bool:  # a tight fit goes on: the next remedy may leave room for the allocator
        return bool(out) and out[-1].status == "fits"

    s = setup
    total = s.micro_batch * s.grad_accum  # samples per GPU per optimizer step; the global batch is total x gpus
    if not s.training:
        micro = _micro(planner, s, s.micro_batch, acc) if s.micro_batch > 1 else 0
        if micro:
            attempt(f"smaller batch {micro}", replace(s, micro_batch=micro))
        return out
    if s.precision in ("fp32", "tf32"):
        half = half_precision(bf16=bool(acc.peak_tflops.get("bf16")))  # no bf16 before Ampere
        if attempt(f"{half[:4]} mixed precision", replace(s, precision=half)):
            s = replace(s, precision=half)
    if s.checkpointing == "none" and attempt("activation checkpointing", replace(s, checkpointing="full")):
        s = replace(s, checkpointing="full")
    if s.micro_batch > 1 and not fitted():
        micro = _micro(planner, s, total, acc)
        if 0 < micro < s.micro_batch and total // micro <= MAX_ACCUM:
            m = _with_micro(s, micro, total)
            if attempt(f"micro-batch {micro} x {total // micro} accumulation (same batch)", m):
                s = m
    single = s
    if not fitted():  # the fewest GPUs that fit with room to spare, else the fewest that fit tightly
        global_batch = total * s.gpus
        best: Remedy | None = None
        for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            per_gpu = max(global_batch // n, 1)
            try:
                micro = _micro(planner, replace(s, gpus=n, sharding="fsdp"), per_gpu, acc)
                if per_gpu // max(micro, 1) > MAX_ACCUM:
                    continue
                sharded = _with_micro(replace(s, gpus=n, sharding="fsdp"), max(micro, 1), per_gpu)
                r = planner.remedy(f"FSDP over {n} GPUs (global batch {per_gpu * n})", sharded, setup, acc)
            except GpuwiseError:
                break
            if best is None or not best.fits:  # a tight fit stays; a misfit gives way to the next try
                best = r
            if r.status == "fits":
                best = r
                break
        if best is not None:
            out.append(best)
    if single.task == "train":
        lora = replace(single, task="finetune-lora")  # from the one-GPU setup, not the sharded one
        attempt(f"LoRA rank {lora.lora_rank}, one GPU (fine-tuning only)", lora)
        attempt("QLoRA, 4-bit base, one GPU (fine-tuning only)", replace(lora, qlora=True))
    return out


def plan(source, setup: Setup, *, gpu: str | None = None, primary: str | None = None,
         catalog: Catalog | None = None, calibrations: dict | None = None) -> MemoryPlan:
    """Simulate ``setup`` for ``source`` and fit it on ``gpu`` (a catalog name) or on every catalog GPU.

    ``max_batch`` and the remedies are for ``gpu``, else ``primary`` (this machine's GPU, say), else the H100 SXM.
    """
    catalog = catalog or load_catalog()
    primary = catalog.get(gpu or primary or DEFAULT_GPU)
    planner = _Planner(source)
    w = planner.workload(setup, batch_model=True)
    tl = _per_gpu(w, w.timeline)
    live = tl.live(setup.micro_batch)
    totals = live.sum(axis=1)
    i = int(totals.argmax())
    phase, block = tl.labels[i]
    calibrations = calibrations or {}
    fits = tuple(fit_on(w, acc, calibration=calibrations.get(acc.key)) for acc in ([primary] if gpu else list(catalog)))
    mine = next((f for f in fits if f.gpu == primary.key), None) or fit_on(
        w, primary, calibration=calibrations.get(primary.key))  # the table has it unless --gpu was elsewhere
    return MemoryPlan(
        model=w.model, setup=setup, params=w.params, trainable_params=w.trainable_params,
        flops_per_step=w.flops_per_step, bytes_per_step=w.bytes_per_step, tokens_per_step=w.tokens_per_step,
        peak_bytes=int(totals[i]), overhead_bytes=OVERHEAD_BYTES,
        activations_bytes=int(live[tl.end_of_forward, CATEGORIES.index("activations")]) if setup.training else 0,
        breakdown={c: int(v) for c, v in zip(CATEGORIES, live[i], strict=True)},
        peak_at=phase if block is None or block < 0 else f"{phase}, block {block}",
        gpu=primary.key, fits=mine.fits, max_batch=mine.max_batch, gpus=fits,
        remedies=tuple(_remedies(planner, setup, primary)) if not mine.fits else (),
        uncosted=w.uncosted, captured_blocks=w.captured_blocks,
        timeline=live, timeline_phases=tuple(ph for ph, _ in tl.labels),
    )


def plan_model(model: str | None, setup: Setup, *, hf_config: str | None = None, gpu: str | None = None,
               primary: str | None = None, catalog: Catalog | None = None,
               calibrations: dict | None = None) -> MemoryPlan:
    """``plan`` for ``--model NAME``, ``--model file.py:function`` or ``--hf-config PATH``."""
    return plan(resolve_source(model, hf_config), setup, gpu=gpu, primary=primary, catalog=catalog,
                calibrations=calibrations)
