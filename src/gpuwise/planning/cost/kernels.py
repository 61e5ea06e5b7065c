"""GPU time of each captured kernel, priced by its family from measured per-kernel data (never end-to-end runs).

- GEMMs and batched GEMMs: output tiles in waves over the SMs at the rate of the precision they run in
  (cost/gemm.py). fp32 without TF32 runs cuBLAS sgemm on the SIMT units, from the tiles each sgemm kernel
  generation runs: fitted on NeuSight's linear/bmm kernels of P4, T4, P100, V100, A100; held out one GPU at a time
  the median |error| of kernels under 3 ms is 9-18% (P100 9%, V100 12%, P4 13%, T4 16%, A100 18% without its own
  tile menu, 6% with the traced tile). TF32/fp16/bf16/fp8 run on tensor cores: fitted on OpenXLA's measured GEMM
  tables, H100 -> B200 8-15%, B200 -> H100 8-21%; each board's best matmul then matches stas00's measured list
  (A100 SXM/PCIe, never fitted on: 0.86/0.80 of datasheet vs 0.87/0.81 measured; kept as a per-board ceiling).
- Convolutions: cuDNN's implicit GEMM at the sgemm model, sped up (winograd) but slowed where few output pixels
  (N x Ho x Wo) feed the tiles, plus its bytes at DRAM bandwidth and 20 us: NeuSight's 3x3 fp32 convolutions
  (the weakest family; held-out errors in data/kernel_fit.json). TF32/16-bit
  convolutions use the tensor model at no speed-up (assumed: cuDNN's tensor-core kernels are implicit GEMMs; no
  measured data).
- Fused attention (SDPA flash / memory-efficient): its FLOPs at the FlashAttention papers' utilisation.
- Elementwise, norm, softmax (and reduction, optimizer, copy, which NeuSight did not measure) kernels: a fixed
  latency, the L2-resident bytes, DRAM beyond, per family on NeuSight's add/mul/gelu/relu, layer-norm and softmax
  kernels: held out 3-10% on four GPUs, 10-24% on the V100 (its DRAM streams at 96% of datasheet, the rest ~80%).
  NeuSight has no backward kernels: a backward is priced by the bytes the integrator passes for it.
- Clocks: a board holds its boost clock unless its TDP is below what the unit's full load draws at boost
  (``sustained_clock``), then (TDP / draw) ** 0.52 of it.
- Ceilings: where a board's best matmul was measured (stas00's list; zzc0721's database of users' square
  torch.matmul runs), its GEMMs are scaled so the model's best matches it (``tensor_ceiling``, ``simt_ceiling``).
  Boards nobody measured take their class's median: GeForce boards run 16-bit GEMMs ~1.2x faster than the rated
  boost allows (held out one board at a time: 7-14% vs 15-36% without), and where the datasheet fp32 counts paired
  lanes (compute capability 8.6+) sgemm reaches ~0.77 of the tile model (held out: median 5%).
- Host dispatch of an eager forward op (``forward_dispatch``): NeuSight's smallest latency of each op, 25-67 us by
  family on its hosts (PyTorch 2.1); the integrator (cost/step.py) takes a phase as the longer of kernels and launches.

GPU time excludes the host's eager dispatch (the integrator adds it) and, in the fit, NeuSight's own (each call's
latency there is dispatch + kernel). Kernels over a few ms on NeuSight's passively cooled 70-75 W boards ran up to
~2x slower again (thermal; not modelled). Every coefficient is fitted, and every figure above printed, by
``.venv/bin/python scripts/fit_kernels.py`` (reads /work/shared/data, writes ``data/kernel_fit.json``).

>>> chip = Chip.of(load_catalog().get("a100-40gb-pcie"))
>>> f = np.array([FAMILIES.index("matmul")], np.int8); r = np.array([RATE_KEYS.index("fp32")], np.int8)
>>> t = kernel_seconds(f, r, *(np.array([v], float) for v in (1, 4096, 4096, 4096, 2 * 4096**3, 0)), chip)
>>> bool(2 * 4096**3 / 19.5e12 < t[0] < 2 * 2 * 4096**3 / 19.5e12)
True
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

import numpy as np

from gpuwise.hardware.catalog import Accelerator, load_catalog  # noqa: F401  (load_catalog: the doctest)
from gpuwise.planning.capture.tracker import FAMILIES
from gpuwise.planning.cost.gemm import SIMT_TILES, TENSOR_TILES, GemmFit, Hardware, gemm_seconds

RATE_KEYS = ("fp32", "tf32", "fp16", "bf16", "fp8")  # the precision a GEMM row runs in (index codes)
_FP32, _TF32, _FP16, _BF16, _FP8 = range(len(RATE_KEYS))
_F = {name: i for i, name in enumerate(FAMILIES)}
_MEMORY_FAMILIES = ("elementwise", "norm", "softmax", "reduction", "optimizer", "copy", "fused")
# Families NeuSight has no kernels of take the nearest measured one's constants: a reduction reads like a layer
# norm's statistics pass; optimizer (foreach) and copy kernels stream like elementwise ones.
_MEMORY_FIT = {"elementwise": "elementwise", "norm": "norm", "softmax": "softmax", "reduction": "norm",
               "optimizer": "elementwise", "copy": "elementwise"}
LAUNCH_FLOOR_S = 1e-6  # GPU-side cost of any kernel: XLA's kKernelLaunchOverhead (gpu_performance_model_base.h)

# Fused attention's utilisation of the tensor rate at long sequences, and how it falls at short ones:
# FlashAttention-2 (Dao 2023, arXiv:2307.08691) reaches 50-73% of A100 peak forward and ~225 TFLOPS (72%) in
# training; FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) reports FA2 at ~35% of H100 peak (it is not
# written for Hopper's warp-group MMA), so Hopper and Blackwell get 35%. The memory-efficient kernel (xformers /
# cutlass, SDPA's pick for fp32 and for masks flash cannot take) runs at FlashAttention-1's 25-40% (FA2 paper, §1).
ATTENTION_EFFICIENCY = MappingProxyType({"flash": 0.65, "flash-hopper": 0.35, "efficient": 0.33, "fp32": 0.5})
ATTENTION_HALF_SEQ = 256  # utilisation halves at this many keys (FA2 paper Fig. 4: 512 -> 16k tokens, ~0.7x -> 1x)
# Time of an attention implementation relative to what kernel_seconds prices (SDPA's pick: flash on 16-bit,
# memory-efficient on fp32). flex: FlexAttention reaches ~90% of FlashAttention-2 forward, ~85% backward (PyTorch
# blog "FlexAttention", 2024-08): 1/0.875. gpuwise.ops.attention is a Triton FlashAttention-2 kernel: taken equal.
ATTENTION_SHARE = MappingProxyType({"sdpa": 1.0, "flash": 1.0, "flex": 1 / 0.875, "gpuwise": 1.0})

# Relative dynamic power of a logic process at the same clock (TSMC 16FF+ = 1), from the foundries' own claims:
# 12FFC -25% vs 16FFC (AnandTech 11337, TSMC's table); N7 -65% vs 16FF+ (TSMC via EETimes 2018); Samsung 8N
# (GA10x) taken midway between 12 and 7 nm (assumed: Samsung quotes 8LPP -10% vs 10LPP, 10LPE -40% vs 14LPE);
# N5 -30% vs N7 (tsmc.com/english/dedicatedFoundry/technology/5nm.htm; Hopper, Ada, Blackwell's 4N/4NP, CDNA3);
# N3 -30% vs N5 (assumed from TSMC's N3E claims; CDNA4).
_NODE_POWER = {16: 1.0, 12: 0.75, 8: 0.54, 7: 0.35, 5: 0.245, 3: 0.17}
# The process of each die family (its name's prefix), from the vendors' architecture whitepapers.
_DIE_NODE = (("GP", 16), ("GV", 12), ("TU", 12), ("GA100", 7), ("GA10", 8), ("GH", 5), ("AD", 5), ("GB", 5),
             ("gfx90a", 7), ("gfx942", 5), ("gfx950", 3))


@dataclass(frozen=True, kw_only=True)
class Chip:
    """The facts the kernel model reads of one accelerator (rates in TFLOPS, bandwidth in GB/s)."""

    name: str
    arch: str  # "Ampere", "Hopper", "Ada", "Turing", "Volta", "Pascal", "Blackwell", "CDNA3", ...
    die: str | None  # "GA100", "AD104", "gfx942": decides the process node (sustained_clock)
    compute_capability: str | None
    sms: int  # SMs (AMD: CUs)
    boost_clock_mhz: float
    base_clock_mhz: float | None
    fp32_tflops: float  # SIMT fp32 dense at boost
    tensor_tflops: Mapping[str, float]  # dense datasheet tf32 / fp16 / bf16 / fp8 (whatever exists)
    bandwidth_gbps: float
    l2_mib: float | None
    tdp_w: float | None
    memory_class: str  # HBM / GDDR / unified / other
    vendor: str = ""  # the catalog's vendor ("NVIDIA", "AMD", ...)
    segment: str = ""  # the catalog's segment ("consumer", "workstation", "datacenter", ...)

    @property
    def fp32_lanes(self) -> float:
        """fp32 lanes per SM the datasheet rate counts (Ampere GA10x, Ada, Hopper, Blackwell: 128 on paper, issued
        in pairs that sgemm cannot keep both busy)."""
        return self.fp32_tflops * 1e12 / (2 * self.sms * self.boost_clock_mhz * 1e6)

    @classmethod
    def of(cls, acc: Accelerator) -> Chip | None:
        """The chip of a catalog row; None when the row lacks SMs, a boost clock, an fp32 rate or a bandwidth."""
        sms, boost = getattr(acc, "sm_count", None), getattr(acc, "boost_clock_mhz", None)
        fp32, bw = acc.peak_tflops.get("fp32"), acc.memory_bandwidth_gbps
        if not (sms and boost and fp32 and bw):
            return None
        family, _, rest = acc.arch.partition("(")
        arch = family.split()[0] if not family.startswith("CDNA") else family.replace(" ", "").strip()
        cc = acc.compute_capability
        mem = (acc.memory_type or "").upper()
        memory_class = ("HBM" if mem.startswith("HBM") else "GDDR" if mem.startswith("GDDR")
                        else "unified" if "UNIFIED" in mem or mem.startswith("LPDDR") else "other")
        return cls(name=acc.key, arch=arch, die=(rest.split()[0].strip(",)") if rest else None),
                   compute_capability=f"{cc[0]}.{cc[1]}" if cc else None, sms=int(sms),
                   boost_clock_mhz=float(boost), base_clock_mhz=getattr(acc, "base_clock_mhz", None),
                   fp32_tflops=float(fp32),
                   tensor_tflops=MappingProxyType({key: float(v) for key in ("tf32", "fp16", "bf16", "fp8")
                                                   if (v := acc.peak_tflops.get(key))}),
                   bandwidth_gbps=float(bw), l2_mib=getattr(acc, "l2_mib", None), tdp_w=acc.tdp_w,
                   memory_class=memory_class, vendor=acc.vendor, segment=acc.segment)


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """A memory-bound family: time = t0 + bytes in L2 at l2_speedup x + the rest at dram_share of the bandwidth.

    The first ``l2_reach`` x L2 bytes of a kernel are served from L2 (its inputs were just written or re-read)."""

    t0_s: float
    dram_share: float
    l2_speedup: float
    l2_reach: float


@dataclass(frozen=True, kw_only=True)
class KernelFit:
    """Every fitted constant of the model (data/kernel_fit.json; scripts/fit_kernels.py writes it)."""

    simt: GemmFit
    tensor: GemmFit
    conv_simt: float  # a convolution's speed over the sgemm of its implicit GEMM (cuDNN's pick: winograd, FFT, ...)
    conv_bytes: float  # ... plus its bytes (input, weight, output) this many times at the DRAM bandwidth (transforms)
    conv_fixed_s: float  # ... plus a fixed time (cuDNN runs a convolution as several kernels)
    conv_m0: float  # ... its GEMM part x (1 + conv_m0 / m): few output pixels (m = N x Ho x Wo) run below the tiles
    memory: Mapping[str, MemoryFit]
    simt_w_per_tflops: float  # board power a 16 nm SIMT load draws per fp32 TFLOPS at boost (sustained_clock)
    tensor_w_per_tflops: float  # the same for a tensor-core load per dense fp16 TFLOPS
    clock_exponent: float  # share = (TDP / draw) ** exponent below the draw (1/3 if voltage fell with the clock)
    simt_menu: Mapping[str, Mapping[str, tuple[int, ...]]]  # sgemm generation -> "matmul"/"bmm" -> SIMT_TILES run
    # tensor GEMM time x this on a board whose best matmul was measured (stas00 list, zzc0721's database), else of
    # its class ("CDNA": AMD; "GeForce": NVIDIA consumer boards, whose boost runs above the rated clock)
    tensor_ceiling: Mapping[str, float]
    # sgemm time x this on a board NeuSight did not time whose best fp32 matmul was measured (zzc0721's database),
    # else of its class ("dual-issue": NVIDIA compute capability >= 8.6, whose datasheet fp32 counts paired lanes)
    simt_ceiling: Mapping[str, float]
    # host seconds from a Python call of an eager op to its kernel's launch, per family (NeuSight's hosts, PyTorch
    # 2.1: the median over its five GPUs' hosts of each op's smallest latency less the launch floor)
    dispatch_s: Mapping[str, float]
    errors: Mapping[str, Any]  # the held-out figures the fit printed (per family, per GPU)


def _gemm_fit(d: Mapping[str, Any]) -> GemmFit:
    return GemmFit(eff=tuple(d["eff"]), k0=d["k0"], acc_per_sm=d["acc_per_sm"], l2_bytes_per_clk=d["l2_bytes_per_clk"],
                   dram_share=d["dram_share"], fixed_s=d.get("fixed_s", 0.0))


def fit_from_dict(d: Mapping[str, Any]) -> KernelFit:
    """A KernelFit from kernel_fit.json's layout."""
    return KernelFit(simt=_gemm_fit(d["simt"]), tensor=_gemm_fit(d["tensor"]), conv_simt=d["conv"]["speedup"],
                     conv_bytes=d["conv"]["bytes"], conv_fixed_s=d["conv"]["fixed_s"], conv_m0=d["conv"].get("m0", 0.0),
                     memory=MappingProxyType({f: MemoryFit(**v) for f, v in d["memory"].items()}),
                     simt_w_per_tflops=d["clock"]["simt_w_per_tflops"],
                     tensor_w_per_tflops=d["clock"]["tensor_w_per_tflops"],
                     clock_exponent=d["clock"]["exponent"],
                     simt_menu=MappingProxyType({a: MappingProxyType({f: tuple(t) for f, t in m.items()})
                                                 for a, m in d.get("simt_menu", {}).items()}),
                     tensor_ceiling=MappingProxyType(dict(d.get("tensor_ceiling", {}))),
                     simt_ceiling=MappingProxyType(dict(d.get("simt_ceiling", {}))),
                     dispatch_s=MappingProxyType(dict(d.get("dispatch_s", {}))), errors=d.get("errors", {}))


