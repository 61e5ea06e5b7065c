"""The micro-batch chosen from the plan instead of OOM trial and error: the largest one the planner says fits the
memory that is free, with headroom. (The precision is the device's default, decided in ``precision.py``.)"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.fit import OVERHEAD_BYTES, TIGHT_FRACTION
from gpuwise.planning.setup import Setup, largest_micro_batch
from gpuwise.units import human_bytes


@dataclass(frozen=True, kw_only=True)
class Choice:
    micro_batch: int
    grad_accum: int
    fits: int  # the plan's largest micro-batch for the free memory (capped at this process's share)
    reason: str


def choose(source, setup: Setup, *, free_bytes: int, gpu: bool) -> Choice:
    """The largest micro-batch that divides this process's share of ``setup``'s batch (micro-batch x accumulation)
    and fits ``free_bytes`` less the CUDA overhead (on a GPU) and 10% headroom (the allocator's fragmentation)."""
    per_rank = setup.micro_batch * setup.grad_accum
    capacity = free_bytes * (1 - TIGHT_FRACTION) - (OVERHEAD_BYTES if gpu else 0)
    one = replace(setup, micro_batch=1, grad_accum=2 if per_rank > 1 else 1, gpus=1, sharding="ddp")  # one process
    w = simulate(source, one)
    fits = w.batch_model.max_batch(capacity, per_rank) if w.batch_model is not None else per_rank
    micro = largest_micro_batch(per_rank, fits)
    if micro == 0:
        return Choice(micro_batch=1, grad_accum=per_rank, fits=0, reason=(
            f"even a micro-batch of 1 needs more than the {human_bytes(free_bytes)} free: "
            "expect an OOM (gpuwise plan shows the remedies)"))
    fits = min(fits, per_rank)
    return Choice(micro_batch=micro, grad_accum=per_rank // micro, fits=fits, reason=(
        f"micro-batch {micro} x {per_rank // micro} accumulation: the plan fits {fits} "
        f"{'sequences' if setup.seq else 'samples'} in {human_bytes(free_bytes)} free with 10% headroom"))
