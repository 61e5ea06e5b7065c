"""Multi-GPU time: collectives priced from measured tables, and how DDP, ZeRO, FSDP, pipeline, tensor and expert
parallelism expose them.

``collective_seconds`` times one NCCL collective: from OpenXLA's measured table where the GPU's architecture has one
(data/collectives.json, interpolated by size and group), else from its link with the latency and line-rate share
fitted on that table (``link_seconds``; scripts/derive_collectives.py prints the fit and its held-out error). Sizes
follow nccl-tests (PERFORMANCE.md): all-reduce and all-to-all their buffer, all-gather its output, reduce-scatter
its input, send/recv its message; bus bandwidth = size x ``bus_factor`` / seconds.

The schedules return a ``Comm``: the collectives' seconds, the part the step waits on, and a pipeline's bubble, which
the step adds to its forward, backward and optimizer phases.

>>> collective_seconds("all-reduce", 2**30, 8, load_catalog().get("h100-sxm")).busbw_gbps   # doctest: +SKIP
398.0
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from gpuwise.hardware.catalog import Accelerator
    from gpuwise.planning.parallel.expert import AllToAll
    from gpuwise.planning.parallel.sharding import PerGpu
    from gpuwise.planning.setup import Setup

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv")
MiB = 2**20
_XLA = "OpenXLA measured table"

# torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and the first bucket 1 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) so that the first all-reduce starts early.
DDP_BUCKET_BYTES = 25 * MiB
DDP_FIRST_BUCKET_BYTES = 1 * MiB
# DeepSpeed ZeRO-1/2: reduce_bucket_size 5e8 elements (its default), reduced as its buckets fill with overlap_comm on
# (as DeepSpeed's ZeRO-2 examples and Hugging Face Accelerate's configs set it); the updated parameters are
# all-gathered after the optimizer step (allgather_bucket_size 5e8), which nothing hides.
ZERO_BUCKET_ELEMENTS = 5e8
# Compute beside a running collective runs on the SMs NCCL leaves it: an ncclAllGather took 24 of an H100's 132 SMs
# beside a GEMM (forums.developer.nvidia.com/t/337991), so overlapped compute loses that share for as long as the
# collective runs. Assumed for every GPU (NCCL's channels follow the link, not the SM count).
NCCL_SM_SHARE = 24 / 132

# PCIe without a peer link goes through the host: 8x / 4x RTX 5090 on PCIe 5.0 x16 (64 GB/s per direction) reach
# 28 / 35 GB/s busbw (NVIDIA/nccl#1639), 0.44-0.55 of the line rate.
PCIE_EFFICIENCY = 0.50
_PCIE_GBPS_PER_LANE = {"3.0": 0.985, "4.0": 1.969, "5.0": 3.938, "6.0": 7.563}  # per direction (PCI-SIG)
# Beyond one box: 400 Gb/s InfiniBand per GPU (DGX H100: 8x ConnectX-7, NVIDIA DGX H100 user guide) = 50 GB/s;
# other boxes one 100 Gb/s Ethernet port (assumed), which a ring crosses once per node. Both at 0.82 of line rate
# (assumed: the NVLink ring's 370 of 450 GB/s, NVIDIA/nccl-tests#212).
NETWORK_GBPS_PER_GPU = 50.0
NETWORK_GBPS_PER_NODE = 12.5
NETWORK_EFFICIENCY = 0.82
PCIE_BOX_GPUS = 8  # a PCIe server holds 8 cards whatever its bridges pair (catalog node_gpus is the bridged group)

# Catalog rows whose GPUs the table measured: the HGX / NVL boards, not the bridged PCIe cards of the same chip.
TABLE_ARCH = {"h100-sxm": "sm_90", "h200": "sm_90", "h20": "sm_90", "b200": "sm_100_B200", "gb200": "sm_100_GB200",
              "b300": "sm_103", "gb300": "sm_103", "mi355x": "gfx950"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``op`` over ``n`` GPUs (PERFORMANCE.md): what each GPU's
    link carries per byte of the collective's size."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")
    if op == "send/recv" or n <= 1:
        return 1.0 if op == "send/recv" else 0.0
    return (2 if op == "all-reduce" else 1) * (n - 1) / n


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective's time and the bus bandwidth it reached (size x bus_factor / seconds)."""

    seconds: float
    busbw_gbps: float
    source: str


