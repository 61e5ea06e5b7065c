"""How long a step takes on a GPU, and on N of them, with the basis of every number: the one step-time model.

Each op of the captured step is priced as its kernel runs (cost/kernels.py): GEMMs and batched GEMMs by their
output tiles and waves over the SMs at the rate of the precision PyTorch runs them in, convolutions as cuDNN's
implicit GEMMs, fused attention by its implementation, and every other kernel by the bytes it moves at the
achievable bandwidth for its size; all fitted on measured per-kernel data (OpenXLA's GEMM tables, NeuSight's
kernels), never on an end-to-end run. Eager PyTorch also spends CPU time launching each kernel: a phase takes the
longer of its kernels and its launches. Data, tensor and pipeline parallelism add their collectives and bubble
(cost/comm.py). ``StepTime`` is the one step time: ``plan``, ``recommend``, ``train``'s expected step and MFU and
``watch`` all read it; it carries the roofline bound of the whole step (cost/roofline.py) as ``bound_s``, a bound
and never a prediction, and the error bar its held-out validation measured (cost/validation.py).

A GPU the kernel model cannot describe (no SM facts: TPU, Gaudi, Apple, NPUs) is priced op by op on its roofline
at the coarse shares of cost/efficiency.py, and the basis says so.

>>> t = step_time(per_gpu(workload, setup), load_catalog().get("h100-sxm"))   # doctest: +SKIP
>>> t.phases_s["forward"] + t.phases_s["backward"] + t.phases_s["optimizer"] <= t.seconds   # doctest: +SKIP
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.tracker import (
    ATTENTION,
    F_CONV,
    F_FUSED,
    FAMILIES,
    MATMUL_FP8,
    MATMUL_FP32,
    NONE,
    PHASES,
    OpCosts,
)
from gpuwise.planning.cost import comm, kernels
from gpuwise.planning.cost.comm import Comm
from gpuwise.planning.cost.efficiency import (
    COPY_CEILING,
    GEMM_CEILING,
    clock_share,
    efficiency,
    memory_class,
)
from gpuwise.planning.cost.roofline import Rates, float8_rates, fp32_matmul_rate, roofline_bound
from gpuwise.planning.cost.validation import ERROR_BAR

if TYPE_CHECKING:
    from gpuwise.planning.parallel.sharding import PerGpu

# Eager PyTorch spends CPU time on every kernel it launches (Python, the dispatcher, autograd, cudaLaunchKernel).
# Forward runs each op from Python: its family's dispatch as measured on NeuSight's hosts (kernels.forward_dispatch:
# 25-67 us an op, PyTorch 2.1). Backward and the optimizer's foreach kernels are launched from C++, a compiled
# forward from inductor's generated wrapper, and a decode step as the serving runtimes run it (vLLM, SGLang and
# TensorRT-LLM replay CUDA graphs, llama.cpp launches from C++): the low end of the ~5-25 us an op that the layers
# between Python and cudaLaunchKernel add (jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html;
# assumed, no measurement). The GPU queue lets the CPU run ahead, so a phase takes the longer of its kernels' time
# and its launches' (a small model is launch-bound, a large one never waits on them).
LAUNCH_S = np.array([5e-6, 5e-6, 5e-6])  # by PHASES: forward (compiled), backward, optimizer


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step on one GPU of the run, itemised: ``seconds`` = forward + backward + optimizer + exposed
    communication + pipeline bubble + all-to-all (``phases_s``), the kernels' time by op family (``families_s``,
    with "launch" for the time a phase waits on the CPU), the roofline bound no run of the step beats, and the
    model's error bar (relative, from its held-out validation).

    >>> t = step_time(per_gpu(workload, setup), load_catalog().get("h100-sxm"))   # doctest: +SKIP
    >>> t.seconds >= t.bound_s                                                     # doctest: +SKIP
    True
    """

    seconds: float
    phases_s: dict[str, float] = field(default_factory=dict)  # forward, backward, optimizer, communication, bubble
    families_s: dict[str, float] = field(default_factory=dict)  # kernel time by FAMILIES, plus "launch"
    comm_s: float = 0.0  # the step's collectives, if none were hidden
    exposed_comm_s: float = 0.0  # what the rest of the step did not hide (phases_s["communication"])
    mfu: float  # the step's FLOPs / (seconds x datasheet peak)
    basis: str  # every rate and efficiency used, and where it came from
    # the roofline bound (cost/roofline.py): max(FLOPs / peak, bytes / bandwidth) of the whole step, plus the
    # all-to-alls; None where the catalog lacks the rate it needs
    bound_s: float | None = None
    rates: Rates = "datasheet"  # the bound's (and the model's) peaks: the catalog's, or measured by bench --calibrate
    all_to_all_s: float = 0.0  # --ep: the MoE layers' all-to-alls (parallel.expert.AllToAll), never hidden
    error: float = ERROR_BAR  # the model's held-out median |predicted / measured - 1| (cost/validation.py)
    model: str = "kernels"  # "kernels" (cost/kernels.py) or "roofline" (cost/efficiency.py's shares)

    @property
    def bubble_s(self) -> float:
        return self.phases_s.get("bubble", 0.0)


