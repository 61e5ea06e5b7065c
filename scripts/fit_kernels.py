"""Fit the kernel-time model (src/gpuwise/planning/cost/kernels.py) on measured per-kernel data; print held-out errors.

    .venv/bin/python scripts/fit_kernels.py            # fit, print the held-out tables, rewrite data/kernel_fit.json
    .venv/bin/python scripts/fit_kernels.py --check    # fit and print; exit 1 if the committed JSON differs
    .venv/bin/python scripts/fit_kernels.py --sample   # also rewrite tests/data/neusight_sample.csv.gz

Sources (/work/shared/data, see its README): NeuSight's kernel measurements (sitar-lab/NeuSight 6945927, MIT;
PyTorch 2.1, CUDA 12.1, fp32 with TF32 off; latency per call in ms, best 5 of 25) and OpenXLA's measured GEMM
table (openxla/xla default_matmul_perf_table.txtpb, mirror ROCm/xla 183fa00, Apache-2.0), and the "maximum
achievable matmul FLOPS" list (stas00/ml-engineering) for the tensor clock.

NeuSight timed each call between two CUDA events around the eager op, so a latency is the host's dispatch of the
op plus the kernel. The dispatch is a property of their host, not of the GPU: it is taken as the smallest latency
of that op on that GPU (a near-empty kernel) less the model's launch floor, and added to every prediction of that
(GPU, op); kernel_seconds itself never includes it. Kernels over 0.1 s are left out of the fits (their boards
throttle thermally: NeuSight's T4 loses ~half its rate between 1 ms and 1 s kernels) and reported apart.

Every fit is scored held out: NeuSight families leave one GPU out (fit on four, score the fifth, each in turn);
tensor cores fit on H100 and score B200, and the reverse. Errors are |predicted / measured - 1|.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gzip
import io
import json
import re
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuwise.hardware.catalog import load_catalog  # noqa: E402
from gpuwise.planning.cost import kernels  # noqa: E402
from gpuwise.planning.cost.gemm import SIMT_SLICED, SIMT_TILES, GemmFit, candidate_seconds  # noqa: E402

DATA = Path("/work/shared/data")
OUT = ROOT / "src" / "gpuwise" / "planning" / "cost" / "data" / "kernel_fit.json"
SAMPLE = ROOT / "tests" / "data" / "neusight_sample.csv.gz"
# NeuSight's device names -> catalog rows (conv ran on an A100 80GB PCIe instead of the 40GB one)
DEVICES = {"Tesla P4": "p4", "Tesla T4": "t4", "Tesla P100-PCIE-16GB": "p100-pcie-16gb",
           "Tesla V100-PCIE-32GB": "v100-pcie-32gb", "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie",
           "NVIDIA A100 80GB PCIe": "a100-80gb-pcie"}
GPUS = ("p4", "t4", "p100-pcie-16gb", "v100-pcie-32gb", "a100")  # a100: the 40GB (GEMM, vector) or 80GB (conv) PCIe
# Fits use kernels shorter than FIT_S: NeuSight's passively cooled 70-75 W boards (T4, P4) slow down as a kernel
# runs longer (T4 sgemm utilisation 0.65 at 0.3 ms, 0.34 at 0.1 s: thermal, not in any datasheet fact); the
# others do not. Longer kernels are scored apart (FIT_S-LONG_S, over LONG_S).
FIT_S = 3e-3
LONG_S = 0.1
# L2 read bandwidth per SM and clock: 5120 B/clk over the A100's 108 SMs (NVIDIA A100 Tensor Core GPU Architecture
# whitepaper, 2020: "L2 cache read bandwidth 5120 B/clk", 2.3x V100's 2048); the sgemm tiles never reach it.
A100_L2 = 5120 / 108
CONV_FIXED_S = 2e-5  # see fit_conv
# bytes read + written per element of a (B, H) fp32 tensor, and per row / per column (statistics, weights)
VEC_OPS = {"add": ("elementwise", 3), "mul": ("elementwise", 3), "gelu": ("elementwise", 2),
           "relu": ("elementwise", 2), "softmax": ("softmax", 2), "ln": ("norm", 2)}
# "Maximum achievable matmul FLOPS" (stas00/ml-engineering compute/accelerator/README.md): bf16 dense TFLOPS,
# best shape found by brute-force search, mean of 100 iterations / datasheet
MAX_ACHIEVABLE_BF16 = {"a100-80gb-sxm": (271.2, 312), "a100-40gb-pcie": (252.9, 312), "h100-sxm": (794.5, 989),
                       "h200": (794.5, 989), "b200": (1745, 2250), "gb200": (1822, 2500), "mi300x": (668.4, 1300),
                       "mi325x": (784.9, 1300), "mi355x": (1565, 2300)}
# zzc0721/torch-performance-test-data database.md (stored commit 078586871da3, rows 2025-2026): users' PyTorch
# runs of test.py, square torch.matmul of 1024..10240 with 5 warm-ups, TFLOPS of the best size; fp32 with TF32 off
# (PyTorch's default). Per catalog board, every row of that exact board (modded 48 GB 4090s, 4090D, laptop and "D"
# variants are other boards and left out; H100's 403.74 "fp32" row ran TF32 and is left out). fp32 is used only on
# boards NeuSight did not time (its five are the sgemm fit); 16-bit on boards stas00's list lacks.
BEST_MATMUL = {
    "rtx-3090": {"fp32": (24.46, 24.84, 24.79), "bf16": (76.34, 76.68, 76.58)},
    "rtx-4090": {"fp32": (55.01, 54.77, 46.48, 54.67), "bf16": (170.06, 173.31, 162.39, 163.09)},
    "rtx-5090": {"fp32": (69.16, 67.57), "bf16": (236.03, 242.18)},
    "rtx-4060-ti-16gb": {"fp32": (11.50,), "bf16": (42.65,)},
    "rtx-a6000": {"fp32": (23.92,), "bf16": (123.34,)},
    "rtx-pro-6000": {"fp32": (77.24,), "bf16": (417.98,)},
    "l40s": {"fp32": (46.88,), "bf16": (269.15,)},
    "h20": {"fp32": (31.95,), "bf16": (141.86,)},
    "t4": {"fp16": (41.91, 42.71)},
    "h100-sxm": {"fp32": (52.11,)},
    "h200": {"fp32": (51.34,)},
    "b200": {"fp32": (66.24,)},
}
MATMUL_SIZES = (1024, 2048, 4096, 8192, 10240)
XLA_ARCH = {"sm_90": "h100-sxm", "sm_100_B200": "b200"}
XLA_DTYPES = {"bf16xbf16->bf16": "bf16", "f32xf32->f32": "tf32", "f8e4m3fnxf8e4m3fn->bf16": "fp8"}


# ----------------------------------------------------------------------------------------------------------- data
def _rows(name: str) -> list[dict[str, str]]:
    with gzip.open(DATA / "neusight" / f"{name}.csv.gz", "rt") as f:
        return list(csv.DictReader(f))


def _gpu(device: str) -> str:
    key = DEVICES[device]
    return "a100" if key.startswith("a100") else key


def _with_host(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each (GPU, op)'s dispatch time: its smallest latency less the launch floor (see the module docstring)."""
    host = np.zeros(len(d["lat"]))
    for g in GPUS:
        for op in np.unique(d["op"]):
            s = (d["gpu"] == g) & (d["op"] == op)
            if s.any():
                host[s] = d["lat"][s].min() - kernels.LAUNCH_FLOOR_S
    return {**d, "host": host}