@functools.cache
def load_fit() -> KernelFit:
    """The committed fit (data/kernel_fit.json)."""
    text = resources.files("gpuwise.planning.cost").joinpath("data/kernel_fit.json").read_text(encoding="utf-8")
    return fit_from_dict(json.loads(text))


def process_nm(chip: Chip) -> int | None:
    """The process node of the chip's die (16, 12, 8, 7, 5, 3), None when the die is not in the table."""
    for prefix, nm in _DIE_NODE:
        if chip.die and chip.die.startswith(prefix):
            return nm
    return None


def sustained_clock(chip: Chip, unit: str, fit: KernelFit | None = None) -> tuple[float, str]:
    """(share of the boost clock a board holds under a full ``unit`` load, "simt" or "tensor"; what it rests on).

    The load draws ``W/TFLOPS x node power x peak TFLOPS`` watts at boost; a board whose TDP is below that holds
    ``(TDP / draw) ** exponent`` of its boost. Power goes as clock x voltage^2: the exponent would be 1/3 were the
    voltage to fall with the clock, 1 at the voltage floor; fitted in between on NeuSight's sgemm kernels (the 70 W T4
    and 75 W P4 hold ~0.6 of boost, the 250 W P100/V100/A100 0.9-1; each GPU held out in turn). The tensor load's
    W/TFLOPS comes from the A100 PCIe (250 W) holding 0.933 of the SXM's (400 W) best matmul (stas00 list).

    >>> sustained_clock(Chip.of(load_catalog().get("h100-sxm")), "tensor")[0]
    1.0
    """
    if unit not in ("simt", "tensor"):
        raise ValueError(f"unit {unit!r} is not 'simt' or 'tensor'")
    fit = fit or load_fit()
    nm = process_nm(chip)
    rate = chip.fp32_tflops if unit == "simt" else (chip.tensor_tflops.get("fp16") or chip.tensor_tflops.get("bf16"))
    if chip.tdp_w is None or nm is None or not rate:
        return 1.0, f"boost clock (no TDP, process or {unit} rate to tell otherwise)"
    per = fit.simt_w_per_tflops if unit == "simt" else fit.tensor_w_per_tflops
    draw = per * _NODE_POWER[nm] * rate
    share = min(1.0, (chip.tdp_w / draw) ** fit.clock_exponent)
    if share >= 1.0:
        return 1.0, f"boost clock ({unit} load ~{draw:.0f} W at boost, TDP {chip.tdp_w:g} W)"
    return share, f"{share:.2f} of boost ({unit} load ~{draw:.0f} W at boost, TDP {chip.tdp_w:g} W, {nm} nm)"


