"""The rules of memory over time: process RSS and the allocator growing, and when it runs out.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).

``memory_leak`` fits a robust line (Theil-Sen: the median of the pairwise slopes) to each memory series of the judged
window, over time and, where the loop timed its steps, over the steps completed (each sample's time mapped onto the
step events), and fires when the growth is sustained and material:

- the line explains the data: least-squares R² >= ``LEAK_MIN_R2``;
- it grows in both halves of the span, each at >= ``LEAK_HALF_RATE_SHARE`` of the whole span's rate (a warm-up that
  plateaus grows in its first half only);
- the growth over the span is >= ``LEAK_MIN_BYTES`` AND >= ``LEAK_MIN_RISE_SHARE`` of the level it started from.

The series, in the order they are named: the process's RSS and its loader workers' RSS (host memory); torch's CUDA
caching allocator's allocated bytes (tensors kept alive), else the steps' peak allocation
(``max_memory_allocated``), else NVML's per-process device memory (a ``watch`` from outside). The allocator's
reserved bytes growing while allocated stays flat is the pool, not a leak: left to the fragmentation rule.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwise.monitor.samples import StepEvent
from gpuwise.monitor.verdict import Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, device_total, rounded
from gpuwise.units import GB, MB, MiB

# -- thresholds ----------------------------------------------------------------------------------------------------

# Absolute floor on the growth over the judged span. Allocation granularity moves memory by tens of MiB without a
# leak: glibc grows a malloc arena's heap up to 64 MiB at a time (HEAP_MAX_SIZE on 64-bit), the CUDA caching allocator
# rounds large blocks to 2 MiB and takes 20 MiB segments for mid-size requests; a healthy 512-1024-10 MLP loop here
# moved its RSS by 10.6 MB over 200 steps (all in its first 20). 256 MiB is four full arenas, a dozen segments: more
# than granularity can explain, and the "30 MB total" must not fire.
LEAK_MIN_BYTES = 256 * MiB
# Relative floor: the growth must also be >= 10 % of the level the series started from. The healthy loop above grew
# 2.6 % of its 405 MB; a process holding 60 GB of data in memory that drifts by 300 MB (0.5 %) is the allocator's
# bookkeeping, not a leak to chase.
LEAK_MIN_RISE_SHARE = 0.10
# The line must explain the data. A single jump (a cache filled once, an eval pass) fitted with a line has
# R² = 3p(1-p) for a jump at fraction p of the span: at most 0.75 (at p = 1/2), so 0.8 rejects one jump anywhere;
# a steady leak with +-50 MB of noise on 2 GB of growth has R² > 0.99, the measured 8 MB/step loop 0.99+.
LEAK_MIN_R2 = 0.80
# Sustained: each half of the span grows at >= a third of the whole span's rate. A warm-up that rises and plateaus
# grows in its first half only (second half ~0); an approach to a plateau with time constant a quarter of the span
# keeps 0.24 of the rate in its second half (rejected); one with a time constant of half the span keeps 0.54 and is
# still growing at a quarter of its average rate at the end: called (a risk, with the time to OOM at that rate).
LEAK_HALF_RATE_SHARE = 1 / 3
# Points a series needs: four a half, so each half's median slope rests on six pairs or more.
LEAK_MIN_POINTS = 8
# Theil-Sen is O(n²): a series is thinned evenly to this many points (19,900 pairs) before the fit; 7,200 samples
# (two hours at 1 Hz) fit in milliseconds.
LEAK_FIT_POINTS = 200

SOURCE = ("Theil-Sen slope over time and over steps; fires when R² >= 0.8, both halves grow at >= 1/3 of the "
          "rate, and the growth >= 256 MiB and >= 10% of the start (memory_rules: allocation granularity, a "
          "healthy loop's RSS drift, one jump's R² <= 0.75)")

# -- what grows, and what to do about it ----------------------------------------------------------------------------

_HOST_FIX = (
    "log loss.item(), not loss: a loss tensor kept in a list (losses.append(loss)) holds its whole autograd graph",
    "keep numbers or detached CPU copies of what you collect (x.detach().cpu(), or reduce it to a float), and do "
    "not keep outputs across steps",
    "find what grows: between two steps count the live tensors, "
    "sum(torch.is_tensor(o) for o in gc.get_objects()), and compare tracemalloc snapshots "
    "(snapshot2.compare_to(snapshot1, 'lineno')) for Python objects",
)
_WORKERS_FIX = (
    "the Dataset holds Python objects (lists, dicts, strings): each worker touches their reference counts and so "
    "copies the pages it reads (copy-on-access, pytorch/pytorch#13246): store them as numpy arrays or tensors "
    "(strings as one np.array of bytes with offsets, or pyarrow) instead of Python lists",
    "fewer workers, or persistent_workers=False so each epoch starts from fresh copies, bounds it meanwhile",
)
_CUDA_FIX = (
    "log loss.item(), not loss: a loss kept with its graph keeps the graph's activations on the GPU",
    "detach what you keep across steps (x.detach(), or compute it under torch.no_grad()) and move it off the GPU "
    "(.cpu()) or reduce it to numbers; do not keep outputs or predictions across steps",
    "find the allocation site: torch.cuda.memory._record_memory_history(max_entries=100000) before the loop, "
    "torch.cuda.memory._dump_snapshot('leak.pickle') a few hundred steps later, and open it at "
    "pytorch.org/memory_viz (Active Memory Timeline: the blocks that never free, with the stack that made them)",
)
_NVML_FIX = (
    *_CUDA_FIX,
    "time the loop with gpuwise.Monitor (its allocator samples tell tensors kept alive, allocated growing, from the "
    "caching allocator's pool, reserved growing: NVML sees only the process's total)",
)


@dataclass(frozen=True)
class _Series:
    key: str  # evidence key: "process_rss"
    what: str  # in words: "process RSS"
    memory: str  # what runs out: "host" or "GPU"
    t: tuple[float, ...]  # seconds since the monitor started
    y: tuple[float, ...]  # bytes
    x: tuple[float | None, ...]  # steps completed at t (None: outside the timed steps)
    headroom: float | None  # bytes left now for it to grow into
    fix: tuple[str, ...]
    cause: str  # what usually grows it


@dataclass(frozen=True)
class _Trend:
    slope_s: float  # bytes a second (Theil-Sen)
    slope_step: float | None  # bytes a step
    r2: float
    halves: tuple[float, float]  # each half's slope over the whole span's
    start: float  # the line at the first point
    end: float
    growth: float  # the line's rise over the span
    span_s: float
    steps: float | None  # steps the series spans
    points: int
    why_not: str | None  # None: it fires


# -- the fit -------------------------------------------------------------------------------------------------------


def _thin(xs: Sequence[float], ys: Sequence[float], n: int = LEAK_FIT_POINTS) -> tuple[list[float], list[float]]:
    if len(xs) <= n:
        return list(xs), list(ys)
    idx = sorted({round(i * (len(xs) - 1) / (n - 1)) for i in range(n)})
    return [xs[i] for i in idx], [ys[i] for i in idx]


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The median of the pairwise slopes, and the median intercept under it (robust to a third of outliers).

    >>> theil_sen([0, 1, 2, 3, 4], [0, 2, 4, 100, 8])
    (2.0, 0.0)
    """
    xs, ys = _thin(xs, ys)
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    if not slopes:
        return 0.0, statistics.median(ys) if ys else 0.0
    b = statistics.median(slopes)
    return b, statistics.median(y - b * x for x, y in zip(xs, ys, strict=True))


