"""How long `gpuwise plan` takes, and what capturing 2 and 3 blocks then scaling saves.

Peer, measured in the same run: the same step captured with every block (no scaling). Both give the
same peak; the script checks it and prints the ratio of their times.

    python benchmarks/plan_speed.py            # llama2-70b and gpt2-xl
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time

import torch

from gpuwise.models import get_model
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource


def cli_seconds(*args: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpuwise", "plan", *args], check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print("\n`gpuwise plan --model llama2-70b` (all catalog GPUs, remedies for h100-sxm), wall time of the CLI:")
    runs = [cli_seconds("--model", "llama2-70b") for _ in range(3)]
    print(f"  {', '.join(f'{r:.2f}' for r in runs)} s (median {sorted(runs)[1]:.2f} s)")

    print("\nscaled capture (2 and 3 blocks) vs every block, one setup, same process:")
    print(f"  {'model':12} {'setup':32} {'scaled s':>9} {'full s':>8} {'speed-up':>9} {'peak GiB':>9} {'same peak':>9}")
    for name, setup, label in (("gpt2-xl", Setup(micro_batch=4, seq=1024), "batch 4, seq 1024"),
                               ("llama2-70b", Setup(seq=4096), "batch 1, seq 4096"),
                               ("llama2-70b", Setup(seq=4096, checkpointing="full"), "batch 1, seq 4096, ckpt")):
        src = ZooSource(zoo=get_model(name))
        simulate(src, setup, batch_model=False)  # warm up fake-tensor caches
        t = time.perf_counter()
        w = simulate(src, setup, batch_model=False)
        scaled = time.perf_counter() - t
        t = time.perf_counter()
        c = capture(src, setup, batch=setup.micro_batch)
        full = time.perf_counter() - t
        peak_scaled = w.timeline.live(setup.micro_batch).sum(axis=1).max()
        peak_full = c.live.sum(axis=1).max()
        same = abs(peak_scaled - peak_full) <= 512 * 1024  # the allocator's rounding of odd-sized tensors
        print(f"  {name:12} {label:32} {scaled:9.2f} {full:8.2f} {full / scaled:8.1f}x "
              f"{peak_scaled / 2**30:9.2f} {'yes' if same else 'NO':>9}")


if __name__ == "__main__":
    main()
