"""Planned peak memory against what the GPU reports, for zoo models and setups (needs CUDA).

For each setup: the plan (fake tensors on the CPU, as users run it), then the same step run for real
on the GPU with real autocast, real kernels and real dropout, reading torch.cuda.max_memory_allocated().
Prints a table (also written to $OUT/plan_vs_gpu.md when OUT is set) and the CUDA context overhead
measured by NVML (process memory minus what PyTorch reserved).

    PYTHONPATH=src python benchmarks/plan_vs_gpu.py            # on a GPU machine
    PYTHONPATH=src python benchmarks/plan_vs_gpu.py --device cpu --quick   # the same code path on the CPU
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from gpuwise.models import get_model
from gpuwise.planning.capture import capture
from gpuwise.planning.setup import Setup
from gpuwise.planning.source import ZooSource
from gpuwise.planning.workload import simulate
from gpuwise.units import GiB

CASES = [
    ("gpt2", Setup(batch=8, seq=1024)),
    ("gpt2", Setup(batch=8, seq=1024, checkpointing="full")),
    ("gpt2", Setup(batch=8, seq=1024, precision="fp32")),
    ("gpt2-medium", Setup(batch=4, seq=1024, grad_accum=2, optimizer="sgd")),
    ("bert-base", Setup(batch=32, seq=512, precision="fp32")),
    ("vit-b16", Setup(batch=64)),
    ("resnet50", Setup(batch=64, precision="fp32")),
    ("llama3.2-1b", Setup(batch=2, seq=2048)),
    ("llama3.2-1b", Setup(task="finetune-lora", batch=2, seq=2048)),
    ("llama2-7b", Setup(task="infer", batch=4, seq=4096)),
]
QUICK = [("gpt2", Setup(batch=2, seq=128)), ("gpt2", Setup(batch=2, seq=128, checkpointing="full")),
         ("resnet50", Setup(batch=2, image_size=64, precision="fp32")), ("gpt2", Setup(task="infer", seq=128))]


def context_overhead_bytes() -> int | None:
    """NVML's memory for this process minus PyTorch's reserved memory: the CUDA context and libraries."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory) - torch.cuda.memory_reserved()
    except Exception as exc:  # NVML absent or not allowed in this container: say so, keep going
        print(f"NVML process memory unavailable: {exc}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small cases (for checking the script on a CPU)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --device cpu --quick to check the script")
    lines = ["| model | setup | planned GiB | measured GiB | planned / measured | tracker on device GiB | s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    print(lines[0])
    ratios = []
    for name, setup in QUICK if args.quick else CASES:
        src = ZooSource(zoo=get_model(name))
        t = time.perf_counter()
        planned = simulate(src, setup, batch_model=False).timeline.live(setup.batch).sum(axis=1).max()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        real = capture(src, setup, batch=setup.batch, device=args.device, fake=False)
        tracked = real.live.sum(axis=1).max()
        measured = real.measured_peak_bytes if real.measured_peak_bytes is not None else tracked
        ratios.append(planned / measured)
        line = (f"| {name} | {setup.describe()} | {planned / GiB:.3f} | {measured / GiB:.3f} | "
                f"{planned / measured:.3f} | {tracked / GiB:.3f} | {time.perf_counter() - t:.1f} |")
        lines.append(line)
        print(line, flush=True)
        del real
        gc.collect()
    worst = max(abs(r - 1) for r in ratios)
    summary = f"\n{len(ratios)} setups; worst |planned/measured - 1| = {100 * worst:.1f}% (target: within 5%)"
    if args.device == "cuda":
        torch.ones(1, device="cuda")  # make sure the context exists
        over = context_overhead_bytes()
        summary += (f"\nCUDA context + libraries (NVML process memory - torch reserved): "
                    f"{over / 2**20:.0f} MiB" if over is not None else "") + \
            f"; gpuwise assumes {(512 + 32)} MiB"
        summary += f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(summary)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "plan_vs_gpu.md"), "w") as f:
            f.write("\n".join(lines) + "\n" + summary + "\n")


if __name__ == "__main__":
    main()
