"""How long a step takes on a GPU, and on N of them, with the basis of every number.

``step_time`` costs each op of the captured step on its own roofline (Williams et al. 2009): its FLOPs at an
efficiency times the peak of the run's precision, or its bytes at an efficiency times the memory bandwidth,
whichever takes longer, and never less than the CPU cost of launching it from eager PyTorch. Data parallelism
adds the collectives of DDP, ZeRO or FSDP at the NCCL bus bandwidth of the GPU's link, partly hidden behind
backward. ``StepTime`` is the one step time: ``plan``'s fit table, ``recommend``'s ranking and ``train``'s expected
step all read it; it carries the bare roofline of the whole step (cost/roofline.py) as its ``bound_s``.

>>> step_time(per_gpu(workload, setup), load_catalog().get("h100-sxm")).basis   # doctest: +SKIP
'bf16 989.5 TFLOPS datasheet x0.79 (clock held at 700 W: 1.11 TFLOPS/W, ...) x0.57 (matmul, ...) · ...'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.tracker import ATTENTION, MATMUL_FP8, MATMUL_FP32, NONE, PHASES
from gpuwise.planning.cost.roofline import Rates, float8_rates, fp32_matmul_rate, roofline_bound

if TYPE_CHECKING:
    from gpuwise.planning.parallel.sharding import PerGpu

MemoryClass = Literal["HBM", "GDDR", "unified", "other"]
MEMORY_CLASSES = ("HBM", "GDDR", "unified", "other")


@dataclass(frozen=True)
class Efficiency:
    value: float  # achieved / datasheet
    source: str


# THE table: achieved share of the datasheet rate, by op kind x memory class, and where an anchor shows it
# differs, x architecture: (kind, class, arch) wins over (kind, class). "matmul" is every FLOP-counted GEMM or
# convolution, "attention" the SDPA / flash kernels, "memory" the bytes of every kernel (elementwise, norms,
# optimizer foreach, and GEMMs that are memory-bound). The matmul share applies to the rate the board sustains
# at its power (POWER below), not to the datasheet's boost-clock rate: one share for Ampere and Hopper, the
# Hopper boards' lower MFU (torchtitan: 58% on A100, 33-39% on H100) being their clock held at 700 / 350 W.
# Fitting split (benchmarks/speed_validation.py FIT, benchmarks/recommend_order.py FIT): the matmul share on
# planner-anchors #5, #6, #13; POWER on one board per key of Lambda BERT-large; everything else is held out.
_FIT = "(planner-anchors §6; benchmarks/speed_validation.py)"
EFFICIENCY: dict[tuple[str, ...], Efficiency] = {
    ("matmul", "HBM"): Efficiency(0.57, f"fitted on anchors 5,13 (A100), 6 (H100) {_FIT}"),
    ("matmul", "GDDR"): Efficiency(0.57, "as HBM (a similar FLOP/byte ratio): no GDDR anchor in the fit set"),
    ("matmul", "unified"): Efficiency(0.57, "as HBM: no anchor"),
    ("matmul", "other"): Efficiency(0.57, "as HBM: no anchor"),
    ("attention", "HBM"): Efficiency(0.50, "FlashAttention-2, arXiv:2307.08691: forward 50-73% of A100 peak, "
                                            "backward lower; the low end"),
    ("attention", "GDDR"): Efficiency(0.50, "as HBM (FlashAttention-2)"),
    ("attention", "unified"): Efficiency(0.30, "assumed: no flash kernel on MPS, SDPA math path"),
    ("attention", "other"): Efficiency(0.40, "assumed"),
    ("memory", "HBM"): Efficiency(0.80, "assumed: large elementwise kernels, no anchor isolates it"),
    ("memory", "GDDR"): Efficiency(0.85, "assumed: GDDR reaches a larger share than HBM (decode fits, serving.py)"),
    ("memory", "unified"): Efficiency(0.70, "assumed"),
    ("memory", "other"): Efficiency(0.60, "assumed"),
}


# Power: a board holds the boost clock its datasheet tensor rate assumes only while the SMs' power fits its TDP.
# Lambda's 1-GPU fp16 BERT-large runs (compute-bound) reach 55% of the datasheet on a 350 W RTX 3090 (71 TFLOPS)
# and 16% on a 300 W RTX 6000 Ada (364 TFLOPS): the usable share follows watts per datasheet TFLOP. Model: at
# full tensor load the SMs draw ``peak / E`` watts at the boost clock, E a TFLOPS-per-watt of the silicon (its
# die and process, and how much of the board's power its memory takes: GDDR6X/GDDR6 I/O costs several times
# HBM's energy per bit), and power falls with the clock as P ~ f^POWER_EXPONENT, so the clock held is
# min(1, (E x TDP / peak)^(1 / POWER_EXPONENT)) of the boost clock. Keyed (memory class, architecture): one die
# family each in the catalog (HBM Ampere = GA100, GDDR Ampere = GA102, GDDR Ada = AD10x, HBM Hopper = GH100).
# Fitted on one power-capped board per key, Lambda BERT-large (benchmarks/recommend_order.py, FIT); every other
# board of the key is held out. No entry: the datasheet clock (no cap).
# POWER_EXPONENT 1 (the clock falls in proportion to the power cut): chosen on the fit points (minimax over a 0.01
# grid of E, with the matmul share refitted): exponent 1 fits them within 10%; exponent 2 (P ~ f V^2 with V ~ f^0.5)
# drove the matmul share to the grid's top (0.94) and missed anchors 5, 6 by 21-24%. Blackwell and older
# architectures have no Lambda board in the fit set: no cap (their datasheet clock).
POWER_EXPONENT = 1.0
_LB = "Lambda BERT-large fp16 (benchmarks/recommend_order.py FIT)"
POWER: dict[tuple[str, str], Efficiency] = {
    ("HBM", "Ampere"): Efficiency(0.84, f"fitted on a100-40gb-pcie 250 W, {_LB}"),
    ("GDDR", "Ampere"): Efficiency(0.50, f"fitted on a10 150 W, {_LB}"),
    ("GDDR", "Ada"): Efficiency(0.46, f"fitted on rtx-6000-ada 300 W, {_LB}"),
    ("HBM", "Hopper"): Efficiency(1.11, f"fitted on h100-pcie 350 W, {_LB}"),
}


def clock_share(acc: Accelerator) -> tuple[float, Efficiency | None]:
    """The share of its datasheet tensor rate ``acc`` holds under sustained load at its board power, and the
    POWER entry it came from (None: no entry, or no TDP or 16-bit rate in the catalog: 1)."""
    arch = (acc.arch or "").split(" ")[0]
    entry = POWER.get((memory_class(acc), arch))
    peak = acc.peak_tflops.get("bf16") or acc.peak_tflops.get("fp16")
    if entry is None or not acc.tdp_w or not peak:
        return 1.0, entry
    return min(1.0, (entry.value * acc.tdp_w / peak) ** (1 / POWER_EXPONENT)), entry


def efficiency(kind: str, acc: Accelerator) -> Efficiency:
    """The table's entry for ``kind`` on ``acc``: its architecture's if the table has one, else its memory class's."""
    cls = memory_class(acc)
    arch = (acc.arch or "").split(" ")[0]
    return EFFICIENCY.get((kind, cls, arch)) or EFFICIENCY[(kind, cls)]


