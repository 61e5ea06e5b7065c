"""The rules of communication between ranks: exposed all-reduce time, and the rank the others wait for.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).

What gradient accumulation changes (``communication_bound``): a step of ``m`` micro-batches costs
``S = m·M + E + O``, with ``M`` a micro-batch's own work (its data, forward and backward), ``E`` the exposed
all-reduce and ``O`` the optimizer step, both paid once per optimizer step. With ``k`` micro-batches a sample costs
``(M + (E + O)/k)`` per micro-batch instead of ``S/m``: accumulation amortises the optimizer step as much as the
all-reduce. The loop's ``micro_batches`` (or ``Context.grad_accum``) says what is applied already; a larger ``k``
is proposed only while it still pays.

Who waits for whom (``straggler``): DDP's ranks leave each all-reduce together, so their step times are equal; what
differs is how the step is spent. A rank's own work is its step less its exposed communication (its data wait
included: the others wait for its loading as for its compute). The last rank to reach the all-reduce waits only
for the transfer; every other rank also waits for it. So the rank with the largest own work is the straggler, the
others lose ``(its own work - theirs)`` of each step, and the communication proper is the least-waiting rank's
exposed time (what ``communication_bound`` judges when every rank's steps are there).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from gpuwise.monitor.samples import StepEvent
from gpuwise.monitor.thresholds import COMM_EXPOSED_SHARE, MIN_JUDGED_STEPS, WINDOW_STEPS
from gpuwise.monitor.verdict import Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, median, ms, pct, persistent, rounded

# The most micro-batches per optimizer step proposed at once: the rule's cap before this change (8). Each growth of
# the global batch needs the learning rate rescaled (Goyal et al. 2017, linear scaling with warm-up), so the rule
# proposes a step a user can validate rather than the asymptote; past 8 the amortised (E + O)/k is under 1/8 of what
# it was, little left to win.
ACCUM_MAX_K = 8
# Accumulation is proposed only when it wins at least what the rule fires at: exposed communication is called a loss
# from COMM_EXPOSED_SHARE of the step (TB plugin's 10 %), i.e. a fix worth 1/(1 - 0.10) = 1.11x per sample. A
# smaller gain is within the step-to-step noise of the §B6 CPU runs and not worth a larger batch.
ACCUM_MIN_GAIN = 1 / (1 - COMM_EXPOSED_SHARE)
# Straggler: the others lose at least this share of each step waiting for one rank. No published share for one
# machine; the wait shows up as the others' communication time, so the TB plugin's "communication > 10 % of the step"
# applies to it as it does to exposed communication. NVIDIA's resiliency extension (nvidia-resiliency-ext straggler
# detection, Megatron-Bridge NVRxStragglerDetectionConfig.gpu_relative_perf_threshold = 0.7) flags a rank 1.43x
# slower than the best: a fleet-scale hardware detector; with 2-8 ranks every slow rank stalls all of them, so we
# fire on the loss it causes, earlier.
STRAGGLER_LOSS_SHARE = 0.10


def _steps_by_number(view: Window) -> dict[int, dict[int, StepEvent]]:
    """step number -> rank -> step, for the step numbers every rank judged (empty without several ranks)."""
    if len(view.ranks) < 2:
        return {}
    by_rank = {r: {s.step: s for s in steps} for r, steps in view.ranks.items()}
    common = set.intersection(*(set(d) for d in by_rank.values()))
    return {n: {r: by_rank[r][n] for r in by_rank} for n in sorted(common)}


def _exposed(view: Window) -> tuple[list[tuple[StepEvent, float]], str]:
    """(step, exposed communication) for each judged step that timed it, and where the figure comes from: with every
    rank's steps, the least-waiting rank's (the others' extra wait is a straggler's, not the link's)."""
    aligned = _steps_by_number(view)
    out: list[tuple[StepEvent, float]] = []
    if aligned:
        lowest = min(view.ranks)  # ``view.steps`` are its steps
        for ranks in aligned.values():
            times = [s.exposed_comm_s for s in ranks.values()]
            if all(t is not None for t in times):
                out.append((ranks[lowest], min(times)))  # type: ignore[type-var]
        if len(out) >= MIN_JUDGED_STEPS:
            return out, f"the least-waiting of {len(view.ranks)} ranks, step by step"
    return [(s, s.exposed_comm_s) for s in view.steps if s.exposed_comm_s is not None], "this process"


def accumulation_effect(step: float, exposed: float, optimizer: float, micro_batches: int, k: int) -> float:
    """Per-sample speed-up of ``k`` micro-batches per optimizer step over ``micro_batches`` now, for a step of
    ``step`` seconds holding ``exposed`` communication and ``optimizer`` seconds paid once per step.

    >>> round(accumulation_effect(1.0, 0.3, 0.0, 1, 4), 3)  # 1 / (0.7 + 0.3 / 4)
    1.29
    """
    own = max(0.0, (step - exposed - optimizer) / micro_batches)
    return (step / micro_batches) / (own + (exposed + optimizer) / k)


def accumulation_k(step: float, exposed: float, optimizer: float, micro_batches: int) -> int:
    """The fewest micro-batches per optimizer step, more than now, at which the exposed communication falls under
    ``COMM_EXPOSED_SHARE`` of the step (``E / (k·M + E + O) < share``), at most ``ACCUM_MAX_K`` unless the loop runs
    that many already (then one more: the caller says it does not pay).

    >>> accumulation_k(1.0, 0.3, 0.2, 1)  # M = 0.5: k = 5 gives exactly 10 %, not under it
    6
    """
    own = max(0.0, (step - exposed - optimizer) / micro_batches)
    if own <= 0:
        return max(micro_batches + 1, ACCUM_MAX_K)
    need = math.floor((exposed / COMM_EXPOSED_SHARE - exposed - optimizer) / own + 1e-9) + 1  # 1e-9: 0.3/0.1 < 3
    return max(micro_batches + 1, min(ACCUM_MAX_K, need))


def communication_bound(view: Window, earlier: Earlier) -> Judged | None:
    """Exposed communication (what backward did not hide) past ``COMM_EXPOSED_SHARE`` of the step. Needs step
    timings."""
    if not view.timed:
        return None
    ctx = view.context
    pairs, source = _exposed(view)
    if len(pairs) < MIN_JUDGED_STEPS:
        return None, {"exposed_comm": "not timed (a DDP loop: mon.ddp(model) before the first backward)"}
    shares = [e / s.seconds for s, e in pairs]
    p = persistent(shares, COMM_EXPOSED_SHARE, WINDOW_STEPS)
    checked = {"exposed_comm_share_median": rounded(p.median), "exposed_comm_threshold": COMM_EXPOSED_SHARE}
    if not p.fires:
        return None, checked
    steps = [s for s, _ in pairs]
    step = statistics.median(s.seconds for s in steps)
    exposed = statistics.median(e for _, e in pairs)
    comm = median([s.comm_s for s in steps if s.comm_s is not None])
    opt_times = [s.optimizer_s for s in steps if s.optimizer_s is not None]
    optimizer = statistics.median(opt_times) if opt_times else None
    opt = min(optimizer or 0.0, max(0.0, step - exposed))
    mb = median([s.micro_batches for s in steps if s.micro_batches])
    m = max(1, round(mb) if mb else 1, ctx.grad_accum or 1)
    k = accumulation_k(step, exposed, opt, m)
    gain = accumulation_effect(step, exposed, opt, m, k)
    pays = k <= ACCUM_MAX_K and gain >= ACCUM_MIN_GAIN
    evidence: dict[str, Any] = {
        **checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
        "exposed_comm_s_median": rounded(exposed, 6), "exposed_comm_from": source, "comm_s_median": rounded(comm, 6),
        "step_s_median": rounded(step, 6), "optimizer_s_median": rounded(optimizer, 6),
        "micro_batches_now": m, "world_size": ctx.world_size,
        "accumulation_suggested": k if pays else None, "accumulation_speedup": rounded(gain, 3)}
    if optimizer is None:
        evidence["optimizer_s"] = "not timed (mon.step(optimizer_s=...)): its share of the step is left out"
    hidden = (f"at most {pct(p.median)} off each step if all communication were hidden ({ms(step)} → "
              f"{ms(step - exposed)})")
    now = f" (now {m})" if m > 1 else ""
    other = ("DDP(model, bucket_cap_mb=...): the default is 25; try 50 or 100 (fewer, larger all-reduces) and "
             "gradient_as_bucket_view=True; a smaller value if only the last bucket is exposed",
             "a faster link: NVLink / InfiniBand instead of PCIe / Ethernet; NCCL_DEBUG=INFO shows the transport NCCL "
             "picked (a P2P or IB path disabled by NCCL_P2P_DISABLE / NCCL_IB_DISABLE falls back to sockets)",
             "a larger micro-batch where memory allows: the same all-reduce then serves more samples")
    if pays:
        what = "exposed comm and optimizer step" if optimizer is not None else "exposed comm"
        fix: tuple[str, ...] = (
            f"gradient accumulation: {k} micro-batches per optimizer step{now}, the first {k - 1} under "
            f"model.no_sync(), so one all-reduce and one optimizer step serve {k} batches ({what} per sample "
            f"÷{k / m:.3g}; scale the LR for the larger batch)", *other)
        per_mb = step / m / gain
        expected = (f"{hidden}; with {k}-step accumulation{now} ≈ {ms(per_mb)} per micro-batch instead of "
                    f"{ms(step / m)} ({gain:.2f}×): the {ms(exposed)} all-reduce"
                    + (f" and the {ms(opt)} optimizer step" if optimizer is not None else "")
                    + f" paid once per {k} micro-batches")
        if optimizer is None:
            expected += " (at least: the optimizer step, not timed, is amortised too)"
    else:
        fix = other
        expected = (f"{hidden}; more accumulation does not pay: {k} micro-batches per optimizer step{now} would "
                    f"give {gain:.2f}×, under {ACCUM_MIN_GAIN:.2f}×" if k <= ACCUM_MAX_K else
                    f"{hidden}; accumulation is at {m} micro-batches already (the most this rule proposes is "
                    f"{ACCUM_MAX_K})")
    return Verdict(bottleneck="communication-bound", share=p.median, evidence=evidence, fix=fix, expected=expected,
                   source="TB plugin communication > 10% of step (exposed part only); SageMaker window/patience",
                   summary=f"exposed communication {pct(p.median)} of each step"), checked


def _own(s: StepEvent) -> float:
    """A rank's own work in a step: the step less its exposed communication (its data wait included)."""
    return max(0.0, s.seconds - (s.exposed_comm_s or 0.0))


def _med(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def straggler(view: Window, earlier: Earlier) -> Judged | None:
    """One rank's own work (its step less the wait in communication) well above the others', step after step: the
    others lose the difference waiting for it. Needs every rank's step events with their exposed communication."""
    if len(view.ranks) < 2:
        return None
    aligned = _steps_by_number(view)
    timed = {n: rs for n, rs in aligned.items() if all(s.exposed_comm_s is not None for s in rs.values())}
    if len(timed) < MIN_JUDGED_STEPS:
        why = ("exposed communication not timed on every rank (mon.ddp(model) in each)" if aligned else
               "the ranks' step numbers do not match")
        return None, {"straggler": why, "ranks": len(view.ranks)}
    ranks = sorted(view.ranks)
    own = {r: _med([_own(rs[r]) for rs in timed.values()]) for r in ranks}
    slow = max(ranks, key=lambda r: (own[r], -r))
    others = [r for r in ranks if r != slow]
    # per step: what the others lose waiting for the slow rank, as a share of the step
    losses = [max(0.0, _own(rs[slow]) - _med([_own(rs[r]) for r in others])) / max(rs[slow].seconds, 1e-12)
              for rs in timed.values()]
    p = persistent(losses, STRAGGLER_LOSS_SHARE, WINDOW_STEPS)
    checked: dict[str, Any] = {"ranks": len(ranks), "straggler_loss_share_median": rounded(p.median),
                               "straggler_threshold": STRAGGLER_LOSS_SHARE}
    if not p.fires:
        return None, checked
    step = _med([rs[slow].seconds for rs in timed.values()])
    own_others = _med([own[r] for r in others])
    wait = {r: _med([rs[r].exposed_comm_s for rs in timed.values()]) for r in ranks}  # type: ignore[misc]
    data = {r: _med([rs[r].data_wait_s for rs in timed.values()]) for r in ranks}
    excess = own[slow] - own_others
    excess_data = max(0.0, data[slow] - _med([data[r] for r in others]))
    in_data = excess_data >= excess / 2
    evidence = {**checked, "steps_judged": len(timed), "windows_held": f"{p.windows_held}/{p.windows}",
                "straggler_rank": slow, "own_work_s": {r: rounded(own[r], 6) for r in ranks},
                "exposed_comm_s": {r: rounded(wait[r], 6) for r in ranks},
                "data_wait_s": {r: rounded(data[r], 6) for r in ranks},
                "own_work_others_median_s": rounded(own_others, 6), "excess_s": rounded(excess, 6),
                "excess_in_data_wait_s": rounded(excess_data, 6), "step_s_median": rounded(step, 6)}
    loader = (f"rank {slow}'s data: it waits {ms(data[slow])} a step for its batch, the others "
              f"{ms(_med([data[r] for r in others]))}: check its shard (uneven sample sizes or lengths; "
              "DistributedSampler balances counts, not cost), its DataLoader's num_workers, and where its files are "
              "read from")
    device = (f"rank {slow}'s device: a slower or throttled GPU (gpuwise watch on that rank, or nvidia-smi -q -d "
              "PERFORMANCE,CLOCK: clock-event reasons), or a CPU rank on fewer free cores")
    host = (f"rank {slow}'s host side: pin each rank to its own cores and NUMA node (numactl --cpunodebind / "
            "taskset; OMP_NUM_THREADS = cores per rank) and look for other processes on its cores (top -H, "
            "ps -eo pid,psr,pcpu,comm)")
    fix = (loader, device, host) if in_data else (device, host, loader)
    others_text = f"rank {others[0]}" if len(others) == 1 else f"the other {len(others)} ranks (median)"
    they = f"rank {others[0]} waits" if len(others) == 1 else f"the other {len(others)} ranks wait"
    expected = (f"rank {slow} works {ms(own[slow])} a step, {others_text} {ms(own_others)}: {they} "
                f"{pct(p.median)} of each step for it; brought to the others' pace the step goes {ms(step)} → "
                f"{ms(step - excess)} ({step / max(step - excess, 1e-12):.2f}×)")
    return Verdict(bottleneck="straggler", share=p.median, evidence=evidence, fix=fix, expected=expected,
                   source="TB plugin communication > 10% of step (the wait for one rank shows as the others' "
                          "communication); NVRx straggler detection names the rank; SageMaker window/patience",
                   summary=f"rank {slow} is the straggler: the others wait {pct(p.median)} of each step for it"), \
        checked


__all__ = ["ACCUM_MAX_K", "ACCUM_MIN_GAIN", "STRAGGLER_LOSS_SHARE", "accumulation_effect", "accumulation_k",
           "communication_bound", "straggler"]