@dataclass(frozen=True, kw_only=True)
class Comm:
    """The communication of a step: every collective's seconds, the part the step waits on (its communication
    phase), and the pipeline's idle time (its bubble phase).

    >>> (Comm(total_s=1.0, exposed_s=0.2, basis="ddp") + Comm(total_s=0.5, exposed_s=0.5, basis="tp")).exposed_s
    0.7
    """

    total_s: float
    exposed_s: float
    bubble_s: float = 0.0
    basis: str = ""

    def __add__(self, other: Comm) -> Comm:
        return Comm(total_s=self.total_s + other.total_s, exposed_s=self.exposed_s + other.exposed_s,
                    bubble_s=self.bubble_s + other.bubble_s,
                    basis=" · ".join(b for b in (self.basis, other.basis) if b))


NO_COMM = Comm(total_s=0.0, exposed_s=0.0)


@dataclass(frozen=True, kw_only=True)
class Link:
    """What one GPU's collectives cross: per direction, GB/s. ``switch``: any group reaches the whole rate (NVSwitch,
    NVL72, and taken so for other peer fabrics); ``mesh``: one of ``links`` links to each peer (AMD Infinity Fabric),
    so n GPUs reach (n - 1) / links of it; ``pcie`` through the host; ``network`` between boxes; ``measured``: a
    catalog bus bandwidth (all-reduce). ``efficiency`` None: the table's fit for the op."""

    kind: Literal["switch", "mesh", "pcie", "network", "measured"]
    gbps: float
    links: int = 1
    efficiency: float | None = None
    source: str


@functools.cache
def _data() -> dict:
    return json.loads(resources.files("gpuwise.planning.cost").joinpath("data/collectives.json").read_text())


def link_fit(op: str) -> tuple[float, float]:
    """(alpha seconds, efficiency) of ``op`` fitted on the table (scripts/derive_collectives.py, ``link_fit``)."""
    f = _data()["link_fit"]["ops"][op]
    return f["alpha_us"] * 1e-6, f["efficiency"]


def link_seconds(op: str, nbytes, n: int, link: Link, *, alpha_s: float | None = None,
                 efficiency: float | None = None):
    """alpha + size x bus_factor / (efficiency x bandwidth): ``op`` of ``nbytes`` (a number or an array) over ``n``
    GPUs on ``link``; ``alpha_s`` and ``efficiency`` default to the fit's (``link.efficiency`` wins over it)."""
    if alpha_s is None or efficiency is None:
        fitted_alpha, fitted_eff = link_fit(op)
        alpha_s = fitted_alpha if alpha_s is None else alpha_s
        efficiency = fitted_eff if efficiency is None else efficiency
    eff = link.efficiency if link.efficiency is not None else efficiency
    gbps = link.gbps * (min(n - 1, link.links) / link.links if link.kind == "mesh" else 1.0)
    return alpha_s + np.asarray(nbytes, dtype=float) * bus_factor(op, n) / (eff * gbps * 1e9)


