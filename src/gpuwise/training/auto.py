"""The micro-batch chosen from the plan instead of OOM trial and error: the largest one the planner says fits the
memory that is free, with headroom. (The precision is the device's default, decided in ``precision.py``.)"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.capture.scaling import Timeline
from gpuwise.planning.fit import OVERHEAD_BYTES, TIGHT_FRACTION
from gpuwise.planning.planner import Planner
from gpuwise.planning.setup import Setup, largest_micro_batch
from gpuwise.units import human_bytes


@dataclass(frozen=True, kw_only=True)
class Choice:
    micro_batch: int
    grad_accum: int
    fits: int  # the plan's largest micro-batch for the free memory (capped at this process's share)
    reason: str
    # live bytes by category after each op, affine in the micro-batch (with accumulation): the peak at a micro-batch
    # the run falls back to after an OOM, without capturing again (None where the captures do not pair)
    memory: Timeline | None = field(default=None, repr=False, compare=False)


def choose(planner: Planner, setup: Setup, *, free_bytes: int, gpu: bool) -> Choice:
    """The largest micro-batch that divides this process's share of ``setup``'s batch (micro-batch x accumulation)
    and fits ``free_bytes`` less the CUDA overhead (on a GPU) and 10% headroom (the allocator's fragmentation).
    ``planner`` holds the model's captures (``Planner(source)``); a model it cannot capture raises GpuwiseError."""
    per_rank = setup.micro_batch * setup.grad_accum
    capacity = free_bytes * (1 - TIGHT_FRACTION) - (OVERHEAD_BYTES if gpu else 0)
    one = replace(setup, micro_batch=1, grad_accum=2 if per_rank > 1 else 1, gpus=1, sharding="ddp")  # one process
    try:
        w = planner.workload(one, batch_model=True)
    except NotApplicable as exc:  # the user's own setup: a one-line error, as simulate gives
        raise GpuwiseError(*exc.args) from exc
    fits = w.batch_model.max_batch(capacity, per_rank) if w.batch_model is not None else per_rank
    micro = largest_micro_batch(per_rank, fits)
    if micro == 0:
        return Choice(micro_batch=1, grad_accum=per_rank, fits=0, memory=w.batch_model, reason=(
            f"even a micro-batch of 1 needs more than the {human_bytes(free_bytes)} free: "
            "expect an OOM (gpuwise plan shows the remedies)"))
    fits = min(fits, per_rank)
    return Choice(micro_batch=micro, grad_accum=per_rank // micro, fits=fits, memory=w.batch_model, reason=(
        f"micro-batch {micro} x {per_rank // micro} accumulation: the plan fits {fits} "
        f"{'sequences' if setup.seq else 'samples'} in {human_bytes(free_bytes)} free with 10% headroom"))