# With a stored calibration the peak and bandwidth are what ``gpuwise bench --calibrate`` measured (its best large
# GEMM, its device copy), so the share applied is achieved / measured = the table's value / the share those
# benchmarks reach of the datasheet on the GPUs the table was fitted on (assumed: cuBLAS bf16 GEMMs ~0.8 of the
# A100/H100 datasheet, copies ~0.9), capped at 1. The datasheet share is never applied twice.
GEMM_CEILING = 0.80
COPY_CEILING = 0.90

# Eager PyTorch spends ~5-25 us of CPU per op before its kernel runs (dispatcher, autograd, cudaLaunchKernel;
# jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html); the low end, as backward runs
# in C++. An op takes at least this long: a tiny model is launch-bound.
LAUNCH_S = 5e-6

# NCCL bus bandwidth when the catalog has no measured figure. NVLink/NVSwitch: line rate per direction (half the
# bidirectional figure vendors quote) less ~20% protocol overhead: 8x H100 450 GB/s line -> ~370 GB/s ring busbw
# (sjeaugey, NVIDIA/nccl-tests#212).
NVLINK_EFFICIENCY = Efficiency(0.82, "nccl-tests#212: 370 of 450 GB/s")
# PCIe without a peer link: traffic goes through the host; 8x / 4x RTX 5090 on PCIe 5.0 x16 (64 GB/s per
# direction) reach 28 / 35 GB/s busbw (NVIDIA/nccl#1639).
PCIE_EFFICIENCY = Efficiency(0.50, "nccl#1639: 28-35 of 64 GB/s")
_PCIE_GBPS_PER_LANE = {"3.0": 0.985, "4.0": 1.969, "5.0": 3.938, "6.0": 7.563}  # per direction (PCI-SIG)
# Beyond one node: 400 Gb/s InfiniBand per GPU (DGX H100: 8x ConnectX-7 400 Gb/s, NVIDIA DGX H100 user guide)
# = 50 GB/s, at the NVLink protocol share (assumed). Other boxes: one 100 Gb/s Ethernet port a node (assumed),
# which a ring crosses once per node.
NETWORK_GBPS_PER_GPU = 50.0
NETWORK_GBPS_OTHER = 12.5
NETWORK_EFFICIENCY = 0.82
# Share of the backward (FSDP: forward + backward) compute that collectives can hide behind (assumed; torchtitan
# anchors #3/#4 lose 3% going from 8 to 128 H100s, so most of it is hidden).
OVERLAP = 0.8
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default: the last bucket's all-reduce is never hidden


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step on one GPU of the run, itemised: ``seconds`` = (compute + memory + launch + exposed comm)
    / (1 - pipeline bubble) + all-to-all, and the roofline bound no run of the step beats.

    >>> t = step_time(per_gpu(workload, setup), load_catalog().get("h100-sxm"))   # doctest: +SKIP
    >>> t.seconds >= t.bound_s                                                     # doctest: +SKIP
    True
    """

    seconds: float
    compute_s: float  # ops bound by their FLOPs
    memory_s: float  # ops bound by their bytes
    launch_s: float  # ops bound by the launch floor
    comm_s: float  # collectives, if none were hidden
    exposed_comm_s: float  # what backward did not hide
    mfu: float  # the step's FLOPs / (seconds x datasheet peak)
    basis: str  # every rate and efficiency used, and where it came from
    # the roofline bound (cost/roofline.py): max(FLOPs / peak, bytes / bandwidth) of the whole step, plus the
    # all-to-alls; None where the catalog lacks the rate it needs
    bound_s: float | None = None
    rates: Rates = "datasheet"  # the bound's (and the model's) peaks: the catalog's, or measured by bench --calibrate
    all_to_all_s: float = 0.0  # --ep: the MoE layers' all-to-alls (parallel.expert.AllToAll), never hidden


@dataclass(frozen=True, kw_only=True)
class Link:
    busbw_gbps: float
    source: str


def memory_class(acc: Accelerator) -> MemoryClass:
    """HBM, GDDR, unified (Apple, Jetson) or other, from the catalog's memory type."""
    kind = (acc.memory_type or "").lower()
    if "hbm" in kind:
        return "HBM"
    if "gddr" in kind:
        return "GDDR"
    if "unified" in kind or "lpddr" in kind:
        return "unified"
    return "other"