def _unit_rate(chip: Chip, code: int) -> tuple[str, float]:
    """("simt" or "tensor", dense TFLOPS at boost) of a rate code; a precision the chip lacks runs as PyTorch
    would: TF32 off (pre-Ampere) -> fp32 SIMT; bf16 without bf16 units -> fp32 SIMT emulation; fp8 -> 16-bit."""
    t = chip.tensor_tflops
    if code == _FP8 and not t.get("fp8"):
        code = _BF16 if t.get("bf16") else _FP16
    if code == _BF16 and not t.get("bf16"):
        code = _FP32
    if code == _FP16 and not t.get("fp16"):
        code = _FP32
    if code == _TF32 and not t.get("tf32"):
        code = _FP32
    if code == _FP32:
        return "simt", chip.fp32_tflops
    return "tensor", t[RATE_KEYS[code]]


def hardware(chip: Chip, code: int, fit: KernelFit | None = None) -> tuple[Hardware, str]:
    """The tile model's view of a chip for one rate code: SMs, one SM's FLOP/s at the held clock, DRAM B/s."""
    fit = fit or load_fit()
    unit, tflops = _unit_rate(chip, code)
    share, _ = sustained_clock(chip, unit, fit)
    l2 = (fit.simt if unit == "simt" else fit.tensor).l2_bytes_per_clk * chip.sms * chip.boost_clock_mhz * 1e6 * share
    return Hardware(sms=chip.sms, sm_flops=tflops * 1e12 * share / chip.sms, bw=chip.bandwidth_gbps * 1e9,
                    l2_bw=l2), unit