def r_squared(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least squares' R² (the squared correlation): the share of the variance a line explains; 0 for a flat series."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    if sxx <= 0 or syy <= 0:
        return 0.0
    return sxy * sxy / (sxx * syy)


def _step_axis(steps: Sequence[StepEvent]):
    """t -> steps completed since the window began (interpolated between step ends); None outside the steps."""
    if not steps:
        return lambda t: None
    knots_t = [steps[0].t - steps[0].seconds, *(s.t for s in steps)]
    knots_x = list(range(len(knots_t)))

    def at(t: float) -> float | None:
        if t < knots_t[0] or t > knots_t[-1]:
            return None
        i = bisect.bisect_left(knots_t, t)
        if knots_t[i] == t or i == 0:
            return float(knots_x[i])
        t0, t1 = knots_t[i - 1], knots_t[i]
        return knots_x[i - 1] + (t - t0) / (t1 - t0) if t1 > t0 else float(knots_x[i])

    return at


def _trend(s: _Series) -> _Trend:
    t, y = s.t, s.y
    n = len(t)
    slope, icpt = theil_sen(t, y)
    r2 = r_squared(t, y)
    h = n // 2
    half = [theil_sen(t[:h], y[:h])[0], theil_sen(t[h:], y[h:])[0]]
    ratios = (half[0] / slope, half[1] / slope) if slope > 0 else (0.0, 0.0)
    start, end = icpt + slope * t[0], icpt + slope * t[-1]
    growth = end - start
    span = t[-1] - t[0]
    pairs = [(x, v) for x, v in zip(s.x, y, strict=True) if x is not None]
    slope_step = steps = None
    if len(pairs) >= LEAK_MIN_POINTS and pairs[-1][0] > pairs[0][0]:
        slope_step = theil_sen([p[0] for p in pairs], [p[1] for p in pairs])[0]
        steps = pairs[-1][0] - pairs[0][0]
    floor = max(LEAK_MIN_BYTES, LEAK_MIN_RISE_SHARE * max(start, 0.0))
    why = None
    if slope <= 0:
        why = "no growth"
    elif growth < floor:
        why = (f"grew {_size(growth)}, under the floor {_size(floor)} (max of {_size(LEAK_MIN_BYTES)} and "
               f"{LEAK_MIN_RISE_SHARE:.0%} of the start)")
    elif r2 < LEAK_MIN_R2:
        why = f"a line explains R² {r2:.2f} of it (< {LEAK_MIN_R2}): jumps or noise, not a steady growth"
    elif min(ratios) < LEAK_HALF_RATE_SHARE:
        which = "first" if ratios[0] < ratios[1] else "second"
        why = (f"the {which} half grows at {min(ratios):.0%} of the span's rate (< {LEAK_HALF_RATE_SHARE:.0%}): "
               + ("it levels off (a warm-up that plateaus)" if which == "second" else "a late jump, not sustained"))
    return _Trend(slope_s=slope, slope_step=slope_step, r2=r2, halves=ratios, start=start, end=end, growth=growth,
                  span_s=span, steps=steps, points=n, why_not=why)


# -- the series ----------------------------------------------------------------------------------------------------


def _series(view: Window) -> tuple[list[_Series], dict[str, Any]]:
    """Every memory series the window has, in the order they are named, and notes on the ones it could not use."""
    step_at = _step_axis(view.steps)
    out: list[_Series] = []
    notes: dict[str, Any] = {}
    last_host = next((h for h in reversed(view.hosts) if h.memory_total_bytes and h.memory_used_bytes is not None),
                     None)
    host_room = None if last_host is None else last_host.memory_total_bytes - last_host.memory_used_bytes

    def add(key, what, memory, tys, headroom, fix, cause):
        if len(tys) >= LEAK_MIN_POINTS:
            out.append(_Series(key=key, what=what, memory=memory, t=tuple(p[0] for p in tys),
                               y=tuple(float(p[1]) for p in tys), x=tuple(step_at(p[0]) for p in tys),
                               headroom=headroom, fix=fix, cause=cause))
        elif tys:
            notes[key] = f"{len(tys)} readings (< {LEAK_MIN_POINTS})"

    hosts = [(s.t, s.host) for s in view.samples if s.host is not None]
    add("process_rss", "process RSS", "host",
        [(t, h.process_rss_bytes) for t, h in hosts if h.process_rss_bytes is not None], host_room, _HOST_FIX,
        "tensors or Python objects kept across steps in the main process")
    add("workers_rss", "the loader workers' RSS", "host",
        [(t, h.workers_rss_bytes) for t, h in hosts if h.workers_rss_bytes is not None], host_room, _WORKERS_FIX,
        "copy-on-access of the Dataset's Python objects in each worker")

    total = device_total(view)
    allocs = [(s.t, s.allocator, s.devices) for s in view.samples if s.allocator is not None]
    if allocs:
        _, last, devs = allocs[-1]
        mine = [d.process_memory_bytes for d in devs if d.process_memory_bytes]
        other = max(0, max(mine) - last.reserved_bytes) if mine else 0  # CUDA context, NCCL, cuBLAS workspaces
        room = None if not total else total - last.allocated_bytes - other
        add("cuda_allocated", "CUDA allocated memory", "GPU", [(t, a.allocated_bytes) for t, a, _ in allocs], room,
            _CUDA_FIX, "tensors kept alive across steps (a loss kept with its graph, outputs collected, caches)")
        add("cuda_reserved", "CUDA reserved memory", "GPU", [(t, a.reserved_bytes) for t, a, _ in allocs],
            None if not total else total - last.reserved_bytes - other, _CUDA_FIX, "the caching allocator's pool")
        return out, notes
    peaks = [(s.t, s.peak_memory_bytes) for s in view.steps if s.peak_memory_bytes is not None]
    if peaks:
        add("step_peak", "the step's peak CUDA allocation", "GPU", peaks,
            None if not total else total - peaks[-1][1], _CUDA_FIX,
            "tensors kept alive across steps (a loss kept with its graph, outputs collected, caches)")
        return out, notes
    by_gpu: dict[tuple[int, str], list[tuple[float, Any]]] = {}  # a MIG instance apart from its GPU
    for s in view.samples:
        for d in s.devices:
            if d.process_memory_bytes is not None:
                by_gpu.setdefault((d.index, d.mig or ""), []).append((s.t, d))
    for index, readings in sorted(by_gpu.items()):
        d = readings[-1][1]
        room = (d.memory_total_bytes - d.memory_used_bytes if d.memory_total_bytes and d.memory_used_bytes is not None
                else None)
        add(f"gpu{index}_process", f"the process's memory on GPU {index} (NVML)", "GPU",
            [(t, r.process_memory_bytes) for t, r in readings], room, _NVML_FIX,
            "tensors kept alive across steps, or the caching allocator's pool (NVML cannot tell them apart)")
    return out, notes


# -- words ---------------------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    """Decimal, as the issue and nvidia-smi speak of rates: '8.0 MB', '2.0 GB'."""
    return f"{n / GB:.1f} GB" if abs(n) >= GB else f"{n / MB:.1f} MB"


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _evidence(s: _Series, tr: _Trend, last_step: int | None) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "what": s.what, "series": s.key, "memory": s.memory,
        "rate_bytes_per_s": rounded(tr.slope_s, 1),
        "rate_bytes_per_step": rounded(tr.slope_step, 1),
        "start_bytes": int(tr.start), "end_bytes": int(tr.end), "growth_bytes": int(tr.growth),
        "span_s": rounded(tr.span_s, 3), "span_steps": rounded(tr.steps, 1), "points": tr.points,
        "r2": rounded(tr.r2, 4), "half_rate_shares": [rounded(h, 3) for h in tr.halves],
        "headroom_bytes": None if s.headroom is None else int(s.headroom),
        "time_to_oom_s": None, "oom_at_step": None,
    }
    if s.headroom is not None:
        room = max(0.0, s.headroom)
        ev["time_to_oom_s"] = rounded(room / tr.slope_s, 1)
        if tr.slope_step and tr.slope_step > 0 and last_step is not None:
            ev["oom_at_step"] = last_step + math.ceil(room / tr.slope_step)
    return ev