def load_gemm() -> dict[str, np.ndarray]:
    """linear.csv + bmm.csv as GEMM rows (b, m, n, k) in kernels' convention, with the tile and split-K run."""
    cols: dict[str, list] = {c: [] for c in ("op", "gpu", "b", "m", "n", "k", "lat", "tile", "split")}
    keys = list(zip(SIMT_TILES, SIMT_SLICED, strict=True))
    for op in ("linear", "bmm"):
        for r in _rows(op):
            B, M, N, K = (int(r[c]) for c in "BMNK")
            # linear: (B, M, N) @ Linear(N, K) -> GEMM (B*M) x N x K; bmm: (B, M, N) @ (B, N, K); N is the reduction
            b, m, n, k = (1, B * M, K, N) if op == "linear" else (B, M, K, N)
            name = r["Kernel Name"]
            tile = re.search(r"sgemm_(\d+)x(\d+)", name)
            if tile is None:
                continue
            # the name's first number runs along the output's columns (cuBLAS is column-major): (rows, columns)
            tm, tn, sliced = int(tile.group(2)), int(tile.group(1)), "sliced" in name or "32x32x32" in name
            if (tm, tn, sliced) == (32, 128, True):
                tm, tn = 32, 64  # "128x32_sliced1x4": no candidate of its own, the 64x32 sliced one is the closest
            try:
                idx = keys.index(((tm, tn), sliced))
            except ValueError:
                continue
            gz = int(r["Grid z"])
            for c, v in zip(cols, (op, _gpu(r["Device"]), b, m, n, k, float(r["Latency"]) * 1e-3, idx,
                                   gz // b if op == "bmm" else gz), strict=True):
                cols[c].append(v)
    return _with_host({c: np.array(v) for c, v in cols.items()})


def load_vector() -> dict[str, np.ndarray]:
    """The elementwise, softmax and layer-norm kernels with the bytes each moves."""
    cols: dict[str, list] = {c: [] for c in ("op", "family", "gpu", "nbytes", "lat")}
    for op, (family, per) in VEC_OPS.items():
        for r in _rows(op):
            B, H = int(r["B"]), int(r["H"])
            nbytes = 4 * (per * B * H + (2 * B + 2 * H if op == "ln" else 0))  # ln: mean/rstd out, weight/bias in
            for c, v in zip(cols, (op, family, _gpu(r["Device"]), nbytes, float(r["Latency"]) * 1e-3), strict=True):
                cols[c].append(v)
    return _with_host({c: np.array(v) for c, v in cols.items()})


def load_conv() -> dict[str, np.ndarray]:
    """conv.csv as implicit GEMMs: m = N Ho Wo, n = Cout, k = Cin kh kw (groups 1, square kernels and images)."""
    cols: dict[str, list] = {c: [] for c in ("op", "gpu", "b", "m", "n", "k", "ks", "nbytes", "lat")}
    for r in _rows("conv"):
        B, cin, cout, ks, size, stride, pad = (int(r[c]) for c in ("B", "Input_Channel", "Output_Channel",
                                                                    "Kernel_Szie", "Input_Size", "Stride", "Padding"))
        out = (size + 2 * pad - ks) // stride + 1
        if out < 1:
            continue
        nbytes = 4 * (B * cin * size * size + cout * cin * ks * ks + B * cout * out * out)
        for c, v in zip(cols, ("conv", _gpu(r["Device"]), 1, B * out * out, cout, cin * ks * ks, ks, nbytes,
                               float(r["Latency"]) * 1e-3), strict=True):
            cols[c].append(v)
    return _with_host({c: np.array(v) for c, v in cols.items()})


def load_xla() -> dict[str, np.ndarray]:
    """OpenXLA's GEMM table: achieved FLOP/s by (b, m, n, k) and dtype on H100 (sm_90) and B200."""
    with gzip.open(DATA / "openxla" / "default_matmul_perf_table.txtpb.gz", "rt") as f:
        text = f.read()
    cols: dict[str, list] = {c: [] for c in ("gpu", "dtype", "b", "m", "n", "k", "lat")}
    arch, dims = None, {}
    for line in text.splitlines():
        s = line.strip()
        if s.startswith('key: "'):
            arch = s[6:-1]
        elif m := re.fullmatch(r"([bmnk]): (\d+)", s):
            dims[m.group(1)] = int(m.group(2))
        elif ((m := re.fullmatch(r'flops \{ key: "([^"]+)" value: (\d+) \}', s)) and arch in XLA_ARCH
              and m.group(1) in XLA_DTYPES):
            flops = 2.0 * dims["b"] * dims["m"] * dims["n"] * dims["k"]
            for c, v in zip(cols, (XLA_ARCH[arch], XLA_DTYPES[m.group(1)], dims["b"], dims["m"], dims["n"],
                                   dims["k"], flops / int(m.group(2))), strict=True):
                cols[c].append(v)
    return {c: np.array(v) for c, v in cols.items()}


def chips() -> dict[str, kernels.Chip]:
    cat = load_catalog()
    out = {g: kernels.Chip.of(cat.get(k)) for g, k in (*((g, g) for g in GPUS[:4]), ("a100", "a100-40gb-pcie"),
                                                       ("a100-80", "a100-80gb-pcie"), ("h100-sxm", "h100-sxm"),
                                                       ("b200", "b200"))}
    if missing := [g for g, c in out.items() if c is None]:
        raise SystemExit(f"catalog rows without chip facts: {missing}")
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------------- fitting
def least_squares(residual, x0: np.ndarray, iters: int = 80, huber: float = 0.15) -> np.ndarray:
    """Levenberg-Marquardt on a Huber loss of log residuals (numpy only; finite-difference Jacobian)."""
    x, lam = np.asarray(x0, float), 1e-2

    def loss(r):
        a = np.abs(r)
        return float(np.sum(np.where(a < huber, 0.5 * r * r, huber * (a - 0.5 * huber))))

    r = residual(x)
    cost = loss(r)
    for _ in range(iters):
        w = np.sqrt(np.where(np.abs(r) < huber, 1.0, huber / np.maximum(np.abs(r), 1e-12)))
        jac = np.empty((r.size, x.size))
        for i in range(x.size):
            h = 1e-5 * max(1.0, abs(x[i]))
            xp = x.copy()
            xp[i] += h
            jac[:, i] = (residual(xp) - r) / h
        jw, rw = jac * w[:, None], r * w
        a, g = jw.T @ jw, jw.T @ rw
        while True:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -g)
            rn = residual(x + step)
            if np.all(np.isfinite(rn)) and (cn := loss(rn)) < cost:
                x, r, cost, lam = x + step, rn, cn, max(lam / 3, 1e-9)
                break
            lam *= 4
            if lam > 1e9:
                return x
        if np.max(np.abs(step)) < 1e-7:
            break
    return x


def _sig(v):
    return 1 / (1 + np.exp(-v))


def _logit(p):
    return np.log(p / (1 - p))


def errors(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    e = np.abs(pred / meas - 1)
    return {"n": int(e.size), "median": round(float(np.median(e)), 4), "p90": round(float(np.percentile(e, 90)), 4)}


def _fits(base: kernels.KernelFit, **changes) -> kernels.KernelFit:
    return dataclasses.replace(base, **changes)


# SIMT GEMMs: eff per tile (7), k0, dram share; the SIMT clock's W/TFLOPS and exponent. Waves of one tile per SM
# (acc_per_sm 1): sizing CTAs per SM by register accumulators (32k: 2-16 CTAs) fitted worse (in-sample 12-23%).
def simt_fit(x: np.ndarray, base: kernels.KernelFit) -> kernels.KernelFit:
    n = len(SIMT_TILES)
    g = GemmFit(eff=tuple(float(v) for v in _sig(x[:n])), k0=float(np.exp(x[n])), acc_per_sm=1.0,
                l2_bytes_per_clk=A100_L2, dram_share=float(_sig(x[n + 1])))
    return _fits(base, simt=g, simt_w_per_tflops=float(np.exp(x[n + 2])), clock_exponent=float(_sig(x[n + 3])))


def simt_x0(fit: kernels.KernelFit) -> np.ndarray:
    return np.r_[_logit(np.clip(fit.simt.eff, 0.05, 0.98)), np.log(fit.simt.k0), _logit(fit.simt.dram_share),
                 np.log(fit.simt_w_per_tflops), _logit(fit.clock_exponent)]


def simt_predict(d, sel, fit: kernels.KernelFit, chip_of, oracle: bool) -> np.ndarray:
    """Predicted latency of GEMM rows: host dispatch + kernel (the traced tile, or the model's own pick)."""
    out = np.empty(int(sel.sum()))
    idx = np.flatnonzero(sel)
    for g in np.unique(d["gpu"][sel]):
        rows = idx[d["gpu"][idx] == g]
        at = np.isin(idx, rows)
        b, m, n, k = (d[c][rows].astype(float) for c in "bmnk")
        if oracle:
            hw, _ = kernels.hardware(chip_of[g], 0, fit)
            tile = np.asarray(SIMT_TILES, float)[d["tile"][rows]]
            eff = np.asarray(fit.simt.eff)[d["tile"][rows]]
            t = candidate_seconds(b, m, n, k, tile[:, 0], tile[:, 1], d["split"][rows].astype(float), eff,
                                  fit=fit.simt, hw=hw, in_bytes=4, out_bytes=4) + kernels.LAUNCH_FLOOR_S
        else:
            t = np.empty(len(rows))
            for op, family in (("linear", "matmul"), ("bmm", "bmm")):
                o = d["op"][rows] == op
                t[o] = kernels.gemm_rows(b[o], m[o], n[o], k[o], 0, chip_of[g], fit, family)
        out[at] = d["host"][rows] + t
    return out


def simt_menus(d, chip_of, gpus) -> dict[str, dict[str, list[int]]]:
    """Per sgemm kernel generation and GEMM kind: the tiles cuBLAS ran in 2% or more of the calls traced on ``gpus``."""
    menus: dict[str, dict[str, list[int]]] = {}
    for g in gpus:
        for op, family in (("linear", "matmul"), ("bmm", "bmm")):
            s = (d["gpu"] == g) & (d["op"] == op)
            counts = np.bincount(d["tile"][s], minlength=len(SIMT_TILES))
            gen = kernels._SGEMM_KERNELS[chip_of[g].arch]
            got = menus.setdefault(gen, {}).setdefault(family, [])
            menus[gen][family] = sorted(set(got) | set(np.flatnonzero(counts >= 0.02 * s.sum()).tolist()))
    return menus


def fit_simt(d, chip_of, base: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    fit_rows = d["lat"] < FIT_S

    def fit_on(train):
        def res(x):
            return np.log(simt_predict(d, train, simt_fit(x, base), chip_of, oracle=True) / d["lat"][train])
        menu = simt_menus(d, chip_of, np.unique(d["gpu"][train]))
        return _fits(simt_fit(least_squares(res, simt_x0(base)), base), simt_menu=menu)

    print("\nfp32 GEMMs (cuBLAS sgemm, TF32 off): NeuSight linear + bmm, leave one GPU out; median | p90 |error|")
    print(f"{'held out':15} {'clock':>5} {'< 3 ms, traced tile':>20} {'< 3 ms':>15} {'3-100 ms':>15} "
          f"{'> 0.1 s':>15}  (model's own tile pick unless said)")
    table = {}
    for g in GPUS:
        fit = fit_on(fit_rows & (d["gpu"] != g))
        row = {"clock": round(kernels.sustained_clock(chip_of[g], "simt", fit)[0], 3)}
        cells = []
        for name, lo, hi, oracle in (("traced_tile", 0, FIT_S, True), ("short", 0, FIT_S, False),
                                     ("mid", FIT_S, LONG_S, False), ("long", LONG_S, np.inf, False)):
            held = (d["gpu"] == g) & (d["lat"] >= lo) & (d["lat"] < hi)
            row[name] = errors(simt_predict(d, held, fit, chip_of, oracle), d["lat"][held])
            cells.append(f"{row[name]['median']:6.1%} |{row[name]['p90']:6.1%}")
        table[g] = row
        print(f"{g:15} {row['clock']:5.2f} {cells[0]:>20} " + " ".join(f"{c:>15}" for c in cells[1:]))
    report["simt_gemm"] = table
    fit = fit_on(fit_rows)
    print("fitted on all five:", "eff", np.round(fit.simt.eff, 3), f"k0 {fit.simt.k0:.1f}",
          f"dram {fit.simt.dram_share:.2f}", f"W/TFLOPS {fit.simt_w_per_tflops:.1f}",
          f"clock exponent {fit.clock_exponent:.2f}")
    return fit



# Memory-bound kernels, per family: t0, DRAM share, L2 speed-up, L2 reach (kernels.MemoryFit).
def memory_fit(x: np.ndarray) -> kernels.MemoryFit:
    return kernels.MemoryFit(t0_s=float(np.exp(x[0])), dram_share=float(_sig(x[1])),
                             l2_speedup=float(1 + np.exp(x[2])), l2_reach=float(np.exp(x[3])))


def memory_predict(d, sel, family: str, mf: kernels.MemoryFit, base: kernels.KernelFit, chip_of) -> np.ndarray:
    fit = _fits(base, memory={**base.memory, family: mf})
    out = np.empty(int(sel.sum()))
    idx = np.flatnonzero(sel)
    for g in np.unique(d["gpu"][sel]):
        rows = idx[d["gpu"][idx] == g]
        out[np.isin(idx, rows)] = d["host"][rows] + kernels.memory_rows(d["nbytes"][rows].astype(float), family,
                                                                        chip_of[g], fit)
    return out


def fit_memory(d, chip_of, base: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    print("\nmemory-bound kernels (fp32): NeuSight, leave one GPU out; median |error| of all calls | of the calls "
          "whose kernel is at least half the latency")
    print(f"{'family':12} " + " ".join(f"{g[:14]:>15}" for g in GPUS) + "   fitted on all five")
    memory = dict(base.memory)
    table: dict = {}
    for family in ("elementwise", "softmax", "norm"):
        fam = (d["family"] == family) & (d["lat"] < LONG_S)
        x0 = np.array([np.log(3e-6), _logit(0.8), np.log(1.5), 0.0])

        def fit_on(train, family=family, x0=x0):
            def res(x):
                return np.log(memory_predict(d, train, family, memory_fit(x), base, chip_of) / d["lat"][train])
            return memory_fit(least_squares(res, x0))
        cells, table[family] = [], {}
        for g in GPUS:
            mf = fit_on(fam & (d["gpu"] != g))
            held = fam & (d["gpu"] == g)
            e = errors(memory_predict(d, held, family, mf, base, chip_of), d["lat"][held])
            big = held & (d["lat"] > 2 * d["host"])  # the kernel at least half the call
            e["kernel_half"] = errors(memory_predict(d, big, family, mf, base, chip_of), d["lat"][big])
            table[family][g] = e
            cells.append(f"{e['median']:6.1%} |{e['kernel_half']['median']:6.1%}")
        memory[family] = fit_on(fam)
        mf = memory[family]
        print(f"{family:12} " + " ".join(cells) + f"   t0 {mf.t0_s * 1e6:.1f} us, DRAM {mf.dram_share:.2f}, "
              f"L2 {mf.l2_speedup:.1f}x over {mf.l2_reach:.2f} x L2")
    report["memory"] = table
    return _fits(base, memory=memory)



# Convolutions (fp32, cuDNN with benchmark on, TF32 off): their implicit GEMM at the sgemm model, over conv_simt.
def conv_predict(d, sel, fit: kernels.KernelFit, chip_of) -> np.ndarray:
    out = np.empty(int(sel.sum()))
    idx = np.flatnonzero(sel)
    conv = np.int8(kernels.FAMILIES.index("conv"))
    for g in np.unique(d["gpu"][sel]):
        rows = idx[d["gpu"][idx] == g]
        b, m, n, k = (d[c][rows].astype(float) for c in "bmnk")
        t = kernels.kernel_seconds(np.full(len(rows), conv), np.zeros(len(rows), np.int8), b, m, n, k,
                                   2 * b * m * n * k, d["nbytes"][rows].astype(float),
                                   chip_of["a100-80" if g == "a100" else g], fit)
        out[np.isin(idx, rows)] = d["host"][rows] + t
    return out


def fit_conv(d, chip_of, base: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    fit_rows = d["lat"] < FIT_S

    # The fixed time is held at 20 us (a few cuDNN kernels): left free it goes to ~240 us, which improves these
    # held-out medians by ~5 points but would charge each small convolution of a real network 0.24 ms, when
    # NeuSight's smallest take 63 us with the dispatch (A100).
    def conv_fit(x):
        return _fits(base, conv_simt=float(np.exp(x[0])), conv_bytes=float(np.exp(x[1])), conv_fixed_s=CONV_FIXED_S,
                     conv_m0=float(np.exp(x[2])))

    def fit_on(train):
        def res(x):
            return np.log(conv_predict(d, train, conv_fit(x), chip_of) / d["lat"][train])
        return conv_fit(least_squares(res, np.array([0.0, 0.0, np.log(1000.0)])))

    print("\nconvolutions (fp32, cuDNN picks the algorithm): NeuSight conv, leave one GPU out; median | p90 |error|")
    print(f"{'held out':15} {'speed-up':>8} {'< 3 ms':>15} {'3-100 ms':>15}")
    table = {}
    for g in GPUS:
        fit = fit_on(fit_rows & (d["gpu"] != g))
        row: dict = {"conv_simt": round(fit.conv_simt, 3)}
        for name, lo, hi in (("short", 0, FIT_S), ("mid", FIT_S, LONG_S)):
            held = (d["gpu"] == g) & (d["lat"] >= lo) & (d["lat"] < hi)
            row[name] = errors(conv_predict(d, held, fit, chip_of), d["lat"][held])
        table[g] = row
        print(f"{g:15} {fit.conv_simt:8.2f} {row['short']['median']:6.1%} |{row['short']['p90']:6.1%} "
              f"{row['mid']['median']:6.1%} |{row['mid']['p90']:6.1%}")
    report["conv"] = table
    fit = fit_on(fit_rows)
    print(f"fitted on all five: a convolution runs {fit.conv_simt:.2f}x its implicit GEMM's sgemm speed, plus "
          f"{fit.conv_bytes:.1f}x its bytes at DRAM bandwidth and {fit.conv_fixed_s * 1e6:.0f} us; its GEMM part "
          f"x (1 + {fit.conv_m0:.0f} / output pixels) "
          "(NeuSight's convolutions are all 3x3, stride 1, padding 1)")
    return fit


# Tensor-core GEMMs: OpenXLA's table on H100 and B200; one eff, k0, fixed time, L2 speed-up, DRAM share.
def tensor_fit(x: np.ndarray, base: kernels.KernelFit) -> kernels.KernelFit:
    g = GemmFit(eff=(float(_sig(x[0])),), k0=float(np.exp(x[1])), acc_per_sm=1.0, l2_bytes_per_clk=float(np.exp(x[2])),
                dram_share=float(_sig(x[3])), fixed_s=float(np.exp(x[4])))
    return _fits(base, tensor=g)


def tensor_predict(d, sel, fit: kernels.KernelFit, chip_of) -> np.ndarray:
    out = np.empty(int(sel.sum()))
    idx = np.flatnonzero(sel)
    for g in np.unique(d["gpu"][sel]):
        for dtype in np.unique(d["dtype"][sel]):
            rows = idx[(d["gpu"][idx] == g) & (d["dtype"][idx] == dtype)]
            if len(rows):
                b, m, n, k = (d[c][rows].astype(float) for c in "bmnk")
                out[np.isin(idx, rows)] = kernels.gemm_rows(b, m, n, k, kernels.RATE_KEYS.index(dtype), chip_of[g],
                                                            fit)
    return out


def tensor_clock(base: kernels.KernelFit, chip_of) -> kernels.KernelFit:
    """W per dense fp16 TFLOPS of a tensor load at 16 nm, from the A100 PCIe (250 W) vs SXM (400 W) best matmul:
    the SXM holds boost, so the PCIe's share is their ratio and its draw TDP / share^3."""
    share = MAX_ACHIEVABLE_BF16["a100-40gb-pcie"][0] / MAX_ACHIEVABLE_BF16["a100-80gb-sxm"][0]
    pcie = chip_of["a100"]
    draw = pcie.tdp_w / share ** (1 / base.clock_exponent)
    per = draw / (kernels._NODE_POWER[kernels.process_nm(pcie)] * pcie.tensor_tflops["fp16"])
    print(f"\ntensor clock: A100 PCIe holds {share:.3f} of the SXM's best bf16 matmul -> draws {draw:.0f} W at boost "
          f"-> {per:.2f} W per fp16 TFLOPS at 16 nm")
    return _fits(base, tensor_w_per_tflops=float(per))


def fit_tensor(d, chip_of, base: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    # sm_90's fp8 rows are left out: their best (2593 TFLOPS) is above the H100's dense fp8 datasheet (1979) and a
    # tenth of their shapes run over twice the bf16 speed, which dense fp8 cannot.
    ok = ~((d["gpu"] == "h100-sxm") & (d["dtype"] == "fp8"))
    x0 = np.array([_logit(0.8), np.log(64.0), np.log(A100_L2), _logit(0.8), np.log(3e-6)])

    def fit_on(train):
        def res(x):
            return np.log(tensor_predict(d, train, tensor_fit(x, base), chip_of) / d["lat"][train])
        return tensor_fit(least_squares(res, x0), base)

    print("tensor-core GEMMs: OpenXLA's measured table, fit on one GPU, score the other; median | p90 |error|")
    print(f"{'fit -> held out':22} " + " ".join(f"{t:>15}" for t in ("bf16", "tf32 (f32 rows)", "fp8")))
    table = {}
    for fit_g, held_g in (("h100-sxm", "b200"), ("b200", "h100-sxm")):
        fit = fit_on(ok & (d["gpu"] == fit_g))
        cells, row = [], {}
        for dtype in ("bf16", "tf32", "fp8"):
            held = ok & (d["gpu"] == held_g) & (d["dtype"] == dtype)
            if held.any():
                row[dtype] = errors(tensor_predict(d, held, fit, chip_of), d["lat"][held])
                cells.append(f"{row[dtype]['median']:6.1%} |{row[dtype]['p90']:6.1%}")
            else:
                cells.append("(left out)")
        table[f"{fit_g}->{held_g}"] = row
        print(f"{fit_g + ' -> ' + held_g:22} " + " ".join(f"{c:>15}" for c in cells))
    report["tensor_gemm"] = table
    fit = fit_on(ok)
    t = fit.tensor
    print(f"fitted on both: eff {t.eff[0]:.3f}, k0 {t.k0:.0f}, fixed {t.fixed_s * 1e6:.1f} us, "
          f"L2 {t.l2_bytes_per_clk:.0f} B/clk/SM, DRAM {t.dram_share:.2f}")
    # the clock rule, held out: each board's best bf16 matmul (stas00) vs the model's best shape (8192^3)
    print("best bf16 matmul / datasheet: measured (stas00 list) vs the model's 8192^3 GEMM -> ceiling kept")
    cat, rows, ceiling = load_catalog(), {}, {}
    big = np.array([8192.0])
    for key, (got, sheet) in MAX_ACHIEVABLE_BF16.items():
        chip = kernels.Chip.of(cat.get(key))
        if chip is None:
            continue
        model = 2 * 8192.0**3 / float(kernels.gemm_rows(np.ones(1), big, big, big, kernels.RATE_KEYS.index("bf16"),
                                                        chip, fit)[0]) / (chip.tensor_tflops["bf16"] * 1e12)
        ceiling[key] = round(model / (got / sheet), 3)
        rows[key] = {"measured": round(got / sheet, 3), "model": round(model, 3)}
        print(f"  {key:16} {got / sheet:6.3f} {model:6.3f}  x{ceiling[key]:.3f}")
    amd = [v for k, v in ceiling.items() if k.startswith("mi")]
    ceiling["CDNA"] = round(float(np.mean(amd)), 3)
    fit = _fits(fit, tensor_ceiling=ceiling)
    report["max_achievable_bf16"] = rows
    return fit_best_matmul(fit, report)


def _model_best(chip: kernels.Chip, code: int, fit: kernels.KernelFit) -> float:
    """The model's best TFLOPS over zzc0721's square sizes, before any ceiling."""
    best = 0.0
    for n in MATMUL_SIZES:
        v = np.array([float(n)])
        t = float(kernels.gemm_rows(np.ones(1), v, v, v, code, chip, fit)[0])
        best = max(best, 2 * n**3 / t / 1e12)
    return best


def fit_best_matmul(fit: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    """Ceilings from zzc0721's best square matmuls (BEST_MATMUL): per measured board, model best / measured best; the
    class medians ("GeForce" tensor, "dual-issue" SIMT) for boards nobody measured, scored leaving each board out."""
    cat = load_catalog()
    bare = _fits(fit, tensor_ceiling={}, simt_ceiling={})
    tensor, simt = dict(fit.tensor_ceiling), {}
    ratios: dict[str, dict[str, float]] = {"tensor": {}, "simt": {}}
    print("\nbest square matmul, measured (zzc0721 database) vs the model's best size -> ceiling")
    for key, got in BEST_MATMUL.items():
        chip = kernels.Chip.of(cat.get(key))
        for dtype, values in got.items():
            measured = float(np.median(values))
            code = kernels.RATE_KEYS.index(dtype)
            model = _model_best(chip, code, bare)
            unit = "simt" if dtype == "fp32" else "tensor"
            ratios[unit][key] = model / measured
            print(f"  {key:18} {dtype:5} measured {measured:7.1f}  model {model:7.1f}  x{model / measured:.3f}")
    for key, r in ratios["tensor"].items():
        tensor.setdefault(key, round(r, 3))  # stas00's list, where it has the board, stays
    simt.update({k: round(r, 3) for k, r in ratios["simt"].items()})

    def klass(unit: str, key: str) -> bool:
        chip = kernels.Chip.of(cat.get(key))
        return kernels._geforce(chip) if unit == "tensor" else kernels.dual_issue(chip)

    held: dict[str, dict[str, float]] = {}
    print("held out (each board's best from its class's other boards):")
    for unit, name in (("tensor", "GeForce"), ("simt", "dual-issue")):
        members = {k: r for k, r in ratios[unit].items() if klass(unit, k)}
        for key, r in members.items():
            others = [v for k, v in members.items() if k != key]
            held.setdefault(unit, {})[key] = round(abs(float(np.median(others)) / r - 1), 4)
            print(f"  {unit:6} {key:18} error {held[unit][key]:.1%} (1.0 would be {abs(1 / r - 1):.1%})")
        (tensor if unit == "tensor" else simt)[name] = round(float(np.median(list(members.values()))), 3)
    report["best_matmul"] = {"ratio": {u: {k: round(v, 4) for k, v in r.items()} for u, r in ratios.items()},
                             "held_out": held}
    return _fits(fit, tensor_ceiling=tensor, simt_ceiling=simt)


# NeuSight's ops -> the kernel model's families
DISPATCH_FAMILY = {"linear": "matmul", "bmm": "bmm", "conv": "conv", "add": "elementwise", "mul": "elementwise",
                   "gelu": "elementwise", "relu": "elementwise", "softmax": "softmax", "ln": "norm"}


def fit_dispatch(tables, base: kernels.KernelFit, report: dict) -> kernels.KernelFit:
    """An eager op's host time from Python to its kernel, per family: the median over NeuSight's five hosts of each
    (GPU, op)'s dispatch (_with_host), then over the family's ops. Each NeuSight call was timed alone between two
    CUDA events, so its smallest latency is the host's dispatch plus the smallest kernel."""
    per: dict[str, list[float]] = {}
    for d in tables:
        for op in np.unique(d["op"]):
            hosts = [float(d["host"][(d["gpu"] == g) & (d["op"] == op)][0]) for g in GPUS
                     if ((d["gpu"] == g) & (d["op"] == op)).any()]
            per.setdefault(DISPATCH_FAMILY[op], []).append(float(np.median(hosts)))
            print(f"  dispatch {op:8} median {np.median(hosts) * 1e6:5.1f} us over hosts "
                  f"({min(hosts) * 1e6:.0f}-{max(hosts) * 1e6:.0f})")
    dispatch = {f: float(f"{np.median(v):.3g}") for f, v in per.items()}
    report["dispatch_s"] = dispatch
    return _fits(base, dispatch_s=dispatch)


INITIAL = {
    "simt": {"eff": [0.9] * len(SIMT_TILES), "k0": 8.0, "acc_per_sm": 1.0, "l2_bytes_per_clk": A100_L2,
             "dram_share": 0.7},
    "tensor": {"eff": [0.8], "k0": 16.0, "acc_per_sm": 1.0, "l2_bytes_per_clk": A100_L2, "dram_share": 0.8},
    "conv": {"speedup": 1.0, "bytes": 1.0, "fixed_s": 1e-5, "m0": 0.0},
    "memory": {f: {"t0_s": 3e-6, "dram_share": 0.8, "l2_speedup": 2.5, "l2_reach": 1.0}
               for f in ("elementwise", "softmax", "norm")},
    "simt_menu": {},
    "tensor_ceiling": {},
    "simt_ceiling": {},
    "dispatch_s": {},
    "clock": {"simt_w_per_tflops": 40.0, "tensor_w_per_tflops": 2.8, "exponent": 0.4},
}


def to_json(fit: kernels.KernelFit, report: dict) -> dict:
    def gemm(g: GemmFit) -> dict:
        return {"eff": [round(v, 4) for v in g.eff], "k0": round(g.k0, 3), "acc_per_sm": g.acc_per_sm,
                "l2_bytes_per_clk": round(g.l2_bytes_per_clk, 3), "dram_share": round(g.dram_share, 4),
                "fixed_s": float(f"{g.fixed_s:.4g}")}
    simt = [r["short"]["median"] for r in report["simt_gemm"].values()]
    memory = [v["median"] for f in report["memory"].values() for v in f.values()]
    conv = [r["short"]["median"] for r in report["conv"].values()]
    tensor = [v["median"] for r in report["tensor_gemm"].values() for v in r.values()]
    summary = (f"held-out median error: sgemm {min(simt):.0%}-{max(simt):.0%}, tensor {min(tensor):.0%}-"
               f"{max(tensor):.0%}, memory-bound {min(memory):.0%}-{max(memory):.0%}, conv {min(conv):.0%}-"
               f"{max(conv):.0%}")
    return {
        "about": "Fitted constants of gpuwise's kernel-time model (src/gpuwise/planning/cost/kernels.py) and their "
                 "held-out errors; see kernel_fit.NOTICE for the sources.",
        "command": ".venv/bin/python scripts/fit_kernels.py",
        "simt": gemm(fit.simt),
        "simt_menu": {a: {f: list(t) for f, t in m.items()} for a, m in fit.simt_menu.items()},
        "tensor": gemm(fit.tensor),
        "tensor_ceiling": dict(fit.tensor_ceiling),
        "simt_ceiling": dict(fit.simt_ceiling),
        "dispatch_s": dict(fit.dispatch_s),
        "conv": {"speedup": round(fit.conv_simt, 4), "bytes": round(fit.conv_bytes, 4),
                 "fixed_s": float(f"{fit.conv_fixed_s:.4g}"), "m0": round(fit.conv_m0, 1)},
        "memory": {f: {"t0_s": float(f"{m.t0_s:.4g}"), "dram_share": round(m.dram_share, 4),
                       "l2_speedup": round(m.l2_speedup, 4), "l2_reach": round(m.l2_reach, 4)}
                   for f, m in fit.memory.items()},
        "clock": {"simt_w_per_tflops": round(fit.simt_w_per_tflops, 3),
                  "tensor_w_per_tflops": round(fit.tensor_w_per_tflops, 4), "exponent": round(fit.clock_exponent, 4)},
        "errors": {"summary": summary, **report},
    }


def write_sample(gemm, vector, conv, per_cell: int = 60) -> None:
    """tests/data/neusight_sample.csv.gz: per (op, GPU), rows evenly spaced in latency, with their host dispatch."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["op", "gpu", "b", "m", "n", "k", "tile", "split", "nbytes", "latency_s", "host_s"])
    for d in (gemm, vector, conv):
        for op in np.unique(d["op"]):
            for g in GPUS:
                idx = np.flatnonzero((d["op"] == op) & (d["gpu"] == g) & (d["lat"] < LONG_S))
                idx = idx[np.argsort(d["lat"][idx])][np.linspace(0, len(idx) - 1, min(per_cell, len(idx))).astype(int)]
                for i in idx:
                    w.writerow([op, g, *(int(d[c][i]) if c in d else 0 for c in ("b", "m", "n", "k", "tile", "split",
                                                                                  "nbytes")),
                                f"{d['lat'][i]:.6g}", f"{d['host'][i]:.6g}"])
    SAMPLE.write_bytes(gzip.compress(out.getvalue().encode(), mtime=0))
    print(f"wrote {SAMPLE.relative_to(ROOT)}")


def held_out_table() -> list[tuple[str, str, int, float, float]]:
    """The committed fit's held-out errors (src/gpuwise/planning/cost/data/kernel_fit.json, written by this script):
    (family, held-out GPU or direction, kernels, median |error|, p90), one row each; benchmarks/speed_truth.py prints
    them as its section (1). Kernels under 3 ms (``short``) for the NeuSight families, every shape for XLA's."""
    errors = json.loads((files("gpuwise") / "planning" / "cost" / "data" / "kernel_fit.json").read_text())["errors"]
    rows = []
    for gpu, e in errors["simt_gemm"].items():
        rows.append(("fp32 GEMM (sgemm)", gpu, e["short"]["n"], e["short"]["median"], e["short"]["p90"]))
    for way, by in errors["tensor_gemm"].items():
        for dtype, e in by.items():
            rows.append((f"{dtype} GEMM (tensor cores)", way, e["n"], e["median"], e["p90"]))
    for family, by in errors["memory"].items():
        for gpu, e in by.items():
            rows.append((family, gpu, e["n"], e["median"], e["p90"]))
    for gpu, e in errors["conv"].items():
        rows.append(("convolution (fp32)", gpu, e["short"]["n"], e["short"]["median"], e["short"]["p90"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the committed JSON differs")
    parser.add_argument("--sample", action="store_true", help="also rewrite tests/data/neusight_sample.csv.gz")
    parser.add_argument("--only", choices=("simt", "memory", "conv", "tensor"), help="fit one family (no write)")
    args = parser.parse_args(argv)
    chip_of = chips()
    # one family alone starts from the committed constants (the others it reads: conv reads the sgemm fit)
    base = kernels.load_fit() if args.only and OUT.exists() else kernels.fit_from_dict(INITIAL)
    report: dict = {}
    gemm, vector, conv = load_gemm(), load_vector(), load_conv()
    if args.only in (None, "simt"):
        base = fit_simt(gemm, chip_of, base, report)
    if args.only in (None, "memory"):
        base = fit_memory(vector, chip_of, base, report)
    if args.only in (None, "conv"):
        base = fit_conv(conv, chip_of, base, report)
    if args.only in (None, "tensor"):
        base = fit_tensor(load_xla(), chip_of, tensor_clock(base, chip_of), report)
    if args.only is None:
        base = fit_dispatch((gemm, vector, conv), base, report)
    if args.sample:
        write_sample(gemm, vector, conv)
    if args.only:
        return 0
    # one line per list of numbers
    text = re.sub(r"\[\s+([-0-9.,\se]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  json.dumps(to_json(base, report), indent=1)) + "\n"
    print("\n" + to_json(base, report)["errors"]["summary"])
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("kernel_fit.json is", "up to date" if same else "stale: run scripts/fit_kernels.py")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