def node_gpus(acc: Accelerator) -> int:
    """GPUs in one box: the catalog's figure, else 8 (an HGX board, or a PCIe server), 1 for a SoC."""
    n = getattr(acc, "node_gpus", None)
    if n:
        return int(n)
    return 1 if (acc.interconnect or "none").startswith("none") else 8


def _pcie_gbps(link: str | None) -> float | None:
    m = re.search(r"PCIe (\d\.\d)(?: x(\d+))?", link or "")
    if m is None or m.group(1) not in _PCIE_GBPS_PER_LANE:
        return None
    return _PCIE_GBPS_PER_LANE[m.group(1)] * int(m.group(2) or 16)


def allreduce_link(acc: Accelerator, gpus: int, *, measured_ok: bool = True) -> Link | None:
    """The all-reduce bus bandwidth of ``gpus`` of ``acc``: measured when the catalog has it (and ``measured_ok``),
    else derived from the link; across nodes the network's share per GPU caps it. None: the GPU has no link to
    another."""
    measured = getattr(acc, "allreduce_busbw_gbps", None) if measured_ok else None
    bridge = "2-way" in (acc.interconnect or "")
    if measured:
        intra = Link(busbw_gbps=float(measured),
                     source=f"all-reduce {measured:g} GB/s busbw "
                            f"({getattr(acc, 'allreduce_source', None) or 'catalog'})")
    elif acc.peer_link and acc.interconnect_gbps and not (bridge and gpus > 2):
        bw = acc.interconnect_gbps / 2 * NVLINK_EFFICIENCY.value
        intra = Link(busbw_gbps=bw, source=f"all-reduce {bw:.0f} GB/s busbw ({acc.interconnect} "
                                           f"{acc.interconnect_gbps:g}/2 x{NVLINK_EFFICIENCY.value}, "
                                           f"{NVLINK_EFFICIENCY.source})")
    else:
        pcie = _pcie_gbps(acc.interconnect) or _pcie_gbps(acc.host_link)
        if pcie is None:
            return None
        bw = pcie * PCIE_EFFICIENCY.value
        intra = Link(busbw_gbps=bw, source=f"all-reduce {bw:.0f} GB/s busbw (PCIe {pcie:.0f} GB/s/dir "
                                           f"x{PCIE_EFFICIENCY.value}, {PCIE_EFFICIENCY.source})")
    if gpus <= node_gpus(acc):
        return intra
    dc = acc.segment == "datacenter"
    net = (NETWORK_GBPS_PER_GPU if dc else NETWORK_GBPS_OTHER) * NETWORK_EFFICIENCY
    if net >= intra.busbw_gbps:
        return intra
    what = "400 Gb/s IB per GPU, DGX H100 guide" if dc else "100 Gb/s Ethernet a node, assumed"
    return Link(busbw_gbps=net, source=f"all-reduce {net:.0f} GB/s busbw across nodes ({what}, x{NETWORK_EFFICIENCY})")