_IN_BYTES = (4, 4, 2, 2, 1)  # operand bytes of each rate code (tf32 reads fp32 operands)
_OUT_BYTES = (4, 4, 2, 2, 2)  # fp8 GEMMs write 16-bit outputs (_scaled_mm to bf16)


# The generation of cuBLAS sgemm kernels each architecture runs (NeuSight's traces: maxwell_sgemm_* on Pascal,
# volta_sgemm_* on Volta and Turing, ampere_sgemm_* on Ampere; taken to carry on to Ada, Hopper and Blackwell), and
# the next one to borrow a menu from where a generation was not traced.
_SGEMM_KERNELS = {"Pascal": "maxwell", "Volta": "volta", "Turing": "volta", "Ampere": "ampere", "Ada": "ampere",
                  "Hopper": "ampere", "Blackwell": "ampere"}
_SGEMM_FALLBACK = {"ampere": "volta", "volta": "maxwell", "maxwell": "volta"}


def simt_menu(arch: str, family: str, fit: KernelFit) -> tuple[int, ...]:
    """The SIMT_TILES cuBLAS picks among for an fp32 ``family`` GEMM ("matmul" or "bmm") on ``arch``: the tiles its
    generation of sgemm kernels ran in NeuSight's traces (or the nearest traced generation's); all of them else."""
    gen = _SGEMM_KERNELS.get(arch)
    if gen is not None and gen not in fit.simt_menu:
        gen = _SGEMM_FALLBACK[gen] if _SGEMM_FALLBACK[gen] in fit.simt_menu else None
    menu = fit.simt_menu.get(gen, {}).get(family) if gen else None
    return tuple(menu) if menu else tuple(range(len(SIMT_TILES)))


