"""GPT-2 124M training throughput and MFU with the Trainer, eager and compiled, and --auto's micro-batch
against the largest one that really fits (issue 5's GPU evidence). Needs a CUDA GPU; about 3 minutes.

MFU two ways: the planner's FLOPs per step (what `gpuwise train` logs) and PaLM's 6N + 12·L·H·Q·T per token
(what nanoGPT reports; nanoGPT: 37% on an A100), both over the catalog's dense bf16 peak.

    PYTHONPATH=src python benchmarks/train_gpu.py [--steps 30] [--micro 16] [--seq 1024]
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from gpuwise.hardware.device import Target, local_machine, resolve_device
from gpuwise.models import get_model
from gpuwise.optim import param_groups
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.planner import Planner
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.training.auto import choose
from gpuwise.training.config import TrainConfig
from gpuwise.training.loss import model_loss
from gpuwise.training.meter import mfu_peak_tflops
from gpuwise.training.runplan import RunPlan
from gpuwise.training.trainer import OutOfMemory, Runtime, Trainer


class RandomTokens:
    """Numbered batches of random tokens: throughput does not depend on the text."""

    def __init__(self, vocab: int, seq: int) -> None:
        self.vocab, self.seq = vocab, seq

    def batch(self, number: int, size: int):
        g = torch.Generator().manual_seed(number)
        t = torch.randint(self.vocab, (size, self.seq + 1), generator=g)
        return t[:, :-1], t[:, 1:]


def build(zoo, fused: bool = True):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = zoo.instantiate(None)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), fused=fused)
    return model, opt


def step_fits(zoo, seq: int, micro: int, target: Target) -> bool:
    """One real bf16-mixed training step (optimizer included) at this micro-batch."""
    model, opt = build(zoo)
    data = RandomTokens(zoo.config.vocab_size, seq)
    try:
        Trainer(model, opt, data, TrainConfig(steps=2, batch=micro, precision="bf16-mixed", warmup_steps=1),
                loss_fn=model_loss, runtime=Runtime(device=target)).fit()
        return True
    except OutOfMemory:
        return False
    except Exception as exc:  # the Trainer turns an OOM in the optimizer step into a GpuwiseError
        if "out of memory" in str(exc):
            return False
        raise
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()


def largest_fitting(zoo, seq: int, limit: int, target: Target) -> int:
    lo, hi = 0, 8
    while hi <= limit and step_fits(zoo, seq, hi, target):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step_fits(zoo, seq, mid, target) else (lo, mid)
    return lo


def throughput(zoo, seq: int, micro: int, steps: int, compiled: bool, target: Target) -> dict:
    model, opt = build(zoo)
    cfg = TrainConfig(steps=steps, batch=micro, precision="bf16-mixed", log_every=1, warmup_steps=2,
                      compile=compiled)
    n = sum(p.numel() for p in model.parameters())
    c = zoo.config
    palm = (6 * n + 12 * c.n_layer * c.n_embd * seq) * micro * seq  # PaLM appendix B, per step
    planned = simulate(ZooSource(zoo=zoo), cfg.to_setup(seq=seq), batch_model=False).flops_per_step
    peak = mfu_peak_tflops(target, cfg.precision)
    result = Trainer(model, opt, RandomTokens(c.vocab_size, seq), cfg, loss_fn=model_loss,
                     runtime=Runtime(device=target, plan=RunPlan(flops_per_step=planned))).fit()
    later = sorted(result.logs[steps // 3:], key=lambda log: log.tokens_per_s)  # after warm-up and compile
    mid = later[len(later) // 2]
    step_s = micro * seq / mid.tokens_per_s
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens_per_s": mid.tokens_per_s, "mfu_planned": mid.mfu,
            "mfu_palm": palm / step_s / (peak * 1e12) if peak else None, "peak_bytes": mid.peak_memory_bytes,
            "loss": result.final_loss}


def _pct(value: float | None) -> str:
    return f"{100 * value:.1f}%" if value else "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=256, help="largest micro-batch to try")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_gpu.py needs a CUDA GPU")
    target = resolve_device("cuda:0", local_machine(os.environ))
    peak = mfu_peak_tflops(target, "bf16-mixed")
    zoo = get_model("gpt2")
    print(f"device: {target.model}, {target.memory_total_bytes / 2**30:.1f} GiB; catalog bf16 peak {peak} TFLOPS; "
          f"torch {torch.__version__}; GPT-2 124M, seq {args.seq}, bf16-mixed, fused AdamW")
    print("| run | micro-batch | tokens/s | MFU (planner FLOPs) | MFU (6N+12LHQT) | peak memory |")
    print("|---|---|---|---|---|---|")
    for compiled in (False, True):
        t0 = time.perf_counter()
        r = throughput(zoo, args.seq, args.micro, args.steps, compiled, target)
        print(f"| {'compiled' if compiled else 'eager'} | {args.micro} | {r['tokens_per_s']:,.0f} | "
              f"{_pct(r['mfu_planned'])} | {_pct(r['mfu_palm'])} | {r['peak_bytes'] / 2**30:.2f} GiB | "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    free = torch.cuda.mem_get_info()[0]
    setup = TrainConfig(batch=args.limit, precision="bf16-mixed").to_setup(seq=args.seq)
    choice = choose(Planner(ZooSource(zoo=zoo)), setup, free_bytes=free, gpu=True)
    t0 = time.perf_counter()
    real = largest_fitting(zoo, args.seq, args.limit, target)
    print(f"--auto: the plan fits {choice.fits} sequences in {free / 2**30:.1f} GiB free keeping 10% headroom "
          "(so plan/real near 0.9 is right); "
          f"the largest that really fits (one real step each, bisected): {real}; plan/real = "
          f"{choice.fits / max(real, 1):.2f} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