@functools.cache
def _curves(arch: str, op: str, dtype: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{group: (log bytes, log seconds)} of ``op`` on ``arch``, the rows in ``dtype`` where the table has them, else
    f32; send/recv in its one-way pattern (a stage's send beside the others'), else mutual, else ring."""
    rows = [r for r in _data()["rows"] if r[0] == arch and r[1] == op]
    dtypes = {r[3] for r in rows}
    rows = [r for r in rows if r[3] == (dtype if dtype in dtypes else "f32")]
    if op == "send/recv":
        pattern = next(p for p in ("one-way", "mutual", "ring") if any(r[2] == p for r in rows))
        rows = [r for r in rows if r[2] == pattern]
    out = {}
    for group in sorted({2 if op == "send/recv" else r[4] for r in rows}):
        pts = sorted((r[6], r[6] / r[7]) for r in rows if op == "send/recv" or r[4] == group)
        out[group] = (np.log([p[0] for p in pts]), np.log([p[1] for p in pts]))
    return out


def _table_seconds(arch: str, op: str, nbytes: np.ndarray, n: int, dtype: str) -> np.ndarray:
    """Seconds of ``op`` over ``n`` GPUs from the table: log time interpolated in log size between the measured
    sizes (below the smallest, its time: latency-bound; above the largest, its bandwidth), and across groups the
    bus bandwidth interpolated linearly in the group (clamped to the groups measured)."""
    curves = _curves(arch, op, dtype)
    size = np.maximum(np.asarray(nbytes, dtype=float), 1.0)

    def at(group: int) -> np.ndarray:
        logb, logt = curves[group]
        t = np.exp(np.interp(np.log(size), logb, logt))
        return np.where(size > np.exp(logb[-1]), t * size / np.exp(logb[-1]), t)

    groups = sorted(curves)
    if op == "send/recv" or n in curves:
        return at(groups[0] if op == "send/recv" else n)
    lo = max([g for g in groups if g < n], default=groups[0])
    hi = min([g for g in groups if g > n], default=groups[-1])
    busbw = [size * bus_factor(op, g) / at(g) for g in (lo, hi)]
    w = 0.0 if hi == lo else (n - lo) / (hi - lo)
    return size * bus_factor(op, n) / ((1 - w) * busbw[0] + w * busbw[1])


def box_gpus(acc: Accelerator) -> int:
    """GPUs in one server: the NVLink/NVSwitch domain the catalog gives (8 on an HGX board, 72 on an NVL72 rack), 8
    for PCIe cards whatever their bridges pair, 1 for a SoC."""
    link = acc.interconnect or "none"
    if link.startswith("none"):
        return 1
    if acc.peer_link and "2-way" not in link:
        return acc.node_gpus
    return max(PCIE_BOX_GPUS, acc.node_gpus)


def _pcie_gbps(link: str | None) -> float | None:
    m = re.search(r"PCIe (\d\.\d)(?: x(\d+))?", link or "")
    if m is None or m.group(1) not in _PCIE_GBPS_PER_LANE:
        return None
    return _PCIE_GBPS_PER_LANE[m.group(1)] * int(m.group(2) or 16)


def intra_link(acc: Accelerator, n: int, op: str = "all-reduce") -> Link | None:
    """The link ``n`` GPUs of ``acc`` in one box cross: the catalog's measured all-reduce bus bandwidth for an
    all-reduce over at most the GPUs it was measured on; the peer link (a 2-way bridge only for a pair); else PCIe
    through the host. None: no link to another GPU."""
    ic = acc.interconnect or ""
    measured = getattr(acc, "allreduce_busbw_gbps", None)
    if op == "all-reduce" and measured and n <= acc.node_gpus:
        return Link(kind="measured", gbps=float(measured), efficiency=1.0,
                    source=f"{measured:g} GB/s busbw measured ({getattr(acc, 'allreduce_source', None) or 'catalog'})")
    if acc.peer_link and acc.interconnect_gbps and not ("2-way" in ic and n > 2):
        mesh = re.search(r"Infinity Fabric \((\d+) links\)", ic)
        kind, links = ("mesh", int(mesh.group(1))) if mesh else ("switch", 1)
        return Link(kind=kind, gbps=acc.interconnect_gbps / 2, links=links,
                    source=f"{ic} {acc.interconnect_gbps:g}/2 GB/s ({kind})")
    pcie = _pcie_gbps(ic) or _pcie_gbps(acc.host_link)
    if pcie is None or ic.startswith("none") or not ic:
        return None
    return Link(kind="pcie", gbps=pcie, efficiency=PCIE_EFFICIENCY,
                source=f"PCIe {pcie:.0f} GB/s/dir through the host x{PCIE_EFFICIENCY} (nccl#1639)")


def network_link(acc: Accelerator) -> Link:
    """Between boxes: 400 Gb/s InfiniBand per GPU on a datacenter board, else 100 Gb/s Ethernet a node (assumed)."""
    dc = acc.segment == "datacenter"
    gbps = NETWORK_GBPS_PER_GPU if dc else NETWORK_GBPS_PER_NODE
    what = "400 Gb/s IB per GPU, DGX H100 guide" if dc else "100 Gb/s Ethernet a node, assumed"
    return Link(kind="network", gbps=gbps, efficiency=NETWORK_EFFICIENCY,
                source=f"across boxes {gbps:g} GB/s ({what}) x{NETWORK_EFFICIENCY}")


def _seconds(op: str, nbytes, gpus: int, acc: Accelerator, dtype: str, nodes: int | None):
    """(seconds array, source) of ``op`` of ``nbytes`` (an array) over ``gpus`` > 1 of ``acc`` spread over ``nodes``
    boxes (default: as few as hold them); across boxes the slower of the box's share and the network. None: no link."""
    box = box_gpus(acc)
    nodes = nodes or math.ceil(gpus / box)
    local = max(1, math.ceil(gpus / nodes)) if op != "send/recv" else (1 if nodes > 1 else 2)
    arch = TABLE_ARCH.get(getattr(acc, "key", ""))
    t, parts = 0.0, []
    if local > 1:
        if arch is not None:
            t = _table_seconds(arch, op, nbytes, local, dtype)
            parts.append(f"{_XLA} {arch}, {local} GPUs")
        else:
            link = intra_link(acc, local, op)
            if link is None:
                return None
            t = link_seconds(op, nbytes, local, link)
            alpha, eff = link_fit(op)
            share = "" if link.kind in ("measured", "pcie") else f" x{eff:.2f}"
            parts.append(f"{link.source}{share}, {alpha * 1e6:.0f} us latency (fitted on {_XLA}s: "
                         "scripts/derive_collectives.py)")
    if nodes > 1:
        net = network_link(acc)
        t = np.maximum(t, link_seconds(op, nbytes, gpus, net))
        parts.append(f"{net.source} over {nodes} boxes")
    return np.asarray(t, dtype=float), "; ".join(parts)


def collective_seconds(op: str, nbytes: float, gpus: int, acc: Accelerator, *, dtype: str = "f32",
                       nodes: int | None = None) -> Collective | None:
    """One ``op`` of ``nbytes`` (nccl-tests' size) over ``gpus`` of ``acc``, on ``nodes`` boxes (default: as few as
    hold them); ``dtype`` f32 or bf16 picks the table's rows where it measured both. None: no link to another GPU.

    >>> collective_seconds("all-reduce", 2**30, 8, load_catalog().get("h100-sxm")).source   # doctest: +SKIP
    'all-reduce 1.07e+09 B: OpenXLA measured table sm_90, 8 GPUs'
    """
    if (gpus <= 1 and op != "send/recv") or nbytes <= 0:
        return Collective(seconds=0.0, busbw_gbps=0.0, source=f"{op}: nothing to move")
    if box_gpus(acc) == 1:
        return None  # a SoC: no link to another device
    got = _seconds(op, nbytes, max(gpus, 2), acc, dtype, nodes)
    if got is None:
        return None
    seconds = float(got[0])
    return Collective(seconds=seconds, busbw_gbps=nbytes * bus_factor(op, max(gpus, 2)) / seconds / 1e9,
                      source=f"{op} {nbytes:.3g} B: {got[1]}")


def _span(group: int, stride: int, acc: Accelerator) -> int:
    """Boxes a group of ``group`` GPUs, ``stride`` apart (the inner parallel degrees), spans."""
    return max(1, min(group, math.ceil(group * stride / box_gpus(acc))))


# ---- data parallelism -------------------------------------------------------------------------------------------

def ddp_buckets(grad_bytes: float, last: Sequence[float] = (), *, first: float = DDP_FIRST_BUCKET_BYTES,
                cap: float = DDP_BUCKET_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """DDP's buckets in the order they fill (reverse parameter order) and whether each holds a ``last`` tensor:
    ``grad_bytes`` of gradients taken as divisible, then the ``last`` ones (the untied embeddings: the first
    parameters, whose gradients come last), a bucket closing once it holds ``cap`` bytes (the first ``first``)."""
    head = min(first, grad_bytes)
    full, left = divmod(grad_bytes - head, cap)
    sizes = ([head] if head else []) + [cap] * int(full)
    tail = [False] * len(sizes)
    current = left
    for t in last:
        current += t
        if current >= cap:
            sizes.append(current)
            tail.append(True)
            current = 0.0
    if current > 0:
        sizes.append(current)
        tail.append(bool(last))
    return np.array(sizes, dtype=float), np.array(tail, dtype=bool)


def overlap(ready: np.ndarray, seconds: np.ndarray, end: float) -> tuple[float, float]:
    """Collectives issued in order, each when its data is ``ready`` and the previous one is done: (exposed seconds
    past ``end``, the seconds of them that ran before ``end``). end_k = max(ready_k, end_(k-1)) + t_k, vectorised:
    end_k = C_k + max_(j<=k) (ready_j - C_(j-1)) with C the running sum of t."""
    if not len(seconds):
        return 0.0, 0.0
    c = np.cumsum(seconds)
    finish = c + np.maximum.accumulate(ready - (c - seconds))
    start = finish - seconds
    hidden = float(np.clip(np.minimum(finish, end) - start, 0.0, None).sum())
    return max(0.0, float(finish[-1]) - end), hidden


def _dp_group(step: PerGpu) -> tuple[int, int, int]:
    """(n, n_e, Pe): the gradient-reducing ranks (dp x cp: context-parallel ranks hold the same parameters), the
    n / ep of them holding the same routed experts (torchtitan's dp_shard_mod_ep), and the GPU's routed-expert
    parameters (0 without --ep)."""
    s, w = step.setup, step.workload
    n = s.dp * s.cp
    pe = w.expert_params if s.ep > 1 and w.expert_params <= w.trainable_params else 0
    return n, (n // s.ep if pe else n), pe


def comm_bytes(step: PerGpu) -> tuple[float, float]:
    """Bytes each GPU sends per optimizer step at the bus bandwidth's accounting (all-reduce 2(n-1)/n x S,
    reduce-scatter and all-gather (n-1)/n x S), and those of the last bucket or block, which never hide: DDP
    all-reduces the weight-dtype gradients once; ZeRO-1/2 reduce-scatter 16-bit gradients and all-gather 16-bit
    parameters; FSDP all-gathers 16-bit parameters in forward and backward on every micro-batch and reduce-scatters
    gradients (fp32 under mixed precision) once. Routed experts' parameters reduce over the n / ep ranks holding them:
    ``split(P)`` = (n-1)/n (P - Pe) + (ne-1)/ne Pe."""
    s, w = step.setup, step.workload
    n, ne, pe = _dp_group(step)
    if n == 1 or not s.training:
        return 0.0, 0.0

    def split(params: int) -> float:
        return (n - 1) / n * (params - pe) + (ne - 1) / ne * pe

    half = s.compute_dtype.itemsize
    if s.sharding == "ddp":
        grads = w.trainable_params * s.weight_dtype.itemsize
        return 2 * split(w.trainable_params) * s.weight_dtype.itemsize, 2 * (n - 1) / n * min(grads, DDP_BUCKET_BYTES)
    if s.sharding in ("zero1", "zero2"):
        return (2 * split(w.trainable_params) * half,
                2 * (n - 1) / n * min(w.trainable_params * half, DDP_BUCKET_BYTES))
    grad_bytes = 4 if s.mixed else half
    total = split(w.trainable_params) * grad_bytes + 2 * s.grad_accum * split(w.params) * half
    return total, (n - 1) / n * (w.block_bytes + w.block_trainable_params * grad_bytes)


def _bucketed(op: str, step: PerGpu, acc: Accelerator, *, grad_bytes: float, last: Sequence[float], cap: float,
              first: float, backward_s: float, dtype: str) -> tuple[float, float, float, str] | None:
    """(total, exposed, hidden seconds, source) of ``op`` over the data-parallel group on ``grad_bytes`` of gradients
    bucketed by ``cap`` (the first bucket ``first``), each issued when backward has produced it (backward spread evenly
    over the gradient bytes, the ``last`` tensors at its end) and the previous one is done."""
    s = step.setup
    n, ne, pe_params = _dp_group(step)
    pe = pe_params / step.workload.trainable_params if pe_params else 0.0  # the experts' share of the bytes
    sizes, tail = ddp_buckets(grad_bytes, last, cap=cap, first=first)
    spread = grad_bytes or 1.0
    ready = np.where(tail, backward_s, backward_s * np.minimum(np.cumsum(sizes), spread) / spread)
    got = _seconds(op, sizes * (1 - pe), n, acc, dtype, _span(n, s.tp, acc))
    more = _seconds(op, sizes * pe, ne, acc, dtype, _span(ne, s.tp, acc)) if pe and ne > 1 else (0.0, "")
    if got is None or more is None:  # (the experts' gradients go over the ranks that hold them)
        return None
    t, source = got[0] + more[0], got[1]
    exposed, hidden = overlap(ready, t, backward_s)
    return float(t.sum()), exposed, hidden, f"{len(sizes)} buckets, {source}"


def _fsdp_pass(compute_s: float, units: int, gather_s: float, reduce_s: float) -> tuple[float, float]:
    """One forward (``reduce_s`` 0) or backward (``gather_s`` 0: nothing gathered) of ``units`` FSDP units: each
    unit's all-gather prefetched one ahead (issued as the unit before starts), its reduce-scatter issued when its
    backward ends, all on one link in issue order. (wall seconds, seconds of collectives beside a computing unit)."""
    f = compute_s / units
    comm: list[tuple[float, float]] = []
    link_free = 0.0

    def issue(at: float, seconds: float) -> float:
        nonlocal link_free
        start = max(link_free, at)
        link_free = start + seconds
        comm.append((start, link_free))
        return link_free

    gathered = issue(0.0, gather_s) if gather_s else 0.0  # the first unit's gather hides behind nothing
    work, done = [], 0.0
    for k in range(units):
        start = max(done, gathered)
        if gather_s and k + 1 < units:
            gathered = issue(start, gather_s)
        done = start + f
        work.append((start, done))
        if reduce_s:
            issue(done, reduce_s)
    if not comm:
        return done, 0.0
    c, w = np.array(comm), np.array(work)
    beside = np.minimum(c[:, None, 1], w[None, :, 1]) - np.maximum(c[:, None, 0], w[None, :, 0])
    return max(done, link_free), float(np.clip(beside, 0.0, None).sum())


def data_parallel(step: PerGpu, acc: Accelerator, *, forward_s: float, backward_s: float) -> Comm | None:
    """The communication of ``step``'s data parallelism (``step.setup.sharding``), given its forward and backward
    seconds over the whole step (every micro-batch): what backward hides and what it leaves exposed, plus the
    slowdown of the compute it hides behind (NCCL_SM_SHARE). The optimizer step never overlaps. None: no link.

    DDP all-reduces weight-dtype gradients once a step (no_sync on the other micro-batches), in 25 MiB buckets (the
    first 1 MiB) as the last micro-batch's backward fills them. ZeRO-1 reduce-scatters 16-bit gradients once, ZeRO-2
    on every micro-batch, in 5e8-element buckets; both all-gather the updated 16-bit parameters after the step. FSDP
    all-gathers each unit's 16-bit parameters one unit ahead in forward and again in backward, and reduce-scatters its
    gradients (fp32 under mixed precision) after its backward: on every micro-batch, except under --pp, where the
    stage is gathered once and reduced after the last (torchtitan; sharding.py). Units: the model over the largest
    block's bytes (assumed alike). HSDP adds each unit's all-reduce of its shard across --nodes."""
    s, w = step.setup, step.workload
    n, _ne, _pe = _dp_group(step)
    if n == 1 or not s.training:
        return NO_COMM
    m = s.grad_accum
    half, wide = s.compute_dtype.itemsize, s.weight_dtype.itemsize
    grad_dtype = "f32" if wide == 4 else "bf16"
    if s.sharding in ("ddp", "zero1", "zero2"):
        zero = s.sharding != "ddp"
        itemsize = half if zero else wide
        # the untied embeddings (captured in the weights' dtype, DDP's gradient dtype): their gradients come last
        last = [rows * row for rows, row in w.embeddings] if s.task == "train" and not zero else []
        grads = max(0.0, w.trainable_params * itemsize - sum(last))
        passes = m if s.sharding == "zero2" else 1
        cap = ZERO_BUCKET_ELEMENTS * half if zero else DDP_BUCKET_BYTES
        got = _bucketed("reduce-scatter" if zero else "all-reduce", step, acc, grad_bytes=grads, last=last, cap=cap,
                        first=cap if zero else DDP_FIRST_BUCKET_BYTES, backward_s=backward_s / m,
                        dtype="bf16" if zero else grad_dtype)
        if got is None:
            return None
        total, exposed, hidden = (x * passes for x in got[:3])
        source = got[3]
        what = f"{s.sharding} over {n}: {source}"
        if zero:  # the updated parameters, gathered after the optimizer step
            gather = collective_seconds("all-gather", w.trainable_params * half, n, acc, dtype="bf16",
                                        nodes=_span(n, s.tp, acc))
            if gather is None:
                return None
            total, exposed = total + gather.seconds, exposed + gather.seconds
            what += f"; parameters all-gathered after the step, {gather.source}"
        slow = NCCL_SM_SHARE * hidden
        return Comm(total_s=total, exposed_s=exposed + slow,
                    basis=f"{what}; overlapped compute x{1 + NCCL_SM_SHARE:.2f} on the SMs NCCL leaves (assumed)")
    # fsdp
    shard = s.shard_gpus
    units = max(1, round(w.params * half / w.block_bytes)) if w.block_bytes else 1
    nodes = _span(shard, s.tp, acc)
    gather = collective_seconds("all-gather", w.params * half / units, shard, acc, dtype="bf16", nodes=nodes)
    rs_bytes = w.trainable_params * (4 if s.mixed else half) / units
    reduce = collective_seconds("reduce-scatter", rs_bytes, shard, acc, dtype=grad_dtype, nodes=nodes)
    if gather is None or reduce is None:
        return None
    r, why = reduce.seconds, ""
    if s.nodes > 1:  # HSDP: the shard's gradients all-reduced across the replicas
        rep = collective_seconds("all-reduce", rs_bytes / shard, s.nodes, acc, dtype=grad_dtype, nodes=s.nodes)
        if rep is None:
            return None
        r += rep.seconds
        why = f"; HSDP all-reduce across {s.nodes} nodes, {rep.source}"
    fwd, bwd = forward_s / m, backward_s / m
    f_wall, f_hid = _fsdp_pass(fwd, units, gather.seconds, 0.0)
    if s.pp > 1:  # gathered once (the first forward) and kept, reduced once (the last backward)
        b_wall, b_hid = _fsdp_pass(bwd, units, 0.0, r)
        exposed, hidden = (f_wall - fwd) + (b_wall - bwd), f_hid + b_hid
        total = units * (gather.seconds + r)
    else:
        b_wall, b_hid = _fsdp_pass(bwd, units, gather.seconds, r)
        exposed, hidden = m * ((f_wall - fwd) + (b_wall - bwd)), m * (f_hid + b_hid)
        total = m * units * (2 * gather.seconds + r)
    return Comm(total_s=total, exposed_s=exposed + NCCL_SM_SHARE * hidden,
                basis=f"fsdp over {shard}, {units} units prefetched one ahead: all-gather {gather.source}; "
                      f"reduce-scatter {reduce.source}{why}; overlapped compute x{1 + NCCL_SM_SHARE:.2f} (assumed)")


# ---- pipeline, tensor and expert parallelism ------------------------------------------------------------------

def boundary_bytes(setup: Setup, *, seq: int, hidden: int) -> float:
    """Bytes one micro-batch's activation (and its gradient) carries between two stages: micro_batch x seq / cp x
    hidden in the compute dtype, / tp under sequence parallelism (each rank sends its shard)."""
    return setup.micro_batch * seq / setup.cp * hidden * setup.compute_dtype.itemsize / (setup.tp if setup.sp else 1)


def pipeline(setup: Setup, acc: Accelerator, *, stage_s: Sequence[float], boundary: float) -> Comm | None:
    """GPipe / 1F1B over ``setup.pp`` stages and ``setup.grad_accum`` micro-batches, ``stage_s`` one micro-batch's
    forward + backward on each stage: the schedule takes sum(stage_s) + (m - 1) max(stage_s) (balanced: (m + pp - 1)
    slots of one stage; one micro-batch: the stages one after another, about one GPU's whole step). ``bubble_s`` is
    that less the slowest stage's own m micro-batches; ``exposed_s`` (= ``total_s``) the sends on the critical path,
    a forward and a backward transfer of ``boundary`` bytes per slot (2 (pp - 1 + m - 1), blocking as Megatron's 1F1B
    sends are).
    Interleaved schedules are not modelled. None: no link."""
    pp, m = setup.pp, setup.grad_accum
    if pp == 1:
        return NO_COMM
    if len(stage_s) != pp:
        raise ValueError(f"{len(stage_s)} stage times for {pp} pipeline stages")
    nodes = 2 if setup.gpus // pp >= box_gpus(acc) else 1  # a stage filling a box sends to the next box
    hop = collective_seconds("send/recv", boundary, 2, acc, dtype="bf16", nodes=nodes)
    if hop is None:
        return None
    slowest = max(stage_s)
    schedule = sum(stage_s) + (m - 1) * slowest
    path = 2 * (pp - 1 + m - 1)
    return Comm(total_s=path * hop.seconds, exposed_s=path * hop.seconds, bubble_s=schedule - m * slowest,
                basis=f"pipeline {pp} stages x {m} micro-batches: sum of stages + (m - 1) x slowest (1F1B); "
                      f"{path} transfers on the critical path, {hop.source}")


def tensor_parallel(acc: Accelerator, *, tp: int, tokens: int, hidden: int, blocks: int, itemsize: int,
                    passes: int = 2, calls: int = 1, sp: bool = False) -> Comm | None:
    """Megatron's tensor-parallel collectives: per block and pass through it 2 all-reduces of tokens x hidden x
    itemsize (with ``sp``: an all-gather and a reduce-scatter of that size for each); ``passes`` 1 for inference or
    a decode step, 2 for training (forward, backward), 3 when full checkpointing recomputes the forward; ``calls``
    the micro-batches (or decode steps). Never overlapped: eager PyTorch waits on each before the next op. The
    vocabulary-parallel embedding's and loss's collectives are left out. None: no link."""
    if tp == 1 or not blocks:
        return NO_COMM
    size = tokens * hidden * itemsize
    nodes = _span(tp, 1, acc)
    ops = ("all-gather", "reduce-scatter") if sp else ("all-reduce",)
    per = [collective_seconds(op, size, tp, acc, dtype="bf16" if itemsize == 2 else "f32", nodes=nodes) for op in ops]
    if any(c is None for c in per):
        return None
    seconds = 2 * blocks * passes * calls * sum(c.seconds for c in per)
    return Comm(total_s=seconds, exposed_s=seconds,
                basis=f"tensor parallel {tp}: {2 * blocks * passes * calls} x "
                      f"{' + '.join(c.source for c in per)}, not overlapped (eager PyTorch)")


def tensor_parallel_step(step: PerGpu, acc: Accelerator, *, blocks: int, hidden: int) -> Comm | None:
    """``tensor_parallel`` for ``step``: its GPU's tokens a micro-batch (``tokens_per_step`` / grad_accum, / cp
    already), compute dtype, 2 passes (3 under --checkpointing full), every micro-batch."""
    s = step.setup
    return tensor_parallel(acc, tp=s.tp, tokens=step.workload.tokens_per_step // s.grad_accum, hidden=hidden,
                           blocks=blocks, itemsize=s.compute_dtype.itemsize, sp=s.sp, calls=s.grad_accum,
                           passes=(2 + (s.checkpointing == "full")) if s.training else 1)


def transformer_shape(step: PerGpu) -> tuple[int, int] | None:
    """(blocks on this GPU, hidden width) as far as the workload tells: the stack the captures were scaled to (a
    stage's under --pp) and the token embedding's row; None when it does not (a whole-model capture, a later
    pipeline stage without the embedding). TODO: Workload fields for both."""
    w = step.workload
    stack = getattr(w, "stack", None)
    if stack is None or not w.embeddings:
        return None
    return stack.n_layer, w.embeddings[0][1] // w.setup.weight_dtype.itemsize


def expert_parallel(a2a: AllToAll, acc: Accelerator, *, micro_batches: int = 1, tp: int = 1) -> Comm | None:
    """The --ep all-to-alls (parallel.expert.AllToAll) as collectives: per MoE layer, micro-batch and exchange one
    all-to-all over ``ep`` GPUs whose busiest GPU moves its tokens x top_k x hidden rows x ``factor``; ``ep`` GPUs
    ``tp`` apart. Not hidden: the experts wait on the dispatch and the next layer on the combine. None: no link."""
    if a2a.ep == 1 or not a2a.moe_layers:
        return NO_COMM
    size = a2a.tokens / micro_batches * a2a.top_k * a2a.hidden * a2a.itemsize * max(a2a.factor, 1.0)
    one = collective_seconds("all-to-all", size, a2a.ep, acc, dtype="bf16" if a2a.itemsize == 2 else "f32",
                             nodes=_span(a2a.ep, tp, acc))
    if one is None:
        return None
    calls = a2a.moe_layers * a2a.exchanges * micro_batches
    return Comm(total_s=calls * one.seconds, exposed_s=calls * one.seconds,
                basis=f"--ep all-to-alls: {calls} x {one.source}, not hidden")