def gemm_rows(b: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, code: int, chip: Chip,
              fit: KernelFit | None = None, family: str = "matmul", weight_bytes: float | None = None) -> np.ndarray:
    """GPU seconds of GEMMs (b, m, n, k) in one precision on ``chip``, the launch floor included. ``family``:
    "matmul", "bmm" (cuBLAS picks its SIMT tiles from a menu of each) or "conv" (cuDNN: any tile); ``weight_bytes``
    the (k, n) operand's bytes an element when it is stored quantised (gemm.candidate_seconds)."""
    fit = fit or load_fit()
    hw, unit = hardware(chip, code, fit)
    tiles, g = (SIMT_TILES, fit.simt) if unit == "simt" else (TENSOR_TILES, fit.tensor)
    if unit == "simt" and family in ("matmul", "bmm"):
        menu = simt_menu(chip.arch, family, fit)
        tiles = tuple(SIMT_TILES[i] for i in menu)
        g = dataclasses.replace(g, eff=tuple(np.broadcast_to(g.eff, (len(SIMT_TILES),))[list(menu)]))
    code = _FP32 if unit == "simt" else code
    t = gemm_seconds(b, m, n, k, tiles=tiles, fit=g, hw=hw, in_bytes=_IN_BYTES[code], out_bytes=_OUT_BYTES[code],
                     weight_bytes=weight_bytes)
    t = t * (tensor_ceiling(chip, fit) if unit == "tensor" else simt_ceiling(chip, fit))
    return t + LAUNCH_FLOOR_S


