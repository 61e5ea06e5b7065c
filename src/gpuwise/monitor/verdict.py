"""The monitor's vocabulary: what the diagnosis knows (``Context``, ``Loader``), what one rule says (``Verdict``)
and what the whole diagnosis says (``Diagnosis``). ``monitor.rules.judge`` makes them; ``render.diagnosis`` shows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# "healthy": every rule that applies judged and none fired; "not-judged": what the loop's time goes to could not be
# judged (no step timings, too few steps, nothing recorded), with what was missing and how to supply it
Bottleneck = Literal["input-bound", "host-bound", "memory-bound", "compute-bound", "communication-bound",
                     "stalls", "straggler", "oversubscribed", "fragmentation", "throttled", "memory-full",
                     "memory-leak", "healthy", "not-judged"]
BOTTLENECKS: tuple[str, ...] = ("input-bound", "host-bound", "memory-bound", "compute-bound", "communication-bound",
                                "stalls", "straggler", "oversubscribed", "fragmentation", "throttled", "memory-full",
                                "memory-leak", "healthy", "not-judged")

# time a fix wins back
LOSS = ("input-bound", "communication-bound", "stalls", "straggler", "oversubscribed", "host-bound", "throttled")
RISK = ("memory-full", "memory-leak", "fragmentation")  # no time lost yet: a run heading for failure
ROOFLINE = ("memory-bound", "compute-bound")  # said only when no loss class fired


@dataclass(frozen=True, kw_only=True)
class Loader:
    """How the data is loaded now, where known (a torch DataLoader's own settings)."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the diagnosis knows beyond the record: the machine, the loader, and the plan where there is one."""

    device: str = "cpu"  # "cuda", "mps" or "cpu": what the loop ran on
    usable_cores: int = 1
    world_size: int = 1  # processes (DDP/FSDP ranks) on this machine
    loader: Loader | None = None
    peak_tflops: float | None = None  # the device's dense rate at the run's precision (catalog or calibration)
    bandwidth_gbps: float | None = None  # its memory bandwidth
    memory_total_bytes: int | None = None
    planned_step_s: float | None = None  # the plan's predicted step time on this device
    planned_peak_bytes: float | None = None  # the plan's peak memory per device
    planned_bytes_per_step: float | None = None  # bytes the step moves (roofline with the FLOPs of each step)
    kernels_per_step: int | None = None  # kernel launches of the captured step (host-bound evidence)
    remedies: tuple[str, ...] = ()  # the plan's remedies in order, each as the flags to add (memory-full)
    grad_accum: int | None = None  # micro-batches per optimizer step the loop already runs (a fix never re-proposes)
    threads: int | None = None  # torch's intra-op threads in the loop's process (torch.get_num_threads), where known


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One class that fired: what it costs, why we say so, and what to change."""

    bottleneck: Bottleneck
    share: float | None  # fraction of step time it costs (None: a risk rather than time: memory-full, fragmentation)
    evidence: dict[str, Any]
    fix: tuple[str, ...]  # concrete changes, most useful first
    expected: str | None = None  # the expected effect, in words with numbers
    source: str = ""  # where the threshold comes from
    summary: str = ""  # the headline in a few words ("data wait 71% of each step")
    change: dict[str, Any] = field(default_factory=dict)  # the fix as settings ({"num_workers": 3, ...}) where
    # it is one a program can apply (gpuwise train --fix-input)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    bottleneck: Bottleneck
    evidence: dict[str, Any]
    fix: tuple[str, ...]
    expected: str | None = None
    findings: tuple[Verdict, ...] = ()  # every class that fired, the primary first
    steps: int = 0  # step events the diagnosis saw (after the warm-up it skips)
    observed_vs_planned: dict[str, Any] = field(default_factory=dict)  # step time and peak memory, where planned
    note: str | None = None  # what it could not see ("no GPU counters: CPU side only")
    summary: str = ""  # the primary finding's headline


__all__ = ["BOTTLENECKS", "LOSS", "RISK", "ROOFLINE", "Bottleneck", "Context", "Diagnosis", "Loader", "Verdict"]
