"""The rules of communication between ranks: exposed all-reduce time, and the rank the others wait for.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).
"""

from __future__ import annotations

import math
import statistics

from gpuwise.monitor.thresholds import COMM_EXPOSED_SHARE, MIN_JUDGED_STEPS, WINDOW_STEPS
from gpuwise.monitor.verdict import Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, median, ms, pct, persistent, rounded


def communication_bound(view: Window, earlier: Earlier) -> Judged | None:
    """Exposed communication (what backward did not hide) past ``COMM_EXPOSED_SHARE`` of the step. Needs step
    timings."""
    if not view.timed:
        return None
    ctx = view.context
    steps = [s for s in view.steps if s.exposed_comm_s is not None]
    if len(steps) < MIN_JUDGED_STEPS:
        return None, {"exposed_comm": "not timed"}
    shares = [s.exposed_comm_s / s.seconds for s in steps]  # type: ignore[operator]
    p = persistent(shares, COMM_EXPOSED_SHARE, WINDOW_STEPS)
    checked = {"exposed_comm_share_median": rounded(p.median), "exposed_comm_threshold": COMM_EXPOSED_SHARE}
    if not p.fires:
        return None, checked
    step = statistics.median(s.seconds for s in steps)
    exposed = statistics.median(s.exposed_comm_s for s in steps)  # type: ignore[type-var]
    comm = median([s.comm_s for s in steps if s.comm_s is not None])
    k = min(8, max(2, math.ceil(p.median / COMM_EXPOSED_SHARE)))
    step_k = step - exposed * (1 - 1 / k)
    evidence = {**checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
                "exposed_comm_s_median": rounded(exposed, 6), "comm_s_median": rounded(comm, 6),
                "step_s_median": rounded(step, 6),
                "world_size": ctx.world_size, "accumulation_suggested": k}
    fix = (f"gradient accumulation: {k} micro-batches per optimizer step, the first {k - 1} under model.no_sync(), "
           f"so one all-reduce serves {k} batches (exposed comm per sample ÷{k}; scale the LR for the larger batch)",
           "DDP(model, bucket_cap_mb=...): the default is 25; try 50 or 100 (fewer, larger all-reduces) and "
           "gradient_as_bucket_view=True; a smaller value if only the last bucket is exposed",
           "a faster link: NVLink / InfiniBand instead of PCIe / Ethernet; NCCL_DEBUG=INFO shows the transport NCCL "
           "picked (a P2P or IB path disabled by NCCL_P2P_DISABLE / NCCL_IB_DISABLE falls back to sockets)")
    expected = (f"at most {pct(p.median)} off each step if all communication were hidden ({ms(step)} → "
                f"{ms(step - exposed)}); with {k}-step accumulation ≈ {ms(step_k)} per micro-batch "
                f"({step / step_k:.2f}×)")
    return Verdict(bottleneck="communication-bound", share=p.median, evidence=evidence, fix=fix, expected=expected,
                   source="TB plugin communication > 10% of step (exposed part only); SageMaker window/patience",
                   summary=f"exposed communication {pct(p.median)} of each step"), checked


def straggler(view: Window, earlier: Earlier) -> Judged | None:
    """One rank's own work (its step less the waits) well above the others'. Needs every rank's step events."""
    return None


__all__ = ["communication_bound", "straggler"]
