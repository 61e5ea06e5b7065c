"""From a monitor's record to the bottleneck, its evidence and the fix: a table of rules, judged in order.

>>> judge(Record()).bottleneck
'not-judged'

How it judges (``judge``):

1. The judged window (``monitor.window``): the warm-up steps and the samples before them are skipped; conditions
   are judged over windows with a patience, so one slow step never fires anything.
2. Each rule of ``RULES`` in turn, each a small ``(Window, earlier) -> (Verdict | None, checked) | None``; a rule
   sees what the rules before it said (host-bound says nothing when the data wait or communication explains the
   idle GPU; the roofline side only when no loss class fired). Loss classes (time a fix would win back, ``share``
   = fraction of step time): input-bound, communication-bound, straggler, oversubscribed, stalls, host-bound (a low
   GPU duty cycle, or a CPU run on one core with idle threads and free cores), throttled. Risks
   (``share`` None): memory-full, memory-leak, fragmentation. Roofline sides: memory-bound, compute-bound.
3. The primary bottleneck (``PRIMARY_RULE``): memory-full first when an OOM happened; then the loss class with the
   largest share; then the risks (memory-full, memory-leak, fragmentation); then the roofline side. Every class that
   fired is listed in ``findings``, the primary first. "healthy" only when nothing fired AND the loop's own step timings
   were judged (data wait, communication and the step itself need them); else "not-judged", with what was missing
   (``evidence["missing"]``) and how to supply it (``fix``): a device-only view that fired nothing cannot tell a
   healthy loop from one that waits on its data.

The thresholds and their sources are in ``monitor.thresholds``; ``render.diagnosis`` shows the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwise.monitor.comm_rules import communication_bound, straggler
from gpuwise.monitor.device_rules import fragmentation, memory_full, roofline, throttled
from gpuwise.monitor.host_rules import oversubscribed
from gpuwise.monitor.loop_rules import host_bound, input_bound, watch_host
from gpuwise.monitor.memory_rules import memory_leak
from gpuwise.monitor.samples import Record
from gpuwise.monitor.step_rules import stalls
from gpuwise.monitor.thresholds import MIN_JUDGED_STEPS
from gpuwise.monitor.verdict import LOSS, RISK, ROOFLINE, Context, Diagnosis, Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, median, rounded, window

Rule = Callable[[Window, Earlier], Judged | None]

# In the order they are judged (each sees the ones before it). The evidence of a healthy run lists what each checked.
RULES: dict[str, Rule] = {
    "input-bound": input_bound,  # with step timings
    "communication-bound": communication_bound,  # with step timings
    "straggler": straggler,  # with every rank's step timings
    "oversubscribed": oversubscribed,  # threads x processes against the cores, and the run's own run-queue wait
    "stalls": stalls,  # with step timings: outliers and periodic stalls (irregular ones left to oversubscribed)
    "watch-host": watch_host,  # without step timings: CPU and I/O from the host samples
    "host-bound": host_bound,
    "throttled": throttled,
    "memory-full": memory_full,
    "memory-leak": memory_leak,  # RSS or the allocator growing step after step
    "fragmentation": fragmentation,
    "roofline": roofline,  # only when no loss class fired
}

_TIE_ORDER = {name: i for i, name in enumerate(("memory-full", *LOSS, "memory-leak", "fragmentation", *ROOFLINE,
                                                "healthy", "not-judged"))}
_SUPPLY_STEPS = ("time the loop with gpuwise.Monitor (monitor.step() each iteration, or gpuwise train): data wait, "
                 "communication and the step time need the loop's own timings")


def _rank(f: Verdict, oom: bool) -> tuple[int, float, int]:
    if f.bottleneck == "memory-full" and oom:
        tier = 0
    elif f.bottleneck in LOSS:
        tier = 1
    elif f.bottleneck in RISK:
        tier = 2
    else:
        tier = 3
    return tier, -(f.share or 0.0), _TIE_ORDER[f.bottleneck]


def _observed_vs_planned(view: Window) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ctx = view.context
    step = median([s.seconds for s in view.steps])
    if ctx.planned_step_s and step:
        out["step_s"] = {"observed": rounded(step, 6), "planned": rounded(ctx.planned_step_s, 6),
                         "ratio": rounded(step / ctx.planned_step_s, 3)}
    if ctx.planned_peak_bytes:
        candidates: list[tuple[Callable[[], list[int]], str]] = [
            (lambda: [s.peak_memory_bytes for s in view.steps if s.peak_memory_bytes is not None],
             "step peak (max_memory_allocated)"),
            (lambda: [s.allocator.peak_allocated_bytes or s.allocator.allocated_bytes for s in view.samples
                      if s.allocator is not None], "allocator peak"),
            (lambda: [d.process_memory_bytes for d in view.devices if d.process_memory_bytes is not None],
             "process memory (NVML)"),
        ]
        for get, source in candidates:
            values = get()
            if values:
                peak = max(values)
                out["peak_bytes"] = {"observed": int(peak), "planned": int(ctx.planned_peak_bytes),
                                     "ratio": rounded(peak / ctx.planned_peak_bytes, 3), "from": source}
                break
    return out


def judge(record: Record, context: Context | None = None) -> Diagnosis:
    """The bottleneck of a recorded run, its evidence and the fix.

    >>> judge(Record()).bottleneck
    'not-judged'
    """
    ctx = context or Context(device=record.device_kind)
    if not record.samples and not record.steps and not record.ooms:
        return Diagnosis(bottleneck="not-judged", evidence={"recorded": "nothing",
                                                            "missing": ["step timings", "device and host samples"]},
                         fix=(_SUPPLY_STEPS,), note="nothing recorded", summary="nothing recorded")
    view = window(record, ctx)
    checked: dict[str, Any] = {"steps_judged": len(view.steps), "warmup_steps_skipped": view.warmup,
                               "samples_judged": len(view.samples), "samples_span": view.sample_warmup}
    notes: list[str] = []
    if record.steps and not view.timed:
        notes.append(f"only {len(view.steps)} step(s): too few to judge the step timings")
    earlier: dict[str, Judged] = {}
    for name, rule in RULES.items():
        judged = rule(view, earlier)
        if judged is not None:
            earlier[name] = judged
            checked.update(judged[1])
    findings = sorted((verdict for verdict, _ in earlier.values() if verdict is not None),
                      key=lambda f: _rank(f, bool(record.ooms)))
    if not view.devices:
        notes.append("no GPU counters: the diagnosis used the loop's own timings and the CPU side only"
                     if record.steps else "no GPU counters and no step timings: the host side only")
    elif not record.steps:
        notes.append("no step timings: judged from the device and host samples alone")
    if record.note:
        notes.insert(0, record.note)
    note = "; ".join(notes) or None
    ovp = _observed_vs_planned(view)
    if not findings:
        if record.steps and view.timed:
            return Diagnosis(bottleneck="healthy", evidence=checked, fix=(), expected=None, findings=(),
                             steps=len(view.steps), observed_vs_planned=ovp, note=note,
                             summary=f"nothing fired over {len(view.steps)} steps")
        # nothing fired, but the loop's time was not seen: say what is missing rather than "healthy"
        missing = (["step timings"] if not record.steps else
                   [f"{MIN_JUDGED_STEPS} steps after the warm-up (had {len(view.steps)})"])
        if not view.devices and ctx.device != "cpu":
            missing.append("GPU counters (NVML)")
        checked["missing"] = missing
        fix = (_SUPPLY_STEPS,) if not record.steps else (f"run at least {MIN_JUDGED_STEPS} steps past the warm-up",)
        seen = (f"nothing fired over {len(view.samples)} samples" if len(view.samples) >= MIN_JUDGED_STEPS
                else f"{len(view.samples)} samples")
        return Diagnosis(bottleneck="not-judged", evidence=checked, fix=fix, expected=None, findings=(),
                         steps=len(view.steps), observed_vs_planned=ovp, note=note,
                         summary=f"not judged: no {missing[0]} ({seen})" if not record.steps else
                         f"not judged: too few steps ({len(view.steps)} past the warm-up)")
    top = findings[0]
    evidence = {**top.evidence, "steps_judged": len(view.steps), "warmup_steps_skipped": view.warmup}
    return Diagnosis(bottleneck=top.bottleneck, evidence=evidence, fix=top.fix, expected=top.expected,
                     findings=tuple(findings), steps=len(view.steps), observed_vs_planned=ovp, note=note,
                     summary=top.summary)


__all__ = ["RULES", "Rule", "judge"]
