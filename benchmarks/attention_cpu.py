"""gpuwise.ops.attention's PyTorch path (the CPU, or anywhere without the Triton kernels) against SDPA, in one run
(issue 15's evidence). Needs no GPU.

Rows at ``--seq`` tokens (default 4096; batch 1, 12 heads of 64, fp32, as GPT-2 small), forward and forward +
backward, each against SDPA given the same mask in the way a user would give it:
- causal: ``attention(causal=True)`` vs ``sdpa(is_causal=True)`` (the issue's target: >= 0.8x SDPA's speed);
- dense: no mask on either side;
- KV cache: 256 new queries over all ``--seq`` keys, ``attention(causal="lower_right")`` vs
  ``sdpa(attn_mask=causal_lower_right(256, seq))`` (torch's CausalBias; on the CPU it materialises the mask);
- documents: 4 packed causal documents, ``attention(block_mask=BlockMask.document(..., causal=True))`` vs
  ``sdpa(attn_mask=<the same boolean mask, built once outside the timing>)``;
- before: the path this replaced (the dense mask rebuilt from the BlockMask on each call, then the attention in
  plain PyTorch), forward only, causal.
Ratio = SDPA's median time / gpuwise's median time (above 1: gpuwise faster). Each case is checked against SDPA
before it is timed; the two sides alternate call by call over two rotating sets of inputs (so a load change
on the machine hits both), after one warm-up call each; medians of ``--reps`` calls. The load average is
printed before and after: this is a shared machine.

    PYTHONPATH=src python benchmarks/attention_cpu.py [--seq 4096] [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from gpuwise.ops import BlockMask, attention
from gpuwise.ops.attention import reference, uses_kernel


def _inputs(b: int, h: int, sq: int, sk: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_() for s in (sq, sk, sk)]


def _call(fn, qkv, do, backward: bool) -> float:
    for t in qkv:
        t.grad = None
    start = time.perf_counter()
    if backward:
        fn(*qkv).backward(do)
    else:
        with torch.no_grad():
            fn(*qkv)
    return time.perf_counter() - start


def _race(ours, theirs, sets, do, *, backward: bool, reps: int) -> tuple[float, float]:
    """Median seconds of each, alternating calls over rotating input sets, after one warm-up call each."""
    _call(ours, sets[0], do, backward), _call(theirs, sets[0], do, backward)
    a, b = [], []
    for i in range(reps):
        qkv = sets[i % len(sets)]
        a.append(_call(ours, qkv, do, backward))
        b.append(_call(theirs, qkv, do, backward))
    return statistics.median(a), statistics.median(b)


def _check(ours, theirs, qkv, label: str) -> float:
    with torch.no_grad():
        err = (ours(*qkv) - theirs(*qkv)).abs().max().item()
    if not err < 1e-4:
        raise SystemExit(f"{label}: gpuwise differs from SDPA by {err:.3g}")
    return err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--skip-before", action="store_true", help="leave out the replaced path (slow, ~1 GiB)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s, h, d, dtype = args.seq, args.heads, args.head_dim, torch.float32
    if uses_kernel(torch.empty(1, 1, 1, d, dtype=dtype)):
        raise SystemExit("TRITON_INTERPRET is set: attention would run the interpreted kernels; unset it")
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min); fp32, batch 1, {h} heads of {d}, "
          f"{args.reps} reps, medians")
    print("| case | seq_q x seq_k | pass | gpuwise | SDPA | ratio (SDPA / gpuwise time) |")
    print("|---|---|---|---|---|---|")
    started = time.perf_counter()

    from torch.nn.attention.bias import causal_lower_right

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "NaNs when seq_len_q > seq_len_kv" (not the case here)
        cache_bias = causal_lower_right(256, s)
    docs = BlockMask.document(torch.arange(s) * 4 // s, causal=True)
    doc_dense = docs.to_dense()[:, None]  # SDPA's mask, built once (not timed)
    cases = [
        ("causal", s, s, lambda q, k, v: attention(q, k, v, causal=True),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("dense", s, s, lambda q, k, v: attention(q, k, v), F.scaled_dot_product_attention),
        ("KV cache (lower_right)", 256, s, lambda q, k, v: attention(q, k, v, causal="lower_right"),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=cache_bias)),
        ("4 documents, causal", s, s, lambda q, k, v: attention(q, k, v, block_mask=docs),
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=doc_dense)),
    ]
    for label, sq, sk, ours, theirs in cases:
        sets = [_inputs(1, h, sq, sk, d, dtype, seed) for seed in (0, 1)]
        do = torch.randn(1, h, sq, d, dtype=dtype)
        _check(ours, theirs, sets[0], label)
        for backward in (False, True):
            a, b = _race(ours, theirs, sets, do, backward=backward, reps=args.reps)
            print(f"| {label} | {sq} x {sk} | {'fwd+bwd' if backward else 'fwd'} | {a * 1e3:.0f} ms | "
                  f"{b * 1e3:.0f} ms | {b / a:.2f} |", flush=True)
    if not args.skip_before:
        def before(q, k, v):  # the replaced path: the element mask rebuilt, then attention in plain PyTorch
            return reference(q, k, v, BlockMask.causal(s, s).to_dense(), d ** -0.5)

        sets = [_inputs(1, h, s, s, d, dtype, seed) for seed in (0, 1)]
        _check(before, cases[0][4], sets[0], "before")
        a, b = _race(before, cases[0][4], sets, None, backward=False, reps=max(3, args.reps // 2))
        print(f"| before (mask rebuilt per call), causal | {s} x {s} | fwd | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | "
              f"{b / a:.2f} |", flush=True)
    load = os.getloadavg()
    print(f"({time.perf_counter() - started:.0f} s; load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")


if __name__ == "__main__":
    main()