def _checked(tr: _Trend) -> dict[str, Any]:
    return {"growth_bytes": int(tr.growth), "rate_bytes_per_s": rounded(tr.slope_s, 1), "r2": rounded(tr.r2, 3),
            "half_rate_shares": [rounded(h, 3) for h in tr.halves], "points": tr.points,
            "fires": tr.why_not is None, **({"why_not": tr.why_not} if tr.why_not else {})}


# -- the rule ------------------------------------------------------------------------------------------------------


def memory_leak(view: Window, earlier: Earlier) -> Judged | None:
    """Process RSS, the loader workers' RSS or the CUDA allocator's allocated bytes growing steadily over the judged
    window (module docstring); the rate a step and a second, and the time to run out at that rate."""
    series, notes = _series(view)
    if not series:
        why = "; ".join(f"{k}: {v}" for k, v in notes.items()) or "no memory sampled over time (RSS, allocator)"
        return None, {"memory_leak": f"not judged: {why}"}
    trends = {s.key: (s, _trend(s)) for s in series}
    checked: dict[str, Any] = {"memory_trends": {k: _checked(tr) for k, (_, tr) in trends.items()},
                               "leak_min_bytes": LEAK_MIN_BYTES, "leak_min_r2": LEAK_MIN_R2}
    if notes:
        checked["memory_trends_skipped"] = notes
    # reserved is never a leak of its own: growing with allocated, allocated says it; growing alone, it is the
    # caching allocator's pool, which the fragmentation rule judges
    reserved = trends.pop("cuda_reserved", None)
    allocated = trends.get("cuda_allocated")
    if reserved is not None and reserved[1].why_not is None and allocated is not None:
        checked["memory_trends"]["cuda_reserved"].update(fires=False, why_not=(
            "grows with allocated: named by allocated" if allocated[1].why_not is None else
            "reserved grows while allocated does not: the caching allocator's pool (the fragmentation rule judges it)"))
    growing = [(s, tr) for s, tr in trends.values() if tr.why_not is None]
    if not growing:
        return None, checked
    last_step = view.steps[-1].step if view.steps else None
    found = [_evidence(s, tr, last_step) for s, tr in growing]
    # the one that runs out first leads; without a headroom, the fastest relative to its own level
    order = sorted(range(len(found)), key=lambda i: (found[i]["time_to_oom_s"] is None,
                                                     found[i]["time_to_oom_s"] or 0.0,
                                                     -growing[i][1].growth / max(growing[i][1].start, 1.0)))
    found = [found[i] for i in order]
    growing = [growing[i] for i in order]
    s, tr = growing[0]
    top = found[0]
    rate = f"{_size(tr.slope_step)} a step" if tr.slope_step and tr.slope_step > 0 else f"{_size(tr.slope_s)} a second"
    over = (f"{_size(tr.growth)} over {tr.steps:.0f} steps" if tr.steps is not None else
            f"{_size(tr.growth)} over {_duration(tr.span_s)}")
    oom = top["time_to_oom_s"]
    if oom is None:
        when = f"{s.memory} memory total not known"
    elif oom <= 0:
        when = f"out of {s.memory} memory now"
    else:
        when = f"out of {s.memory} memory in ~{_duration(oom)}"
        if top["oom_at_step"] is not None:
            when += f" (step ~{top['oom_at_step']})"
    summary = f"{s.what} grows {rate} ({over}): {when}"
    fix: list[str] = []
    for g, _ in growing:
        fix += [f for f in g.fix if f not in fix]
    expected = (f"{s.what} grows {rate} ({_size(tr.slope_s)}/s, {_size(tr.start)} → {_size(tr.end)}, R² "
                f"{tr.r2:.2f}): {s.cause}; " + (f"at this rate the run is {when}" if oom is not None else when) +
                f"; fixed, it stays near {_size(tr.start)} for the whole run")
    if len(growing) > 1:
        expected += "; also growing: " + ", ".join(f"{g.what} {_size(t.slope_s)}/s" for g, t in growing[1:])
    evidence = {**checked, **top, "growing": found}
    kind = _what_tensors(view) if s.key == "cuda_allocated" else None
    if kind is not None:
        evidence["tensors_growing"] = kind
        expected += f"; the allocator says {kind['reading']}"
    return Verdict(bottleneck="memory-leak", share=None, evidence=evidence, fix=tuple(fix), expected=expected,
                   source=SOURCE, summary=summary), checked