# Families NeuSight timed no op of take the nearest timed one's dispatch (fused attention: one call like a bmm).
_DISPATCH_FIT = {"attention": "bmm", "reduction": "norm", "optimizer": "elementwise", "copy": "elementwise"}


def forward_dispatch(family: np.ndarray, fit: KernelFit | None = None) -> np.ndarray:
    """Host seconds eager PyTorch spends issuing each forward op of ``family`` (FAMILIES indices) from Python: the
    measured dispatch of its family on NeuSight's hosts (fit_kernels.py's fit_dispatch). 0 for "none" and "fused"
    (no kernel of their own)."""
    d = (fit or load_fit()).dispatch_s
    table = np.array([d.get(f, d.get(_DISPATCH_FIT.get(f, "elementwise"), 0.0)) if f not in ("none", "fused")
                      else 0.0 for f in FAMILIES])
    return table[np.asarray(family, int)]


def _geforce(chip: Chip) -> bool:
    return chip.vendor == "NVIDIA" and chip.segment == "consumer"


def tensor_ceiling(chip: Chip, fit: KernelFit | None = None) -> float:
    """Tensor GEMM time x this: the model's best matmul over the board's measured best (stas00's brute-force search,
    zzc0721's database) where it was measured; else its class's median: AMD ("CDNA"), GeForce boards ("GeForce":
    their boost runs above the rated clock); else 1."""
    c = (fit or load_fit()).tensor_ceiling
    if chip.name in c:
        return c[chip.name]
    if chip.arch.startswith("CDNA"):
        return c.get("CDNA", 1.0)
    return c.get("GeForce", 1.0) if _geforce(chip) else 1.0