def comm_bytes(step: PerGpu) -> tuple[float, float]:
    """Bytes each GPU sends per optimizer step, at the bus bandwidth's accounting (NVIDIA/nccl-tests
    PERFORMANCE.md: all-reduce 2(n-1)/n x S, reduce-scatter and all-gather (n-1)/n x S each), and the bytes
    that can never hide (the last DDP bucket, or one FSDP block's gather).

    DDP all-reduces the gradients (in the weights' dtype) once per step (no_sync on the other micro-batches);
    ZeRO-1/2 reduce-scatter 16-bit gradients and all-gather the updated 16-bit parameters; FSDP all-gathers
    the 16-bit parameters in forward and again in backward on every micro-batch and reduce-scatters the
    gradients (fp32 under mixed precision, training/parallelize.py) once per step: 1.5x DDP in one dtype.

    Under --ep the routed experts' ``Pe`` parameters (the GPU's, ``expert_params``) are held by only n / ep of the
    n = dp x cp data-parallel ranks (torchtitan's ``dp_shard_mod_ep`` mesh, as sharding.py shards them), so their
    collectives run over that group: share (n - 1) / n for the other ``Pn`` parameters, (n/ep - 1) / (n/ep) for
    ``Pe`` (none when ep = n: every rank holds its own experts):

        DDP       2 [share Pn + share_e Pe] x weight bytes
        ZeRO-1/2  2 [share Pn + share_e Pe] x 16-bit bytes
        FSDP      share (2 accum Pn_all x 16-bit + Pn x grad bytes) + share_e (2 accum Pe x 16-bit + Pe x grad bytes)

    (Pn of the trainable parameters; Pn_all of all of them)."""
    s = step.setup
    n = s.dp * s.cp  # the gradient-reducing group; tensor, pipeline and ring traffic is not timed (planning/parallel/)
    if n == 1 or not s.training:
        return 0.0, 0.0
    w = step.workload
    share = (n - 1) / n
    pe = w.expert_params if s.ep > 1 and w.expert_params <= w.trainable_params else 0
    group = n // s.ep if pe else n  # the ranks that hold the same experts
    share_e = (group - 1) / group
    half = s.compute_dtype.itemsize

    def split(params: int) -> float:  # params' worth of one collective's bytes share, the experts over their group
        return share * (params - pe) + share_e * pe

    if s.sharding == "ddp":
        grads = w.trainable_params * s.weight_dtype.itemsize
        return 2 * split(w.trainable_params) * s.weight_dtype.itemsize, 2 * share * min(grads, DDP_BUCKET_BYTES)
    if s.sharding in ("zero1", "zero2"):
        total = split(w.trainable_params) * half * 2
        return total, 2 * share * min(w.trainable_params * half, DDP_BUCKET_BYTES)
    grad_bytes = 4 if s.mixed else half
    total = split(w.trainable_params) * grad_bytes + 2 * s.grad_accum * split(w.params) * half
    return total, share * (w.block_bytes + w.block_trainable_params * grad_bytes)