def _rate_codes(c: OpCosts, step: PerGpu, acc: Accelerator) -> np.ndarray:
    """The precision each GEMM-like row runs in, as PyTorch runs it (an index into kernels.RATE_KEYS): autocast's
    GEMMs in its 16-bit dtype (fp16's rate where the GPU has no bf16: the row is flagged as emulated besides);
    ``_scaled_mm`` in fp8; GEMMs on fp32 operands in fp32 on the SIMT units, as ``torch.backends.cuda.matmul
    .allow_tf32`` is False by default, or TF32 where the precision turns it on; convolutions on fp32 operands in TF32
    where the GPU has it, as ``torch.backends.cudnn.allow_tf32`` is True by default."""
    keys = kernels.RATE_KEYS
    spec = step.setup.spec
    half = spec.compute if spec.compute in ("bf16", "fp16") else None
    if half == "bf16" and not acc.bf16:  # no bf16 tensor cores (the row is flagged emulated besides): fp16's rate
        half = "fp16"
    wide = "tf32" if spec.tf32 else "fp32"
    conv = "tf32" if acc.peak_tflops.get("tf32") else "fp32"
    code = np.full(len(c), keys.index(half or wide), dtype=np.int8)
    fp32_rows = (c.kind == MATMUL_FP32) | ((c.kind == ATTENTION) & (half is None))
    code[fp32_rows] = keys.index(wide)
    code[(c.kind == MATMUL_FP32) & (c.family == F_CONV)] = keys.index(conv)
    code[c.kind == MATMUL_FP8] = keys.index("fp8")
    return code


def _adjusted(step: PerGpu) -> tuple[np.ndarray, np.ndarray]:
    """The rows' FLOPs and bytes as this GPU runs them: an offloaded optimizer steps on the host (not timed); a
    sharded one steps its shard, in fp32 under mixed precision."""
    c, s = step.workload.costs, step.setup
    flops, nbytes = c.flops, c.bytes
    opt = c.phase == PHASES.index("optimizer")
    if s.training and s.offload != "none":
        flops, nbytes = np.where(opt, 0, flops), np.where(opt, 0, nbytes)
    elif s.training and s.shard_gpus > 1 and s.sharding != "ddp":
        widen = 4 / s.compute_dtype.itemsize if s.mixed else 1.0
        n = s.shard_gpus
        flops, nbytes = np.where(opt, flops * widen / n, flops), np.where(opt, nbytes * widen / n, nbytes)
    return flops, nbytes


def _calibrated(gpu: np.ndarray, c: OpCosts, codes: np.ndarray, chip: kernels.Chip,
                calibration: Calibration | None) -> tuple[np.ndarray, list[str]]:
    """Rows rescaled to what ``gpuwise bench --calibrate`` measured on this device: each GEMM rate by its measured
    best over the model's best (an 8192^3 GEMM), the memory-bound rows by the measured copy over the model's."""
    if calibration is None:
        return gpu, []
    notes = []
    big = np.array([8192.0])
    gemm = np.isin(c.family, [FAMILIES.index(f) for f in ("matmul", "bmm", "conv", "attention")])
    for key, measured in calibration.tflops.items():
        if key not in kernels.RATE_KEYS or not measured:
            continue
        code = kernels.RATE_KEYS.index(key)
        t = kernels.kernel_seconds(np.array([FAMILIES.index("matmul")], np.int8), np.array([code], np.int8),
                                   np.ones(1), big, big, big, 2 * big**3, 6 * big**2, chip)[0]
        model = 2 * 8192.0**3 / t / 1e12
        gpu = np.where(gemm & (codes == code), gpu * model / measured, gpu)
        notes.append(f"{key} GEMMs x{model / measured:.2f} (bench --calibrate {measured:g} TFLOPS)")
    if calibration.gbps:
        nbytes = np.array([2.0**31])
        t = kernels.kernel_seconds(np.array([FAMILIES.index("copy")], np.int8), np.zeros(1, np.int8), *np.zeros((4, 1)),
                                   np.zeros(1), nbytes, chip)[0]
        model = nbytes[0] / t / 1e9
        gpu = np.where(gemm, gpu, gpu * model / calibration.gbps)
        notes.append(f"memory-bound kernels x{model / calibration.gbps:.2f} (bench --calibrate "
                     f"{calibration.gbps:g} GB/s)")
    return gpu, notes