def dual_issue(chip: Chip) -> bool:
    """NVIDIA compute capability 8.6 and later (GA10x, Ada, Hopper, Blackwell): the datasheet fp32 rate counts 128
    lanes an SM, issued in pairs."""
    cc = chip.compute_capability
    return chip.vendor == "NVIDIA" and cc is not None and tuple(int(x) for x in cc.split(".")) >= (8, 6)


def simt_ceiling(chip: Chip, fit: KernelFit | None = None) -> float:
    """sgemm time x this: the model's best fp32 matmul over the board's measured best (zzc0721's database) on boards
    NeuSight did not time; else the median of its class ("dual-issue": see ``dual_issue``); else 1 (the sgemm fit
    itself is on NeuSight's P4, T4, P100, V100 and A100)."""
    c = (fit or load_fit()).simt_ceiling
    if chip.name in c:
        return c[chip.name]
    return c.get("dual-issue", 1.0) if dual_issue(chip) else 1.0


def memory_rows(nbytes: np.ndarray, family: str, chip: Chip, fit: KernelFit | None = None) -> np.ndarray:
    """GPU seconds of memory-bound kernels moving ``nbytes`` (read + written), the launch floor included. "fused":
    an op inside another kernel (compiled): its bytes at the elementwise rates, with no launch or fixed time."""
    fused = family == "fused"
    f = (fit or load_fit()).memory[_MEMORY_FIT["elementwise" if fused else family]]
    bw = chip.bandwidth_gbps * 1e9 * f.dram_share
    in_l2 = np.minimum(nbytes, f.l2_reach * (chip.l2_mib or 0.0) * 2**20)
    fixed = 0.0 if fused else LAUNCH_FLOOR_S + f.t0_s
    return fixed + in_l2 / (bw * f.l2_speedup) + (nbytes - in_l2) / bw


def attention_efficiency(impl: str, chip: Chip, keys: np.ndarray | float = np.inf) -> np.ndarray:
    """Utilisation of the tensor rate (SIMT for "fp32") a fused attention kernel reaches with ``keys`` keys."""
    if impl not in ("flash", "efficient", "fp32"):
        raise ValueError(f"attention implementation {impl!r} is not flash, efficient or fp32")
    if impl == "flash" and chip.arch in ("Hopper", "Blackwell"):
        impl = "flash-hopper"
    keys = np.asarray(keys, float)
    return ATTENTION_EFFICIENCY[impl] * keys / (keys + ATTENTION_HALF_SEQ)