def all_to_all_time(a2a, acc: Accelerator) -> tuple[float, Link] | None:
    """Seconds the --ep all-to-alls (parallel.expert.AllToAll) take a step on ``acc``: the bytes the busiest GPU moves
    each way (``AllToAll.busiest``, the (ep - 1) / ep that leave the GPU) over the bus bandwidth of the ``ep``
    GPUs' link (the node's; the network's share where ep is more GPUs than a node has). NCCL's all-to-all bus
    bandwidth is taken as the link's per direction x efficiency (``allreduce_link``'s derived figure, not a
    measured all-reduce's: NVLink SHARP speeds up all-reduce, not all-to-all). Not hidden: the experts wait on the
    dispatch and the next layer on the combine. None: the GPU has no link figure."""
    link = allreduce_link(acc, a2a.ep, measured_ok=False)
    if link is None:
        return None
    link = Link(busbw_gbps=link.busbw_gbps, source=link.source.replace("all-reduce", "all-to-all", 1))
    return a2a.busiest / (link.busbw_gbps * 1e9), link


def _peak(step: PerGpu, acc: Accelerator, calibration: Calibration | None, int8: bool = False):
    key = "int8" if int8 else step.setup.spec.rate_key
    datasheet = acc.peak_tflops.get(key)
    measured = calibration.tflops.get(key) if calibration is not None else None
    gbps_measured = calibration.gbps if calibration is not None else None
    return key, datasheet, measured, gbps_measured