def _roofline_rows(step: PerGpu, acc: Accelerator, flops: np.ndarray, nbytes: np.ndarray,
                   calibration: Calibration | None, int8: bool) -> tuple[np.ndarray, str] | None:
    """Each row's time on the roofline at the coarse shares of cost/efficiency.py: for a GPU the kernel model
    cannot describe, and int8 inference. None: no rate for the run's precision, or no bandwidth."""
    c, s = step.workload.costs, step.setup
    key = "int8" if int8 else s.spec.rate_key
    datasheet = acc.peak_tflops.get(key)
    measured = calibration.tflops.get(key) if calibration is not None else None
    gbps_measured = calibration.gbps if calibration is not None else None
    share, power = (1.0, None) if measured else clock_share(acc)
    tflops = measured or (datasheet * share if datasheet else None)
    gbps = gbps_measured or acc.memory_bandwidth_gbps
    on_chip = not gbps and "sram" in (acc.memory_type or "").lower()  # Coral: memory on chip, never waited on
    if not tflops or not (gbps or on_chip):
        return None
    eta_mm, eta_at, eta_mem = (efficiency(k, acc) for k in ("matmul", "attention", "memory"))
    mm, at, mem = eta_mm.value, eta_at.value, eta_mem.value
    if measured:
        mm, at = min(1.0, mm / GEMM_CEILING), min(1.0, at / GEMM_CEILING)
    if gbps_measured:
        mem = min(1.0, mem / COPY_CEILING)
    if int8:
        nbytes = nbytes / s.compute_dtype.itemsize
    rate = tflops
    if s.spec.float8:
        fp8, hp = float8_rates(step, acc, tflops, calibration if measured else None, share)
        if hp is None:
            return None
        rate = np.where(c.kind == MATMUL_FP8, fp8, hp)
    wide = c.kind == MATMUL_FP32
    if not int8 and s.compute_dtype.itemsize < 4 and wide.any():
        fp32 = fp32_matmul_rate(step, acc, calibration if measured else None, share)[0]
        if fp32 is not None:
            rate = np.where(wide, fp32, rate)
    eta = np.where(c.kind == ATTENTION, at, mm)
    t = np.maximum(flops / (eta * rate * 1e12), 0 if on_chip else nbytes / (mem * (gbps or 1) * 1e9))
    if measured:
        what = f"{key} {tflops:g} TFLOPS measured (gpuwise bench --calibrate)"
    elif share < 1:
        what = (f"{key} {datasheet:g} TFLOPS datasheet x{share:.2f} (clock held at {acc.tdp_w:g} W: "
                f"{power.value:g} TFLOPS/W, {power.source})")
    else:
        what = f"{key} {datasheet:g} TFLOPS datasheet"
    mem_part = ("on-chip SRAM: no bandwidth figure, never waited on" if on_chip else
                f"{memory_class(acc)} {gbps:g} GB/s {'measured' if gbps_measured else 'datasheet'} x{mem:.2f} "
                f"({eta_mem.source})")
    return t, (f"roofline op by op (no SM facts for the kernel model): {what} x{mm:.2f} (matmul, {eta_mm.source}) "
               f"x{at:.2f} (attention, {eta_at.source}) · {mem_part}")


def _communication(step: PerGpu, acc: Accelerator, phases: dict[str, float], all_to_all
                   ) -> tuple[Comm, float] | None:
    """The step's collectives and pipeline schedule (cost/comm.py): data parallel overlapped with backward as DDP's
    buckets and FSDP's prefetch run, tensor parallel per block, the --ep all-to-alls, the pipeline's bubble and
    sends; and the all-to-alls' seconds. None: the run's GPUs have no link between them."""
    s = step.setup
    total = comm.data_parallel(step, acc, forward_s=phases["forward"], backward_s=phases["backward"])
    if total is None:
        return None
    if s.tp > 1:
        shape = comm.transformer_shape(step)
        tp = (comm.Comm(total_s=0.0, exposed_s=0.0, basis=f"tensor parallel {s.tp}: collectives not timed (the "
                        "capture does not give the blocks and width)") if shape is None
              else comm.tensor_parallel_step(step, acc, blocks=shape[0], hidden=shape[1]))
        if tp is None:
            return None
        total = total + tp
    if s.pp > 1:
        shape = comm.transformer_shape(step)
        m = s.grad_accum
        stage = (phases["forward"] + phases["backward"]) / m  # one micro-batch on this stage; the stages taken equal
        boundary = 0.0 if shape is None else comm.boundary_bytes(s, seq=step.workload.tokens_per_step // max(
            1, m * s.micro_batch) * s.cp, hidden=shape[1])
        pp = comm.pipeline(s, acc, stage_s=[stage] * s.pp, boundary=boundary)
        if pp is None:
            return None
        total = total + pp
    a2a_s = 0.0
    if all_to_all is not None:
        ep = comm.expert_parallel(all_to_all, acc, micro_batches=s.grad_accum, tp=s.tp)
        if ep is not None:
            total, a2a_s = total + ep, ep.exposed_s
    return total, a2a_s


