"""GEMM time by tiles and waves: the output split into the tiles the library launches, the tiles run in waves over
the SMs, each tile a fixed per-SM cost plus its share of the k loop (NeuSight, Lee et al., ASPLOS 2025).

One call prices every row against every candidate tile and split-K factor at once and keeps the fastest, as a
library heuristic would (cuBLAS picks by its own model; NeuSight's traces show which tile it ran: the kernel name,
e.g. ``ampere_sgemm_128x64_tn``, is 128 along the output's columns and 64 along its rows). Tile ``(tm, tn)`` is
``tm`` rows of the output (the ``m`` side) by ``tn`` columns (the ``n`` side).

>>> fit = GemmFit(eff=(0.9,), k0=8.0, acc_per_sm=1.0, l2_bytes_per_clk=47.4, dram_share=0.7)
>>> hw = Hardware(sms=108, sm_flops=2 * 64 * 1.41e9, bw=1.555e12, l2_bw=108 * 47.4 * 1.41e9)
>>> float(gemm_seconds(*(np.array([v], float) for v in (1, 4096, 4096, 4096)), tiles=((128, 128),), fit=fit,
...                    hw=hw, in_bytes=4, out_bytes=4)[0]) > 2 * 4096**3 / 19.5e12
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# cuBLAS fp32 SIMT kernels (sgemm) and the tiles their names carry, as (rows, columns) of the output: NeuSight's
# linear.csv / bmm.csv traces on P4, T4, P100, V100, A100 (`volta_sgemm_128x64_tn` -> (64, 128)). "sliced1x4"
# kernels split k four ways inside the tile; they are kept as their own candidates (own utilisation).
SIMT_TILES = ((128, 128), (64, 128), (32, 128), (128, 32), (64, 64), (32, 64), (32, 32))
SIMT_SLICED = (False, False, False, False, False, True, True)
# Tensor-core tiles (CUTLASS/cuBLAS on Ampere, Hopper, Blackwell: 128x128, 128x256 and 256x128 warp-group tiles,
# 64x128 for small problems); the one utilisation is fitted on the OpenXLA H100 / B200 tables (fit_kernels.py).
TENSOR_TILES = ((256, 128), (128, 256), (128, 128), (64, 128), (128, 64), (64, 64))
SPLITS = (1, 2, 4, 8, 16)
_MIN_SPLIT_K = 256  # cuBLAS splits k only when each slice keeps a few hundred steps; fewer is never faster here


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the tile model reads of a chip for one unit: SMs, one SM's rate (FLOP/s at the held clock), DRAM and L2
    bytes/s."""

    sms: float
    sm_flops: float
    bw: float
    l2_bw: float  # L2 bytes/s the SMs can read together


@dataclass(frozen=True, kw_only=True)
class GemmFit:
    """Fitted constants of one unit's tile model (fit_kernels.py writes them; kernel_fit.json keeps them).

    eff: the tile's utilisation of the SM's rate over the k loop, one per tile (or one for all);
    k0: a tile's fixed cost (prologue, epilogue, writing C) in k steps; acc_per_sm: output elements one SM holds
    at once (register accumulators), so CTAs per SM = acc_per_sm / (tm * tn) (1: one tile per SM a wave);
    l2_bytes_per_clk: L2 bytes one SM reads a clock (the tiles' operands come from L2; the A100 whitepaper gives
    5120 B/clk for 108 SMs); dram_share: the share of the datasheet bandwidth a GEMM's unique bytes stream at.
    """

    eff: tuple[float, ...]
    k0: float
    acc_per_sm: float
    l2_bytes_per_clk: float
    dram_share: float
    fixed_s: float = 0.0  # a GEMM kernel's fixed time beyond the launch floor (tensor cores: fitted on XLA's table)


def candidate_seconds(b: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, tm: np.ndarray, tn: np.ndarray,
                      split: np.ndarray, eff: np.ndarray, *, fit: GemmFit, hw: Hardware, in_bytes: float,
                      out_bytes: float, weight_bytes: float | None = None) -> np.ndarray:
    """GPU seconds of GEMMs run with the given tile and split-K (broadcast together), without the launch floor.

    time = max(compute, unique bytes at DRAM bandwidth, the tiles' operand reads at L2 bandwidth); compute =
    waves x CTAs per SM x one tile's 2 tm tn (k / split + k0) FLOPs at one SM's rate x eff. ``weight_bytes``: the
    (k, n) operand's bytes an element where it is stored in another format than it multiplies in (a quantised
    weight read by a dequantising kernel: 4.5 bits of a GGUF q4_0 is 0.5625); default ``in_bytes``.
    """
    wb = in_bytes if weight_bytes is None else weight_bytes
    ctas = np.clip(np.floor(fit.acc_per_sm / (tm * tn)), 1.0, 16.0)
    ks = np.ceil(k / split)
    tiles = b * np.ceil(m / tm) * np.ceil(n / tn) * split
    waves = np.ceil(tiles / (hw.sms * ctas))
    compute = waves * ctas * 2.0 * tm * tn * (ks + fit.k0) / (hw.sm_flops * eff)
    partials = np.where(split > 1, 2.0 * 4.0 * b * m * n * split, 0.0)  # fp32 partial sums written and reduced
    dram = (b * (in_bytes * m * k + wb * k * n) + out_bytes * b * m * n + partials) / (hw.bw * fit.dram_share)
    l2 = tiles * (tm * in_bytes + tn * wb) * ks / hw.l2_bw
    return np.maximum(np.maximum(compute, dram), l2) + fit.fixed_s


def gemm_seconds(b: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, *, tiles: tuple[tuple[int, int], ...],
                 fit: GemmFit, hw: Hardware, in_bytes: float, out_bytes: float,
                 splits: tuple[int, ...] = SPLITS, weight_bytes: float | None = None) -> np.ndarray:
    """GPU seconds of each GEMM row at the fastest (tile, split-K) candidate, without the launch floor."""
    eff = np.broadcast_to(np.asarray(fit.eff, float), (len(tiles),))
    cand_t = np.repeat(np.asarray(tiles, float), len(splits), axis=0)  # (C, 2)
    cand_s = np.tile(np.asarray(splits, float), len(tiles))
    cand_e = np.repeat(eff, len(splits))
    col = (slice(None), None)
    b, m, n, k = (np.asarray(v, float)[col] for v in (b, m, n, k))
    t = candidate_seconds(b, m, n, k, cand_t[:, 0], cand_t[:, 1], cand_s, cand_e, fit=fit, hw=hw,
                          in_bytes=in_bytes, out_bytes=out_bytes, weight_bytes=weight_bytes)
    # split-K: each slice keeps _MIN_SPLIT_K steps at least, and only while the unsplit tiles leave SMs idle
    unsplit = b * np.ceil(m / cand_t[:, 0]) * np.ceil(n / cand_t[:, 1])
    allowed = (cand_s == 1) | ((k / cand_s >= _MIN_SPLIT_K) & (unsplit * cand_s <= 2 * hw.sms))
    return np.where(allowed, t, np.inf).min(axis=1)