def step_time(step: PerGpu, acc: Accelerator, *, calibration: Calibration | None = None,
              int8: bool = False, all_to_all=None) -> StepTime | None:
    """One optimizer step of ``step`` on one of ``step.setup.gpus`` ``acc``, op by op, plus the exposed
    collectives. None: the GPU has no rate for the run's precision (bf16 before Ampere) or no bandwidth.

    ``int8``: an inference step quantised to int8 end to end (edge NPUs, TensorRT INT8): the int8 rate (TOPS),
    and each op's bytes scaled from the captured 16-bit elements to one byte. ``all_to_all``: the --ep
    all-to-alls of the step (expert.AllToAll), added where ``acc`` has a link figure (the experts wait on them)."""
    if int8 and step.setup.training:
        raise ValueError("int8 costs inference steps only")
    key, datasheet, measured, gbps_measured = _peak(step, acc, calibration, int8)
    share, power = (1.0, None) if measured else clock_share(acc)  # a measured GEMM already ran at the board's clock
    tflops = measured or (datasheet * share if datasheet else None)
    gbps = gbps_measured or acc.memory_bandwidth_gbps
    # a chip whose memory is its on-chip SRAM (Coral) publishes no bandwidth: a step that fits never waits on it
    on_chip = not gbps and "sram" in (acc.memory_type or "").lower()
    if not tflops or not (gbps or on_chip):
        return None
    cls = memory_class(acc)
    eta_mm, eta_at, eta_mem = (efficiency(k, acc) for k in ("matmul", "attention", "memory"))
    mm, at, mem = eta_mm.value, eta_at.value, eta_mem.value
    if measured:
        mm, at = min(1.0, mm / GEMM_CEILING), min(1.0, at / GEMM_CEILING)
    if gbps_measured:
        mem = min(1.0, mem / COPY_CEILING)
    c = step.workload.costs
    s = step.setup
    flops, nbytes = c.flops, c.bytes
    if int8:
        nbytes = nbytes / s.compute_dtype.itemsize
    opt = c.phase == PHASES.index("optimizer")
    if s.training and s.offload != "none":  # the step runs on the host (its time there is not modelled)
        flops, nbytes = np.where(opt, 0, flops), np.where(opt, 0, nbytes)
    elif s.training and s.shard_gpus > 1 and s.sharding != "ddp":  # each GPU steps its shard, fp32 under mixed
        widen = 4 / s.compute_dtype.itemsize if s.mixed else 1.0
        n = s.shard_gpus
        flops, nbytes = np.where(opt, flops * widen / n, flops), np.where(opt, nbytes * widen / n, nbytes)
    eta = np.where(c.kind == ATTENTION, at, mm)
    rate = tflops
    if s.spec.float8:
        fp8, hp = float8_rates(step, acc, tflops, calibration if measured else None, share)
        if hp is None:
            return None
        rate = np.where(c.kind == MATMUL_FP8, fp8, hp)
    fp32_part = None
    wide = c.kind == MATMUL_FP32
    wide_flops = float(flops[wide] @ c.count[wide])
    if not int8 and s.compute_dtype.itemsize < 4 and wide_flops:
        fp32, what = fp32_matmul_rate(step, acc, calibration if measured else None, share)
        if fp32 is not None:
            rate = np.where(wide, fp32, rate)
        fp32_part = (f"{wide_flops:.3g} FLOPs of matmuls on fp32 operands (autocast leaves "
                     f"them: a MoE's grouped experts, rotary tables) at {what}")
    t_compute = flops / (eta * rate * 1e12)
    t_memory = np.zeros_like(nbytes) if on_chip else nbytes / (mem * gbps * 1e9)
    t_launch = np.where(c.kind == NONE, 0.0, LAUNCH_S)
    times = np.stack([t_compute, t_memory, t_launch])
    bound = times.argmax(axis=0)
    per_op = times.max(axis=0) * c.count
    compute_s, memory_s, launch_s = (float(per_op[bound == i].sum()) for i in range(3))
    comm_s = exposed = 0.0
    link = None
    volume, tail = comm_bytes(step)
    if volume:
        link = allreduce_link(acc, s.gpus)
        if link is None:
            return None
        comm_s = volume / (link.busbw_gbps * 1e9)
        phases = (1,) if s.sharding != "fsdp" else (0, 1)
        window = float((times.max(axis=0) * c.count)[np.isin(c.phase, phases)].sum())
        exposed = max(comm_s - OVERLAP * window, tail / (link.busbw_gbps * 1e9))
    seconds = compute_s + memory_s + launch_s + exposed
    bubble = s.pipeline_bubble  # 1F1B: each stage idles (pp - 1) of the (m + pp - 1) slots of a step
    seconds /= 1 - bubble
    a2a_s, a2a = 0.0, None if all_to_all is None else all_to_all_time(all_to_all, acc)
    if a2a is not None:
        a2a_s = a2a[0]
        seconds += a2a_s
    bound = roofline_bound(step, acc, calibration, int8=int8)
    peak = datasheet or tflops
    if measured:
        rate = f"{key} {tflops:g} TFLOPS measured (gpuwise bench --calibrate)"
    elif share < 1:
        rate = (f"{key} {datasheet:g} TFLOPS datasheet x{share:.2f} (clock held at {acc.tdp_w:g} W: "
                f"{power.value:g} TFLOPS/W, {power.source})")
    else:
        rate = f"{key} {datasheet:g} TFLOPS datasheet"
    parts = [f"{rate} x{mm:.2f} (matmul, {eta_mm.source}) x{at:.2f} (attention, {eta_at.source})",
             "on-chip SRAM: no bandwidth figure, never waited on" if on_chip else
             f"{cls} {gbps:g} GB/s {'measured' if gbps_measured else 'datasheet'} x{mem:.2f} ({eta_mem.source})",
             f"launch {LAUNCH_S * 1e6:g} us/op (eager PyTorch)"]
    if fp32_part is not None:
        parts.append(fp32_part)
    if link is not None:
        parts.append(f"{s.sharding} over {s.gpus}: {link.source}, {OVERLAP:.0%} of "
                     f"{'forward+backward' if s.sharding == 'fsdp' else 'backward'} hides it (assumed)")
    if bubble:
        parts.append(f"pipeline bubble {bubble:.0%} ((pp - 1) / (micro-batches + pp - 1), 1F1B)")
    if a2a is not None:
        parts.append(f"--ep all-to-alls: {a2a[1].source}, not hidden")
    if s.offload != "none":
        parts.append("optimizer step on the host: not timed")
    return StepTime(seconds=seconds, compute_s=compute_s, memory_s=memory_s, launch_s=launch_s, comm_s=comm_s,
                    exposed_comm_s=exposed, mfu=c.total_flops / (seconds * peak * 1e12),
                    basis=" · ".join(parts), bound_s=None if bound is None else bound.seconds + a2a_s,
                    rates=bound.rates if bound is not None else "measured" if measured else "datasheet",
                    all_to_all_s=a2a_s)