def _what_tensors(view: Window) -> dict[str, Any] | None:
    """What kind of tensors the allocator's growth is, where it can tell: how many live allocations each step adds
    and their mean size, and whether they sit in the small pool (blocks under 1 MB: scalars such as a loss kept
    without .item(), small outputs) or the large one (activations, outputs, caches)."""
    allocs = [(s.t, s.allocator) for s in view.samples if s.allocator is not None]
    counts = [(t, a.allocations) for t, a in allocs if a.allocations is not None]
    if len(counts) < LEAK_MIN_POINTS:
        return None
    first, last = allocs[0][1], allocs[-1][1]
    grown = last.allocated_bytes - first.allocated_bytes
    added = counts[-1][1] - counts[0][1]
    if grown <= 0 or added <= 0:
        return None
    small = (None if last.small_pool_allocated_bytes is None or first.small_pool_allocated_bytes is None
             else last.small_pool_allocated_bytes - first.small_pool_allocated_bytes)
    span = counts[-1][0] - counts[0][0]
    steps = [s for s in view.steps if counts[0][0] < s.t <= counts[-1][0]]
    per_step = added / len(steps) if steps else None
    pool = "small" if small is not None and small >= grown / 2 else "large"
    reading = (f"{added} more live tensors" + (f" ({per_step:.1f} a step)" if per_step else
                                              f" over {_duration(span)}")
               + f" of {_size(grown / added)} each on average, in the {pool} pool: "
               + ("scalars or small tensors kept (a loss logged without .item(), per-step metrics)" if pool == "small"
                  else "large tensors kept (outputs or activations collected, a growing cache)"))
    return {"allocations_added": added, "allocations_per_step": rounded(per_step, 2),
            "bytes_per_allocation": rounded(grown / added, 0), "small_pool_growth_bytes": small, "pool": pool,
            "reading": reading}


__all__ = ["LEAK_HALF_RATE_SHARE", "LEAK_MIN_BYTES", "LEAK_MIN_POINTS", "LEAK_MIN_R2", "LEAK_MIN_RISE_SHARE",
           "memory_leak", "r_squared", "theil_sen"]