def kernel_seconds(family: np.ndarray, rate: np.ndarray, b: np.ndarray, m: np.ndarray, n: np.ndarray,
                   k: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, chip: Chip,
                   fit: KernelFit | None = None) -> np.ndarray:
    """GPU time of one call of each row (seconds), NOT including the CPU's eager launch overhead (the integrator
    adds that); vectorised over rows.

    ``family`` indexes tracker.FAMILIES, ``rate`` RATE_KEYS (matmul / bmm / conv / attention rows). Dims: a GEMM's
    (b, m, n, k) for (m, k) x (k, n); a convolution's implicit GEMM (its ``flops`` may be a backward's, whose time
    scales by flops over the forward's); attention: b = batch x heads, m = queries, n = keys, k = head dim.
    """
    fit = fit or load_fit()
    family, rate = np.asarray(family), np.asarray(rate)
    b, m, n, k, flops, nbytes = (np.asarray(v, float) for v in (b, m, n, k, flops, nbytes))
    out = np.zeros(family.shape)
    gemm = np.isin(family, (_F["matmul"], _F["bmm"], _F["conv"]))
    for code, fam in {(int(c), int(f)) for c, f in zip(rate[gemm], family[gemm], strict=True)}:
        rows = gemm & (rate == code) & (family == fam) & (b * m * n * k > 0)
        if not rows.any():
            continue
        t = gemm_rows(b[rows], m[rows], n[rows], k[rows], code, chip, fit, FAMILIES[fam])
        dims_flops = 2 * b[rows] * m[rows] * n[rows] * k[rows]
        scale = np.where(flops[rows] > 0, flops[rows] / dims_flops, 1.0)  # a backward's FLOPs on forward dims
        t = LAUNCH_FLOOR_S + (t - LAUNCH_FLOOR_S) * scale
        if fam == _F["conv"]:  # cuDNN: winograd / FFT / implicit GEMM kernels and their transforms
            speedup = fit.conv_simt if RATE_KEYS[code] == "fp32" else min(1.0, fit.conv_simt)
            t = (LAUNCH_FLOOR_S + fit.conv_fixed_s + (t - LAUNCH_FLOOR_S) / speedup * (1 + fit.conv_m0 / m[rows])
                 + fit.conv_bytes * nbytes[rows] / (chip.bandwidth_gbps * 1e9))
        out[rows] = t
    # a GEMM row without dims (a captured op whose shapes were not kept): its FLOPs at the fitted best-tile rate
    flat = gemm & (b * m * n * k <= 0) & (flops > 0)
    for code in np.unique(rate[flat]):
        rows = flat & (rate == code)
        hw, unit = hardware(chip, int(code), fit)
        best = max((fit.simt if unit == "simt" else fit.tensor).eff)
        out[rows] = LAUNCH_FLOOR_S + flops[rows] / (hw.sm_flops * hw.sms * best)
    attn = family == _F["attention"]
    for code in np.unique(rate[attn]):
        rows = attn & (rate == code)
        hw, unit = hardware(chip, int(code), fit)
        eff = attention_efficiency("fp32" if unit == "simt" else "flash", chip, n[rows])
        compute = flops[rows] / (hw.sm_flops * hw.sms * np.maximum(eff, 1e-3))
        out[rows] = LAUNCH_FLOOR_S + np.maximum(compute, nbytes[rows] / hw.bw)
    for name in _MEMORY_FAMILIES:
        rows = family == _F[name]
        if rows.any():
            out[rows] = memory_rows(nbytes[rows], name, chip, fit)
    return out


# What each family's time rests on (``plan`` prints it in its basis line).
BASIS = MappingProxyType({
    "matmul": "tiles x waves over the SMs at the precision's rate (sgemm: NeuSight P4-A100 fit; tensor: OpenXLA "
              "H100/B200 tables)",
    "bmm": "as matmul, the batch in the tile count",
    "conv": "cuDNN's implicit GEMM at the GEMM model, over NeuSight's conv speed-up (fp32; TF32 by the same ratio)",
    "attention": "FLOPs at FlashAttention-2's utilisation (FA2/FA3 papers), falling at short sequences",
    "elementwise": "bytes: L2-resident part, then DRAM at NeuSight's add/mul/gelu/relu share",
    "norm": "bytes at NeuSight's layer-norm share",
    "softmax": "bytes at NeuSight's softmax share",
    "reduction": "bytes at the layer-norm share (no reduction kernels measured)",
    "optimizer": "bytes at the elementwise share (no optimizer kernels measured)",
    "copy": "bytes at the elementwise share",
    "fused": "the bytes a compiled kernel's fused op reads, at the elementwise share, no launch of its own",
    "none": "no kernel",
})


def basis(chip: Chip, fit: KernelFit | None = None) -> str:
    """One line for ``plan``: what the kernel times rest on for ``chip``, with its clocks and held-out errors."""
    fit = fit or load_fit()
    simt, _ = sustained_clock(chip, "simt", fit)
    tensor, _ = sustained_clock(chip, "tensor", fit)
    err = fit.errors.get("summary", "")
    return (f"kernels by family (tiles x waves for GEMMs, bytes for the rest; fitted on NeuSight and OpenXLA "
            f"per-kernel data{', ' + err if err else ''}); clock x{simt:.2f} SIMT, x{tensor:.2f} tensor")
