"""Settings chosen from the plan instead of OOM trial and error: precision from the device, and the largest
micro-batch the planner says fits the memory that is free, with headroom."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwise.planning.plan import OVERHEAD_BYTES, TIGHT_FRACTION
from gpuwise.planning.setup import Setup
from gpuwise.planning.workload import simulate
from gpuwise.units import human_bytes


@dataclass(frozen=True, kw_only=True)
class Choice:
    precision: str
    micro_batch: int
    grad_accum: int
    fits: int  # the plan's largest micro-batch for the free memory (capped at this process's share)
    reason: str


def choose_precision(device_type: str, bf16: bool) -> tuple[str, str]:
    if device_type == "cuda":
        return ("bf16-mixed", "the GPU has bf16") if bf16 else ("fp16-mixed", "no bf16 on this GPU: fp16 with a scaler")
    return "fp32", f"{device_type} training runs in fp32"


def choose(source, *, precision: str | None, seq: int | None, per_rank: int, free_bytes: int, device_type: str,
           bf16: bool, checkpointing: bool = False) -> Choice:
    """Precision for the device (unless given), then the largest micro-batch that divides this process's share
    of the batch and fits ``free_bytes`` less the CUDA overhead and 10% headroom (the allocator's fragmentation)."""
    precision, why = choose_precision(device_type, bf16) if precision is None else (precision, "as asked")
    overhead = OVERHEAD_BYTES if device_type == "cuda" else 0
    capacity = free_bytes * (1 - TIGHT_FRACTION) - overhead
    w = simulate(source, Setup(micro_batch=1, seq=seq, precision=precision, grad_accum=2 if per_rank > 1 else 1,
                               checkpointing="full" if checkpointing else "none"))
    fits = w.batch_model.max_batch(capacity, per_rank) if w.batch_model is not None else per_rank
    micro = next((m for m in range(min(fits, per_rank), 0, -1) if per_rank % m == 0), 0)
    if micro == 0:
        return Choice(precision=precision, micro_batch=1, grad_accum=per_rank, fits=0, reason=(
            f"{precision} ({why}); even a micro-batch of 1 needs more than the {human_bytes(free_bytes)} free: "
            "expect an OOM (gpuwise plan shows the remedies)"))
    fits = min(fits, per_rank)
    return Choice(precision=precision, micro_batch=micro, grad_accum=per_rank // micro, fits=fits, reason=(
        f"{precision} ({why}); micro-batch {micro} x {per_rank // micro} accumulation: the plan fits {fits} "
        f"{'sequences' if seq else 'samples'} in {human_bytes(free_bytes)} free with 10% headroom"))

