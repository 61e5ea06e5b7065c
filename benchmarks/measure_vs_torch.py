"""`gpuwise.measure` against PyTorch's own `torch.utils.benchmark.Timer`, on the same ops and inputs.

Both time the same statement with the same (warm) tensors; the ratio of medians should be within 10% on
the CPU. On a GPU pass --device cuda: Timer synchronises through its own CUDA handling.

    python benchmarks/measure_vs_torch.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from gpuwise.bench import measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    a512, b512 = torch.randn(512, 512, device=dev), torch.randn(512, 512, device=dev)
    a1k, b1k = torch.randn(1024, 1024, device=dev), torch.randn(1024, 1024, device=dev)
    x = torch.randn(32, 1024, 1024, device=dev)
    img, w = torch.randn(8, 64, 56, 56, device=dev), torch.randn(64, 64, 3, 3, device=dev)
    ops = {
        "matmul 512": lambda: a512 @ b512,
        "matmul 1024": lambda: a1k @ b1k,
        "add 32M": lambda: x + 1.0,
        "layer_norm 32x1024x1024": lambda: F.layer_norm(x, (1024,)),
        "conv2d 8x64x56x56": lambda: F.conv2d(img, w, padding=1),
    }
    print(f"machine: {platform.processor() or platform.machine()}, device {dev}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'op':26} {'measure':>12} {'Timer':>12} {'ratio':>7}")
    for name, fn in ops.items():
        with measure(device=args.device, warmup=5, repeats=50) as m:
            for _ in m:
                fn()
        ours = m.result.median_s
        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())  # default: 1
        theirs = timer.blocked_autorange(min_run_time=1.0).median
        print(f"{name:26} {ours * 1e3:10.3f}ms {theirs * 1e3:10.3f}ms {ours / theirs:7.3f}")


if __name__ == "__main__":
    main()
