"""The coarse speed model: one achieved share of the datasheet per op kind and memory class, and the clock a board
holds at its power. ``cost/kernels.py`` prices a GPU whose shape it knows (SMs, clocks, tile rates) kernel by kernel;
this table prices the rest (TPUs, Gaudi, Ascend, Apple, NPUs: no SM facts in the catalog) op by op on its roofline,
and decode's serving floor (cost/serving.py) until serving is modelled per kernel too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuwise.hardware.catalog import Accelerator

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
