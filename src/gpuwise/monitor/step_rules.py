"""The rules of the step's own time: outliers and periodic stalls, and where the time went.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).

``stalls`` judges each step's wall span, end to end (the timed step plus whatever ran between it and the step before:
a checkpoint save, an evaluation, a log line, where the loop timed the step without them). A step is an outlier when
it is ``STALL_RATIO`` x the median AND at least ``STALL_MIN_EXCESS_S`` over it; the time lost is what the outliers
spent over the median, as a share of the wall time of the judged steps. A period is named when the outliers fall on
one phase of a fixed step interval (every 10th step). It fires when the share is material over the whole run AND
in at least half the windows (one slow step, or one checkpoint, never fires), and names where the outliers' extra
time went: the data wait, inside the step, the exposed communication, or between the timed steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwise.monitor.thresholds import WINDOW_STEPS
from gpuwise.monitor.verdict import Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, ms, pct, rounded

# An outlier is a step over 2x the median. Measured on this 2-core VM shared with other jobs (a 1-thread 32 ms
# matmul loop, 190 steps): p95 = 1.48x and max = 1.61x the median, no step over 2x; a 20 ms sleep loop: max 1.21x.
# SageMaker's StepOutlier uses mean + 3 sigma, which a 10 % share of outliers inflates past the outliers themselves
# (a bimodal 20/320 ms run: mean 50 ms, sigma 90 ms, cut 320 ms); the median is not moved by them.
STALL_RATIO = 2.0
# ... and at least 10 ms over it: a sub-millisecond step doubles with one scheduler preemption (Linux's EEVDF base
# slice is 0.75 ms x (1 + log2 cores), 3 ms on 8 cores), which no change to the loop removes.
STALL_MIN_EXCESS_S = 0.010
# Material: the outliers lose >= 10 % of the wall time (the TB plugin's "> 10 % of the step" line for communication,
# the share our other loss classes fire at).
STALL_SHARE = 0.10
# Never from fewer than 3 outliers: one slow step or one checkpoint is not a pattern, and a period needs 3 repeats.
STALL_MIN_OUTLIERS = 3
# A period: the outliers on one phase of the interval lose 3/4 of the time lost, and 3 in 4 of the steps on that phase
# are outliers (room for a stall that came out just under the cut, and for small unrelated slow steps: on this
# loaded CPU a 60-step train run with a 0.3 s stall every 10 steps also had 2 random steps just over the cut).
PERIOD_SHARE = 0.75
MAX_PERIOD_CANDIDATES = 20  # intervals tried: the most common gaps between outliers (bounds the live diagnosis' cost)

_SOURCE = ("outliers over 2x the median step (measured healthy jitter <= 1.6x); SageMaker StepOutlier counts step "
           "outliers, here against the median; loss >= 10% of wall time in half the windows; torchtitan gc_freq=50")
_CAUSES = ("data wait", "inside the step", "synchronisation", "between steps")


@dataclass(frozen=True)
class _Step:
    step: int
    wall: float  # its span end to end (the timed step and anything run between it and the step before), less the
    # waits the earlier rules explain
    full: float  # the whole span
    parts: dict[str, float]  # the wall span by cause (_CAUSES), those the earlier rules have not claimed


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1)."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _spans(view: Window, *, data_claimed: bool, comm_claimed: bool) -> list[_Step]:
    out: list[_Step] = []
    prev_end = None
    for s in view.steps:
        wall = s.seconds if prev_end is None else max(s.seconds, s.t - prev_end)
        prev_end = s.t
        data = min(s.data_wait_s, s.seconds)
        comm = min(s.exposed_comm_s or 0.0, s.seconds - data)
        parts = {"data wait": data, "synchronisation": comm, "inside the step": s.seconds - data - comm,
                 "between steps": wall - s.seconds}
        # a wait that input-bound (or communication-bound / straggler) already explains is theirs, not a stall
        claimed = (data if data_claimed else 0.0) + (comm if comm_claimed else 0.0)
        if data_claimed:
            parts.pop("data wait")
        if comm_claimed:
            parts.pop("synchronisation")
        out.append(_Step(step=s.step, wall=wall - claimed, full=wall, parts=parts))
    return out


def _period(outliers: Sequence[tuple[int, float]], steps: Sequence[int]) -> tuple[int, int] | None:
    """(interval, phase) when the outliers (step, time lost) recur every ``interval`` steps, else None: the outliers
    on one phase lose ``PERIOD_SHARE`` of the time lost, and as many of the steps on that phase are outliers."""
    if len(outliers) < STALL_MIN_OUTLIERS:
        return None
    at = [s for s, _ in outliers]
    big = statistics.median(e for _, e in outliers)
    major = [s for s, e in outliers if e >= big]  # a few small outliers between the stalls must not hide the interval
    gaps = Counter(b - a for seq in (at, major) for a, b in itertools.pairwise(seq) if b - a >= 2)
    known, hi, lost = set(steps), at[-1], sum(e for _, e in outliers)
    for d in sorted(d for d, _ in gaps.most_common(MAX_PERIOD_CANDIDATES)):
        by_phase: dict[int, list[float]] = {}
        for s, e in outliers:
            by_phase.setdefault(s % d, []).append(e)
        phase, hit = max(by_phase.items(), key=lambda kv: sum(kv[1]))
        if len(hit) < STALL_MIN_OUTLIERS or sum(hit) < PERIOD_SHARE * lost:
            continue
        first = min(s for s in at if s % d == phase)
        on_phase = sum(1 for k in range(first, hi + 1, d) if k in known)
        if len(hit) >= PERIOD_SHARE * on_phase:
            return d, phase
    return None


def _windows(n: int, size: int) -> list[range]:
    """Consecutive windows of ``size`` steps; a last one shorter than half a window joins the one before."""
    cuts = [range(i, min(n, i + size)) for i in range(0, n, size)]
    if len(cuts) > 1 and len(cuts[-1]) < size / 2:
        cuts[-2:] = [range(cuts[-2].start, n)]
    return cuts


def stalls(view: Window, earlier: Earlier) -> Judged | None:
    """Step-time outliers and periodic stalls: the share of wall time they lose, their period, where their extra
    time went and the fix for it. Needs step timings; what input-bound or communication-bound already explains is
    left to them."""
    if not view.timed:
        return None
    fired = {name for name, (verdict, _) in earlier.items() if verdict is not None}
    data_claimed = "input-bound" in fired
    comm_claimed = bool(fired & {"communication-bound", "straggler"})
    spans = _spans(view, data_claimed=data_claimed, comm_claimed=comm_claimed)
    walls = [s.wall for s in spans]
    median = statistics.median(walls)
    total = sum(s.full for s in spans)
    cut = max(STALL_RATIO * median, median + STALL_MIN_EXCESS_S)
    out_idx = [i for i, w in enumerate(walls) if w > cut]
    lost = sum(walls[i] - median for i in out_idx)
    share = lost / total if total > 0 else 0.0
    period = _period([(spans[i].step, walls[i] - median) for i in out_idx], [s.step for s in spans])
    checked: dict[str, Any] = {
        "step_wall_s_median": rounded(median, 6), "step_wall_s_p95": rounded(_percentile(walls, 0.95), 6),
        "step_wall_s_max": rounded(max(walls), 6), "outlier_cut_s": rounded(cut, 6), "outliers": len(out_idx),
        "stall_share": rounded(share), "stall_share_threshold": STALL_SHARE}
    if data_claimed or comm_claimed:
        checked["stall_wait_left_to"] = sorted(fired & {"input-bound", "communication-bound", "straggler"})
    if len(out_idx) < STALL_MIN_OUTLIERS or share < STALL_SHARE:
        return None, checked
    size = max(WINDOW_STEPS, 2 * period[0]) if period else WINDOW_STEPS
    wins = _windows(len(spans), size)
    outset = set(out_idx)
    held = sum(1 for w in wins
               if sum(walls[i] - median for i in w if i in outset) >= STALL_SHARE * sum(spans[i].full for i in w))
    checked["stall_windows_held"] = f"{held}/{len(wins)}"
    if held < len(wins) / 2:
        return None, checked
    if period is None and "oversubscribed" in fired:  # irregular slow steps on a saturated host: that rule's fix
        checked["stall_left_to"] = "oversubscribed"
        return None, checked

    # where the outliers' extra time went: each cause's mean on the outliers over its median on the other steps
    normal = [s for i, s in enumerate(spans) if i not in outset]
    slow = [spans[i] for i in out_idx]
    excess = {c: max(0.0, statistics.fmean(s.parts[c] for s in slow) - statistics.median(s.parts[c] for s in normal))
              for c in slow[0].parts}
    cause = max(excess, key=lambda c: excess[c])
    extra = sum(excess.values()) or 1.0
    inside = _inside_breakdown(view, out_idx) if cause == "inside the step" else {}
    every = f"every {period[0]} steps" if period else "at irregular steps"
    stall_s = statistics.fmean(walls[i] for i in out_idx) - median
    items = [s.items for s in view.steps]
    evidence: dict[str, Any] = {
        **checked, "steps_judged": len(spans), "wall_s": rounded(total, 4), "lost_s": rounded(lost, 4),
        "period_steps": period[0] if period else None, "period_phase": period[1] if period else None,
        "outlier_steps": [spans[i].step for i in out_idx][:20], "stall_s_mean": rounded(stall_s, 6),
        "cause": cause, "extra_by_cause": {c: rounded(v / extra, 3) for c, v in excess.items()},
        **({"inside_the_step": inside} if inside else {}),
    }
    speedup = total / max(total - lost, 1e-9)
    expected = (f"without the stalls the {len(spans)} steps take {total - lost:.2f} s instead of {total:.2f} s: "
                f"{speedup:.2f}× the steps a second")
    if all(n is not None for n in items) and total > 0:
        n = sum(items)  # type: ignore[arg-type]
        evidence.update(items_per_s_wall=rounded(n / total, 2), items_per_s_without_stalls=rounded(
            n / max(total - lost, 1e-9), 2))
        expected += f" ({n / total:,.0f} → {n / max(total - lost, 1e-9):,.0f} items/s)"
    verdict = Verdict(bottleneck="stalls", share=share, evidence=evidence, fix=_fix(cause, period, view),
                      expected=expected, source=_SOURCE,
                      summary=(f"stalls {every}: {ms(stall_s)} over a {ms(median)} step ({cause}), {pct(share)} of "
                               "wall time"))
    return verdict, checked


def _inside_breakdown(view: Window, out_idx: Sequence[int]) -> dict[str, Any]:
    """The timed phases of the slow steps against the others, where the loop timed them (gpuwise train does)."""
    out: dict[str, Any] = {}
    slow = set(out_idx)
    for name in ("compute_s", "optimizer_s"):
        a = [getattr(s, name) for i, s in enumerate(view.steps) if i in slow and getattr(s, name) is not None]
        b = [getattr(s, name) for i, s in enumerate(view.steps) if i not in slow and getattr(s, name) is not None]
        if a and b:
            out[name] = {"slow_steps": rounded(statistics.fmean(a), 6), "other_steps": rounded(statistics.median(b), 6)}
    return out


def _fix(cause: str, period: tuple[int, int] | None, view: Window) -> tuple[str, ...]:
    n = period[0] if period else None
    every = f"every {n} steps" if n else "now and then"
    loader = view.context.loader
    gc_fix = ("if it is Python's garbage collector: gc.freeze() once the model and data are built, then gc.disable() "
              "and gc.collect(1) yourself every 50 steps (torchtitan's gc_freq=50): a short collection at a step you "
              "choose (the same on every rank) instead of a full one wherever the allocation count says")
    if cause == "data wait":
        fix = []
        if loader is None or loader.persistent_workers is not True:
            fix.append(f"DataLoader(..., persistent_workers=True): the loader stalls {every}; if that is an epoch, "
                       "the workers are restarted at each epoch boundary and refill their queues from scratch")
        if loader is None or (loader.prefetch_factor or 2) < 4:
            fix.append("DataLoader(..., prefetch_factor=4): more batches in flight ride over the slow ones")
        fix.append("more num_workers (within the usable cores), or find the slow items (a large file, a remote or "
                   "cold-cache read) and cache or pre-process them")
        return tuple(fix)
    if cause == "between steps":
        return (f"the time goes between the steps, {every}: a checkpoint save or an evaluation; save "
                "asynchronously (torch.distributed.checkpoint.async_save) or less often, evaluate on fewer batches "
                "or less often (--checkpoint-every, --eval-every)", gc_fix)
    if cause == "synchronisation":
        return ("the exposed communication spikes on the slow steps: one rank arrives late at the all-reduce (a "
                "straggler: compare the ranks' step times, look for other load or uneven batches on its host) or "
                "the network is shared; check each rank's data wait and host load",)
    return (f"something runs inside the step {every}: a checkpoint save, an evaluation, or a log line that "
            "synchronises (loss.item(), printing a tensor); move it off the hot path (log values already on the "
            "host, torch.distributed.checkpoint.async_save for checkpoints)", gc_fix)


__all__ = ["PERIOD_SHARE", "STALL_MIN_EXCESS_S", "STALL_MIN_OUTLIERS", "STALL_RATIO", "STALL_SHARE", "stalls"]
