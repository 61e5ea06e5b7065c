"""Planned peak memory against what the GPU reports, for zoo models and setups (needs CUDA).

For each setup: the plan (fake tensors on the CPU, as users run it), then the same step run for real
on the GPU with real autocast, real kernels and real dropout, reading torch.cuda.max_memory_allocated()
minus what was allocated before the step (cuBLAS workspaces come from the caching allocator too).
Prints a table (also written to $OUT/plan_vs_gpu.md when OUT is set) and the CUDA context size
measured with NVML. On the CPU (--device cpu) there is no allocator to ask, so the tracker on real
tensors stands in: that checks the script's code path, not the plan.

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
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.units import GiB

CASES = [
    ("gpt2", Setup(micro_batch=8, seq=1024)),
    ("gpt2", Setup(micro_batch=8, seq=1024, checkpointing="full")),
    ("gpt2", Setup(micro_batch=8, seq=1024, precision="fp32")),
    ("gpt2-medium", Setup(micro_batch=4, seq=1024, grad_accum=2, optimizer="sgd")),
    ("bert-base", Setup(micro_batch=32, seq=512, precision="fp32")),
    ("vit-b16", Setup(micro_batch=64)),
    ("resnet50", Setup(micro_batch=64, precision="fp32")),
    ("llama3.2-1b", Setup(micro_batch=2, seq=2048)),
    ("llama3.2-1b", Setup(task="finetune-lora", micro_batch=2, seq=2048)),
    ("llama2-7b", Setup(task="infer", micro_batch=4, seq=4096)),
]
QUICK = [("gpt2", Setup(micro_batch=2, seq=128)), ("gpt2", Setup(micro_batch=2, seq=128, checkpointing="full")),
         ("resnet50", Setup(micro_batch=2, image_size=64, precision="fp32")), ("gpt2", Setup(task="infer", seq=128))]


def nvml_used_bytes() -> int | None:
    """Memory in use on the first visible GPU, as nvidia-smi shows it (None without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0)))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception as exc:  # NVML absent or not allowed in this container: say so, keep going
        print(f"NVML unavailable: {exc}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small cases (for checking the script on a CPU)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --device cpu --quick to check the script")
    notes = []
    if cuda:  # the context and libraries: device memory used after CUDA and cuBLAS start, minus PyTorch's reserve
        before = nvml_used_bytes()
        torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
        torch.cuda.synchronize()
        after = nvml_used_bytes()
        if before is not None and after is not None:
            notes.append(f"CUDA context + libraries: {(after - before - torch.cuda.memory_reserved()) / 2**20:.0f} "
                         f"MiB (NVML used after start - before - torch reserved); gpuwise assumes 544 MiB")
        notes.append(f"cuBLAS workspace etc. allocated through PyTorch before the first step: "
                     f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB")
    lines = ["| model | setup | planned GiB | measured GiB | planned / measured | requested peak GiB | "
             "allocated before GiB | s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print(lines[0])
    ratios = []
    for name, setup in QUICK if args.quick else CASES:
        src = ZooSource(zoo=get_model(name))
        t = time.perf_counter()
        try:
            planned = simulate(src, setup, batch_model=False).timeline.live(setup.micro_batch).sum(axis=1).max()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            baseline = torch.cuda.memory_allocated() if cuda else 0  # leftovers and library workspaces
            torch.manual_seed(0)
            real = capture(src, setup, batch=setup.micro_batch, device=args.device, fake=False)
            # On a GPU: the allocator's own peak, minus what was allocated before the step began.
            # On the CPU there is no allocator to ask: the tracker's total stands in (a check of the code path).
            measured = (real.measured_peak_bytes - baseline) if cuda else real.live.sum(axis=1).max()
            requested = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0) - baseline if cuda else measured
            ratios.append(planned / measured)
            line = (f"| {name} | {setup.describe()} | {planned / GiB:.3f} | {measured / GiB:.3f} | "
                    f"{planned / measured:.3f} | {requested / GiB:.3f} | {baseline / GiB:.3f} | "
                    f"{time.perf_counter() - t:.1f} |")
            del real
        except Exception as exc:  # one broken case must not lose the others
            line = f"| {name} | {setup.describe()} | error: {type(exc).__name__}: {str(exc)[:120]} | | | | | |"
        lines.append(line)
        print(line, flush=True)
        gc.collect()
    worst = max((abs(r - 1) for r in ratios), default=float("nan"))
    summary = [f"{len(ratios)} setups; worst |planned/measured - 1| = {100 * worst:.1f}% (target: within 5%)",
               *notes]
    if cuda:
        summary.append(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n".join(summary))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "plan_vs_gpu.md"), "w") as f:
            f.write("\n".join(lines) + "\n\n" + "\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