def step_time(step: PerGpu, acc: Accelerator, *, calibration: Calibration | None = None,
              int8: bool = False, all_to_all=None) -> StepTime | None:
    """One optimizer step of ``step`` on one of ``step.setup.gpus`` ``acc``, kernel by kernel, plus the exposed
    collectives and the pipeline bubble. None: the GPU has no rate for the run's precision (bf16 before Ampere) or
    no bandwidth, or its GPUs no link between them.

    ``int8``: an inference step quantised to int8 end to end (edge NPUs, TensorRT INT8): the int8 rate (TOPS),
    and each op's bytes scaled from the captured 16-bit elements to one byte. ``all_to_all``: the --ep
    all-to-alls of the step (expert.AllToAll), added where ``acc`` has a link figure (the experts wait on them)."""
    if int8 and step.setup.training:
        raise ValueError("int8 costs inference steps only")
    s, c = step.setup, step.workload.costs
    key = "int8" if int8 else s.spec.rate_key
    if not (acc.peak_tflops.get(key) or (calibration is not None and calibration.tflops.get(key))):
        return None
    if s.spec.float8 and not acc.peak_tflops.get(s.spec.compute):
        return None
    flops, nbytes = _adjusted(step)
    chip = None if int8 else kernels.Chip.of(acc)
    parts = []
    if chip is not None:
        codes = _rate_codes(c, step, acc)
        b, m, n, k = c.dims.T
        gpu = kernels.kernel_seconds(c.family, codes, b, m, n, k, flops, nbytes, chip)
        if s.attention in kernels.ATTENTION_SHARE:  # the fused kernel's implementation (FlashAttention-2, flex, ...)
            gpu = np.where(c.kind == ATTENTION, gpu * kernels.ATTENTION_SHARE[s.attention], gpu)
        gpu, notes = _calibrated(gpu, c, codes, chip, calibration)
        parts.append(kernels.basis(chip))
        parts += notes
    else:
        got = _roofline_rows(step, acc, flops, nbytes, calibration, int8)
        if got is None:
            return None
        gpu, what = got
        parts.append(what)
    gpu = np.where(c.kind == NONE, 0.0, gpu) * c.count
    launch = LAUNCH_S[c.phase]
    if not s.compile and s.task != "decode":  # decode: as the serving runtimes run it (CUDA graphs, C++ loops)
        launch = np.where(c.phase == PHASES.index("forward"), kernels.forward_dispatch(c.family), launch)
    cpu = np.where((c.kind == NONE) | (c.family == F_FUSED), 0.0, launch) * c.count
    phases: dict[str, float] = {}
    launch_wait = 0.0
    for i, name in enumerate(PHASES):
        g, cp = float(gpu[c.phase == i].sum()), float(cpu[c.phase == i].sum())
        phases[name] = max(g, cp)
        launch_wait += max(0.0, cp - g)
    families = {f: float(gpu[c.family == i].sum()) for i, f in enumerate(FAMILIES) if (c.family == i).any()}
    families = {f: v for f, v in families.items() if v > 0}
    if launch_wait:
        families["launch"] = launch_wait
    fwd = ("5 us (inductor's wrapper)" if s.compile else "5 us (a serving runtime's)" if s.task == "decode"
           else "Python's dispatch as NeuSight measured it (25-67 us by family)")
    parts.append(f"host launches: a forward op {fwd}, a backward or optimizer one {LAUNCH_S[1] * 1e6:g} us (a phase "
                 "takes the longer of its kernels and its launches)")
    got = _communication(step, acc, phases, all_to_all)
    if got is None:
        return None
    comm, a2a_s = got
    phases["communication"], phases["bubble"] = comm.exposed_s, comm.bubble_s
    if comm.basis:
        parts.append(comm.basis)
    if s.offload != "none":
        parts.append("optimizer step on the host: not timed")
    seconds = sum(phases.values())
    bound = roofline_bound(step, acc, calibration, int8=int8)
    peak = acc.peak_tflops.get(key) or calibration.tflops[key]
    return StepTime(seconds=seconds, phases_s=phases, families_s=families, comm_s=comm.total_s,
                    exposed_comm_s=comm.exposed_s,
                    mfu=c.total_flops / (seconds * peak * 1e12), basis=" · ".join(parts),
                    bound_s=None if bound is None else bound.seconds + a2a_s,
                    rates="measured" if calibration is not None and calibration.tflops.get(key) else "datasheet",
                    all_to_all_s=a2a_s, model="kernels" if chip is not None else "roofline")
