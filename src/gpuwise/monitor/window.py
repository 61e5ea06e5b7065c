"""The judged window of a run and the small tools every rule shares: the warm-up cut, windows with a patience.

How the window is cut (``window``): the first ``max(WARMUP_MIN_STEPS, 10 %)`` step events are skipped (never
leaving fewer than ``MIN_JUDGED_STEPS``), and the samples taken before the last skipped step ended. Without step
events, the samples from the first to the last one where a GPU was busy (else all but the first 10 %).

Windows with a patience, as SageMaker Debugger's rules do (``persistent``): the judged steps (samples) are cut into
windows of ``WINDOW_STEPS`` (``WINDOW_SAMPLES``); a condition holds in a window when its median is past the
threshold AND at least ``PATIENCE`` of the window's steps are; a class fires when the condition holds in at least
half the windows. One slow step never fires anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuwise.monitor.samples import DeviceSample, HostSample, OomEvent, Record, Sample, StepEvent
from gpuwise.monitor.thresholds import BUSY_UTIL_PCT, MIN_JUDGED_STEPS, PATIENCE, WARMUP_FRACTION, WARMUP_MIN_STEPS
from gpuwise.monitor.verdict import Context, Verdict

# What a rule says: its verdict (None: it did not fire) and what it checked (the evidence of a "healthy" diagnosis).
Judged = tuple[Verdict | None, dict[str, Any]]
Earlier = Mapping[str, Judged]  # the rules judged before this one, by their name in ``monitor.rules.RULES``


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _windows(values: Sequence[float], size: int) -> list[Sequence[float]]:
    """Consecutive windows of ``size``; a last window shorter than half a window joins the one before."""
    if len(values) <= size:
        return [values] if values else []
    out = [values[i:i + size] for i in range(0, len(values), size)]
    if len(out) > 1 and len(out[-1]) < size / 2:
        out[-2] = [*out[-2], *out[-1]]
        out.pop()
    return out


@dataclass(frozen=True)
class Persist:
    fires: bool
    median: float | None
    fraction: float  # of all values past the threshold
    windows: int
    windows_held: int


def persistent(values: Sequence[float], threshold: float, size: int, *, below: bool = False) -> Persist:
    """Does ``value >= threshold`` (``<`` with ``below``) hold in at least half the windows, each by its median and
    in at least PATIENCE of its values?"""
    if not values:
        return Persist(False, None, 0.0, 0, 0)

    def past(v: float) -> bool:
        return v < threshold if below else v >= threshold

    wins = _windows(values, size)
    held = sum(1 for w in wins if past(statistics.median(w)) and sum(map(past, w)) >= PATIENCE * len(w))
    fraction = sum(map(past, values)) / len(values)
    return Persist(held >= len(wins) / 2, statistics.median(values), fraction, len(wins), held)


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


# -- the judged window ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """What every rule judges: the steps after the warm-up, the samples in the same span, the run's OOMs, and what
    the diagnosis knows beyond the record (``context``)."""

    steps: tuple[StepEvent, ...]
    warmup: int
    samples: tuple[Sample, ...]
    devices: tuple[DeviceSample, ...]  # every (sample, device) reading in the span
    hosts: tuple[HostSample, ...]
    sample_warmup: str
    ooms: tuple[OomEvent, ...]
    context: Context
    # every rank's judged steps, where the events carry ranks (torchrun); ``steps`` are the lowest rank's
    ranks: Mapping[int, tuple[StepEvent, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def seconds(self) -> float:
        """Wall time the judged steps span: from the end of the last warm-up step to the end of the last one."""
        if not self.steps:
            return 0.0
        return self.steps[-1].t - (self.steps[0].t - self.steps[0].seconds)

    @property
    def timed(self) -> bool:
        """Enough step events to judge the loop's own timings (data wait, exposed communication)."""
        return len(self.steps) >= MIN_JUDGED_STEPS


def device_total(view: Window) -> float | None:
    """The memory the loop can fill: the plan's device, else the sampled total; under MIG the instance's (the one
    holding the process's memory), never the whole GPU's."""
    if view.context.memory_total_bytes:
        return view.context.memory_total_bytes
    mig = [d for d in view.devices if d.mig is not None]
    sized = [d for d in mig if d.process_memory_bytes] or mig or list(view.devices)
    return median([d.memory_total_bytes for d in sized if d.memory_total_bytes])


def warmup_steps(n: int) -> int:
    skip = max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * n))
    return max(0, min(skip, n - MIN_JUDGED_STEPS))


def _rank_steps(record: Record) -> dict[int | None, tuple[StepEvent, ...]]:
    out: dict[int | None, list[StepEvent]] = {}
    for s in sorted(record.steps, key=lambda s: s.t):
        if s.seconds > 0:
            out.setdefault(s.rank, []).append(s)
    return {k: tuple(v) for k, v in out.items()}


def window(record: Record, context: Context) -> Window:
    by_rank = _rank_steps(record)
    ranked = {k: v for k, v in by_rank.items() if k is not None}
    steps = by_rank.get(None) or (ranked[min(ranked)] if ranked else ())  # one process, else the lowest rank
    ranks = {k: v[warmup_steps(len(v)):] for k, v in sorted(ranked.items())} if len(ranked) > 1 else {}
    warm = warmup_steps(len(steps))
    judged = steps[warm:]
    samples = tuple(sorted(record.samples, key=lambda s: s.t))
    if judged:
        t0 = steps[warm - 1].t if warm else judged[0].t - judged[0].seconds
        t1 = judged[-1].t + record.interval_s
        chosen = tuple(s for s in samples if t0 < s.t <= t1)
        how = f"samples from {t0:.1f} s to {t1:.1f} s (the judged steps)"
        if not chosen and samples:
            chosen, how = samples, "all samples (none fell within the judged steps)"
    else:
        busy = [i for i, s in enumerate(samples) if any((d.util_pct or 0) >= BUSY_UTIL_PCT for d in s.devices)]
        if busy:
            chosen = samples[busy[0]:busy[-1] + 1]
            how = "samples from the first to the last with a busy GPU"
        else:
            skip = math.ceil(WARMUP_FRACTION * len(samples)) if len(samples) >= 3 else 0
            chosen, how = samples[skip:], f"all samples but the first {skip}"
    return Window(steps=judged, warmup=warm, samples=chosen,
                  devices=tuple(d for s in chosen for d in s.devices),
                  hosts=tuple(s.host for s in chosen if s.host is not None), sample_warmup=how,
                  ooms=tuple(record.ooms), context=context, ranks=MappingProxyType(ranks))

