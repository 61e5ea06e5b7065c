"""gpuwise.ops.attention on a GPU against PyTorch's kernels, bf16 (issue 6's evidence). Needs CUDA and Triton.

Rows: TFLOPS forward and forward + backward at head_dim 64 and 128, 16k tokens per batch (batch = 16k / seq,
heads = 2048 / head_dim, as FlashAttention's benchmark), causal and dense, for
- gpuwise (this repository's Triton kernel),
- SDPA with the flash backend forced (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, FlashAttention-2),
- SDPA's default backend (cuDNN on Hopper in recent PyTorch),
- FlexAttention compiled, with the same block mask;
then block-sparse masks at 50% and 90% of the tiles skipped against the dense kernel.
FLOPs: 4·b·h·s²·d forward times the unmasked fraction, backward 2.5x the forward. Each case is checked
against SDPA (or the PyTorch path) before it is timed. Medians of triton.testing.do_bench.

    PYTHONPATH=src python benchmarks/attention.py [--quick] [--budget 240]
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch
import torch.nn.functional as F

from gpuwise.ops import BlockMask, attention
from gpuwise.ops.attention import reference

TOKENS, HIDDEN = 16384, 2048


def _ours(q, k, v, *, causal: bool = False, block_mask: BlockMask | None = None):
    return attention(q, k, v, causal=causal, block_mask=block_mask)


def _reference(q, k, v, *, mask):
    return reference(q, k, v, mask, q.shape[-1] ** -0.5)


def _table_mod(table: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx // 128, kv_idx // 128]

    return mask_mod


def _bench(fn, *, backward: bool, q, k, v) -> float:
    import triton

    do = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        if backward:
            out.backward(do)

    return triton.testing.do_bench(step, warmup=10, rep=60, return_mode="median")


def _flex(mask_mod, b, h, s, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block = create_block_mask(mask_mod, None, None, s, s, device=device, BLOCK_SIZE=128)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block)


def _sdpa(causal: bool, flash: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        if flash:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _check(ours, expected, q, k, v, label: str) -> float:
    with torch.no_grad():
        a, b = ours(q, k, v).float(), expected(q, k, v).float()
    err = (a - b).abs().max().item()
    if not err < 3e-2:
        raise SystemExit(f"{label}: gpuwise differs from the reference by {err:.3g}")
    return err


def _sparsity_rows(dev: str) -> None:
    """The same kernel with 50% and 90% of the tiles skipped, against dense, and against FlexAttention with the
    same block mask (seq 8k, head_dim 128)."""
    s, d = 8192, 128
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    n = s // 128
    dense_ms = (_bench(_ours, backward=False, q=q, k=k, v=v), _bench(_ours, backward=True, q=q, k=k, v=v))
    print(f"| dense | {d} | {s} | gpuwise | {dense_ms[0]:.2f} ms | {dense_ms[1]:.2f} ms fwd+bwd | 1.00 |")
    for sparsity in (0.5, 0.9):
        rng = np.random.default_rng(0)
        table = rng.random((n, n)) >= sparsity
        np.fill_diagonal(table, True)  # every query block attends somewhere (the printed sparsity counts it)
        mask = BlockMask.from_dense(table, 128)
        ours = functools.partial(_ours, block_mask=mask)
        dense_mask = mask.to_dense()
        small = [t.detach()[:1, :2] for t in (q, k, v)]
        _check(ours, functools.partial(_reference, mask=dense_mask.to(dev)), *small, f"sparsity {sparsity}")
        t = (_bench(ours, backward=False, q=q, k=k, v=v), _bench(ours, backward=True, q=q, k=k, v=v))
        line = (f"| {mask.sparsity:.0%} skipped | {d} | {s} | gpuwise | {t[0]:.2f} ms | {t[1]:.2f} ms fwd+bwd | "
                f"{dense_ms[1] / t[1]:.2f}x faster than dense |")
        print(line, flush=True)
        try:
            table_dev = torch.from_numpy(table).to(dev)
            flex = _flex(_table_mod(table_dev), b, h, s, dev)
            tf = (_bench(flex, backward=False, q=q, k=k, v=v), _bench(flex, backward=True, q=q, k=k, v=v))
            print(f"| {mask.sparsity:.0%} skipped | {d} | {s} | flex | {tf[0]:.2f} ms | {tf[1]:.2f} ms fwd+bwd | "
                  f"gpuwise is {tf[1] / t[1]:.2f}x flex |", flush=True)
        except Exception as exc:
            print(f"| flex unavailable: {type(exc).__name__} |||||||")
    del q, k, v
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="seq 1k, 4k and 16k only")
    ap.add_argument("--budget", type=float, default=270, help="seconds; later rows are skipped past it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention.py needs a CUDA GPU")
    import triton

    dev = "cuda"
    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; bf16; "
          f"{TOKENS} tokens per batch, hidden {HIDDEN}")
    print("| case | d | seq | impl | fwd | fwd+bwd | vs |")
    print("|---|---|---|---|---|---|---|")
    _sparsity_rows(dev)  # first: the budget below trims the dense rows, not these
    print("| case | d | seq | impl | fwd TFLOPS | fwd+bwd TFLOPS | x SDPA-flash (fwd+bwd) |")
    seqs = (1024, 4096, 16384) if args.quick else (1024, 2048, 4096, 8192, 16384)
    for d in (64, 128):
        for causal in (True, False):
            for s in seqs:
                if time.perf_counter() - started > args.budget:
                    print(f"| (budget of {args.budget:.0f} s spent: the rest skipped) |||||||")
                    print(f"({time.perf_counter() - started:.0f} s)")
                    return
                b, h = max(1, TOKENS // s), HIDDEN // d
                q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                fraction = (s + 1) / (2 * s) if causal else 1.0
                fwd_flops = 4 * b * h * s * s * d * fraction
                ours = functools.partial(_ours, causal=causal)
                impls = {"gpuwise": ours, "sdpa-flash": _sdpa(causal, True), "sdpa-default": _sdpa(causal, False)}
                if s in (4096, 16384):
                    try:
                        impls["flex"] = _flex((lambda b_, h_, qi, ki: qi >= ki) if causal else
                                              (lambda b_, h_, qi, ki: qi >= 0), b, h, s, dev)
                    except Exception as exc:  # report, keep going
                        print(f"| flex unavailable: {type(exc).__name__} |||||||")
                _check(ours, impls["sdpa-flash"], q, k, v, f"d{d} s{s} causal={causal}")
                times = {}
                for name, fn in impls.items():
                    try:
                        times[name] = (_bench(fn, backward=False, q=q, k=k, v=v),
                                       _bench(fn, backward=True, q=q, k=k, v=v))
                    except Exception as exc:
                        print(f"| {'causal' if causal else 'dense'} | {d} | {s} | {name} | failed: "
                              f"{type(exc).__name__} ||||")
                base = times.get("sdpa-flash")
                for name, (f_ms, fb_ms) in times.items():
                    ratio = f"{base[1] / fb_ms:.2f}" if base else "-"
                    print(f"| {'causal' if causal else 'dense'} | {d} | {s} | {name} | "
                          f"{fwd_flops / f_ms / 1e9:.0f} | {3.5 * fwd_flops / fb_ms / 1e9:.0f} | {ratio} |",
                          flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
