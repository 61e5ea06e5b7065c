"""What a watched loop comes to, in one object: ``Monitor.report()`` returns it and ``gpuwise watch --json`` prints it.

>>> from gpuwise.monitor.report import build_report                   # doctest: +SKIP
>>> r = build_report(record, diagnosis)                                # doctest: +SKIP
>>> r.judged, r.steps.p95_s, r.throughput.items_per_s, r.memory.process_rss_peak_bytes  # doctest: +SKIP
(True, 0.31, 261.4, 2147483648)

The diagnosis (judged or not, and what was missing), the step time's median, p95 and max, throughput over wall
clock (the items the steps consumed over the span from the first step's start to the last step's end: a run with
stalls is counted at the rate it really went, never as 1 / the median step), memory (the process's resident set,
torch's allocator, the GPUs), each rank's steps where the events carry ranks (torchrun), and the per-GPU and host
summaries. ``Report.to_dict()`` is the JSON form; the Prometheus exporter (``monitor.export``) reads the same object.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwise.monitor.samples import Record, StepEvent
from gpuwise.monitor.verdict import Diagnosis, Verdict
from gpuwise.monitor.window import rounded

P95 = 0.95  # the tail quantile reported beside the median: the step most loops' stalls reach (one step in 20)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile by linear interpolation between the closest ranks (numpy's default, "linear")."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """The loop's step events (the lowest rank's where there are several): count and the step time's spread."""

    count: int = 0
    median_s: float | None = None
    p95_s: float | None = None
    max_s: float | None = None
    data_wait_share_median: float | None = None  # data wait over the step, median over the steps
    ooms: int = 0


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Over wall clock: from the first step's start to the last step's end (the span every rank's steps cover)."""

    wall_s: float | None = None
    steps: int = 0  # optimizer steps in the span (the lowest rank's: every rank takes the same steps)
    steps_per_s: float | None = None
    items: int | None = None  # samples (or tokens) every rank's steps consumed (StepEvent.items)
    items_per_s: float | None = None  # what the run really did: None when no step said its items


@dataclass(frozen=True, kw_only=True)
class MemoryStats:
    """Memory now (the last sample that read it) and its peak over the record."""

    process_rss_bytes: int | None = None  # the main process's resident set (host.HostSample.process_rss_bytes), at
    # the last sample that read one (a command that ended: as it was last seen running)
    process_rss_peak_bytes: int | None = None
    workers_rss_bytes: int | None = None  # its loader workers' together (an upper bound: shared pages count in each)
    allocator_allocated_bytes: int | None = None  # torch's caching allocator, where sampled (a Monitor on CUDA)
    allocator_allocated_peak_bytes: int | None = None
    allocator_reserved_bytes: int | None = None
    allocator_reserved_peak_bytes: int | None = None
    device_process_bytes: int | None = None  # the command's memory on its GPUs together (NVML), where NVML said
    device_process_peak_bytes: int | None = None
    device_used_bytes: int | None = None  # the GPUs' memory in use together, whoever holds it
    device_used_peak_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """One torch.distributed rank's steps. ``own_work_median_s``: the step less the communication it waited for
    (exposed), the rank's own time: the straggler has the most, the others wait for it in the collective."""

    rank: int
    steps: int
    step_median_s: float | None
    exposed_comm_median_s: float | None  # None: the rank's communication was not timed
    own_work_median_s: float | None
    data_wait_median_s: float | None


@dataclass(frozen=True, kw_only=True)
class Report:
    """What ``Monitor.report()`` returns and ``gpuwise watch --json`` prints under ``"report"``."""

    bottleneck: str
    summary: str
    judged: bool  # False: "not-judged", the loop's time could not be seen; ``missing`` says what was lacking
    missing: tuple[str, ...]
    diagnosis: dict[str, Any]  # render.diagnosis.diagnosis_json: bottleneck, summary, fix, expected, findings, ...
    steps: StepStats
    throughput: Throughput
    memory: MemoryStats
    ranks: tuple[RankStats, ...] = ()  # empty unless the events carry ranks
    devices: tuple[dict[str, Any], ...] = ()  # watch.device_summary: per GPU over the record
    devices_now: tuple[dict[str, Any], ...] = ()  # per GPU, the last sample's reading (the exporter's gauges)
    host: dict[str, Any] = field(default_factory=dict)  # watch.host_summary

    @property
    def fix(self) -> tuple[str, ...]:
        return tuple(self.diagnosis.get("fix") or ())

    def to_dict(self) -> dict[str, Any]:
        """A plain dict json.dumps takes (no NaN, no tuples)."""

        return jsonable({
            "bottleneck": self.bottleneck, "summary": self.summary, "judged": self.judged,
            "missing": list(self.missing), "fix": list(self.fix), "expected": self.diagnosis.get("expected"),
            "steps": asdict(self.steps), "throughput": asdict(self.throughput), "memory": asdict(self.memory),
            "ranks": [asdict(r) for r in self.ranks], "devices": list(self.devices),
            "devices_now": list(self.devices_now), "host": self.host, "diagnosis": self.diagnosis})


# -- the parts ---------------------------------------------------------------------------------------------------


def _by_rank(record: Record) -> dict[int | None, list[StepEvent]]:
    out: dict[int | None, list[StepEvent]] = {}
    for s in sorted(record.steps, key=lambda s: s.t):
        out.setdefault(s.rank, []).append(s)
    return out


def _main_steps(by_rank: dict[int | None, list[StepEvent]]) -> list[StepEvent]:
    """One process's steps, else the lowest rank's (as ``window.window`` judges)."""
    if None in by_rank:
        return by_rank[None]
    return by_rank[min(by_rank)] if by_rank else []  # type: ignore[type-var]


def step_stats(record: Record) -> StepStats:
    steps = [s for s in _main_steps(_by_rank(record)) if s.seconds > 0]
    seconds = [s.seconds for s in steps]
    return StepStats(count=len(_main_steps(_by_rank(record))), median_s=_median(seconds),
                     p95_s=percentile(seconds, P95), max_s=max(seconds) if seconds else None,
                     data_wait_share_median=_median([s.data_wait_s / s.seconds for s in steps]),
                     ooms=len(record.ooms))


def throughput(record: Record) -> Throughput:
    """Items over the wall span of the steps: every rank's items (each rank's are its own share of the batch),
    over the span from the earliest step start to the latest step end. Where only some steps said their items, the
    rate is over those steps' own seconds (the span would count time whose items are unknown)."""
    by_rank = _by_rank(record)
    every = [s for steps in by_rank.values() for s in steps]
    if not every:
        return Throughput()
    start = min(s.t - s.seconds for s in every)
    end = max(s.t for s in every)
    wall = end - start
    main = _main_steps(by_rank)
    counted = [s for s in every if s.items is not None]
    items = sum(s.items for s in counted) if counted else None  # type: ignore[misc]
    if not counted:
        rate = None
    elif len(counted) == len(every):
        rate = items / wall if wall > 0 else None
    else:  # each rank's items over its own counted seconds, the ranks side by side
        rate = 0.0
        for rank in {s.rank for s in counted}:
            own = [s for s in counted if s.rank == rank]
            busy = sum(s.seconds for s in own)
            rate += sum(s.items for s in own) / busy if busy > 0 else 0.0  # type: ignore[misc]
        rate = rate or None
    return Throughput(wall_s=wall if wall > 0 else None, steps=len(main),
                      steps_per_s=len(main) / wall if wall > 0 else None, items=items, items_per_s=rate)


def _now_and_peak(series: list[int]) -> tuple[int | None, int | None]:
    return (series[-1], max(series)) if series else (None, None)


def memory_stats(record: Record, used: Sequence[int] = ()) -> MemoryStats:
    samples = sorted(record.samples, key=lambda s: s.t)
    hosts = [s.host for s in samples if s.host is not None]
    # 0 is no reading: the last sample of a watch comes as the command ends, its process a zombie (psutil reads 0)
    rss, rss_peak = _now_and_peak([h.process_rss_bytes for h in hosts if h.process_rss_bytes])
    workers = [h.workers_rss_bytes for h in hosts if h.workers_rss_bytes]
    allocs = [s.allocator for s in samples if s.allocator is not None]
    allocated, _ = _now_and_peak([a.allocated_bytes for a in allocs])
    peaks = [max(a.allocated_bytes, a.peak_allocated_bytes or 0) for a in allocs]
    reserved, reserved_peak = _now_and_peak([a.reserved_bytes for a in allocs])
    keep = set(used)
    mine, total = [], []
    for s in samples:
        devs = [d for d in s.devices if not keep or d.index in keep]
        held = [d.process_memory_bytes for d in devs if d.process_memory_bytes is not None]
        if held:
            mine.append(sum(held))
        in_use = [d.memory_used_bytes for d in devs if d.memory_used_bytes is not None]
        if in_use:
            total.append(sum(in_use))
    dev, dev_peak = _now_and_peak(mine)
    dev_used, dev_used_peak = _now_and_peak(total)
    return MemoryStats(process_rss_bytes=rss, process_rss_peak_bytes=rss_peak,
                       workers_rss_bytes=workers[-1] if workers else None,
                       allocator_allocated_bytes=allocated,
                       allocator_allocated_peak_bytes=max(peaks) if peaks else None,
                       allocator_reserved_bytes=reserved, allocator_reserved_peak_bytes=reserved_peak,
                       device_process_bytes=dev, device_process_peak_bytes=dev_peak,
                       device_used_bytes=dev_used, device_used_peak_bytes=dev_used_peak)


def rank_stats(record: Record) -> tuple[RankStats, ...]:
    """Each rank's steps, where the events carry ranks (one rank or several)."""
    out = []
    for rank, steps in sorted((k, v) for k, v in _by_rank(record).items() if k is not None):
        timed = [s for s in steps if s.seconds > 0]
        comm = [s for s in timed if s.exposed_comm_s is not None]
        out.append(RankStats(rank=rank, steps=len(steps), step_median_s=_median([s.seconds for s in timed]),
                             exposed_comm_median_s=_median([s.exposed_comm_s for s in comm]),  # type: ignore[misc]
                             own_work_median_s=_median([s.seconds - s.exposed_comm_s for s in comm]),  # type: ignore
                             data_wait_median_s=_median([s.data_wait_s for s in timed])))
    return tuple(out)


def devices_now(record: Record, used: Sequence[int] = ()) -> tuple[dict[str, Any], ...]:
    """Each GPU's latest reading (the last sample it appears in): what a scrape reports as "now"."""
    last: dict[int, Any] = {}
    for s in sorted(record.samples, key=lambda s: s.t):
        for d in s.devices:
            last[d.index] = d
    return tuple({"index": i, "name": d.name, "used": (i in used) if used else None, "util_pct": d.util_pct,
                  "memory_used_bytes": d.memory_used_bytes, "memory_total_bytes": d.memory_total_bytes,
                  "process_memory_bytes": d.process_memory_bytes, "power_w": d.power_w,
                  "sm_clock_mhz": d.sm_clock_mhz, "temperature_c": d.temperature_c} for i, d in sorted(last.items()))


def build_report(record: Record, diagnosis: Diagnosis, *, used: Sequence[int] = ()) -> Report:
    """The report of ``record`` as ``diagnosis`` judged it. ``used``: the GPUs the command held memory on (the
    memory figures count those; every GPU when empty)."""

    missing = diagnosis.evidence.get("missing") if diagnosis.bottleneck == "not-judged" else None
    return Report(bottleneck=diagnosis.bottleneck, summary=diagnosis.summary,
                  judged=diagnosis.bottleneck != "not-judged",
                  missing=tuple(str(m) for m in missing) if isinstance(missing, (list, tuple)) else (),
                  diagnosis=diagnosis_json(diagnosis), steps=step_stats(record), throughput=throughput(record),
                  memory=memory_stats(record, used), ranks=rank_stats(record),
                  devices=tuple(device_summary(record, used)), devices_now=devices_now(record, used),
                  host=host_summary(record))


# -- the diagnosis as plain data (render.diagnosis shows it to people) ---------------------------------------


def jsonable(x: Any) -> Any:
    """Dicts, lists and plain scalars as json.dumps takes them: a non-finite float as None, anything else as str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _verdict_json(f: Verdict) -> dict[str, Any]:
    return {"bottleneck": f.bottleneck, "share": rounded(f.share), "summary": f.summary, "evidence": f.evidence,
            "fix": list(f.fix), "expected": f.expected, "source": f.source, "change": jsonable(f.change)}


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """A plain dict json.dumps takes: bottleneck, summary, evidence, fix, expected, findings, observed_vs_planned,
    note, steps."""
    return jsonable({"bottleneck": d.bottleneck, "summary": d.summary, "evidence": d.evidence, "fix": list(d.fix),
                      "expected": d.expected, "findings": [_verdict_json(f) for f in d.findings],
                      "observed_vs_planned": d.observed_vs_planned, "note": d.note, "steps": d.steps})



# -- summaries over a record ----------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def device_summary(record: Record, used: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Per GPU over the whole watch: medians of the duty cycle and power, peaks of memory and temperature, the clock,
    and the throttle reasons seen while it was busy. ``used``: the GPUs the command held memory on (flagged)."""
    by_index: dict[int, list] = {}
    for s in record.samples:
        for d in s.devices:
            by_index.setdefault(d.index, []).append(d)
    rows = []
    for index, ds in sorted(by_index.items()):
        def vals(name: str, ds=ds) -> list[float]:
            return [getattr(d, name) for d in ds if getattr(d, name) is not None]

        busy = [d for d in ds if (d.util_pct or 0) >= 10]
        reasons = sorted({r for d in busy for r in (d.clock_reasons or ()) if r != "idle"})
        energy = vals("energy_j")
        rows.append({
            "index": index, "name": next((d.name for d in ds if d.name), None), "samples": len(ds),
            "used": index in used if used else None,
            "util_median_pct": _median(vals("util_pct")), "util_max_pct": _max(vals("util_pct")),
            "memory_peak_bytes": _max(vals("memory_used_bytes")),
            "memory_total_bytes": _max(vals("memory_total_bytes")),
            "process_memory_peak_bytes": _max(vals("process_memory_bytes")),
            "power_median_w": _median(vals("power_w")), "power_max_w": _max(vals("power_w")),
            "power_limit_w": _max(vals("power_limit_w")),
            "energy_j": energy[-1] - energy[0] if len(energy) >= 2 else None,
            "sm_clock_median_mhz": _median(vals("sm_clock_mhz")), "sm_clock_max_mhz": _max(vals("sm_clock_max_mhz")),
            "temperature_max_c": _max(vals("temperature_c")),
            "sm_active_median_pct": _median(vals("sm_active_pct")),
            "throttle_reasons": reasons,
        })
    return rows


def host_summary(record: Record) -> dict[str, Any]:
    """The host over the watch: busy cores, the command's CPU (% of one core) and its workers', memory, iowait."""
    hosts = [s.host for s in record.samples if s.host is not None]
    cores = max((len(h.cpu_pct) for h in hosts), default=0)
    proc = [h.process_cpu_pct for h in hosts if h.process_cpu_pct is not None]
    return {
        "cores": cores or None,
        "busy_cores_median": _median([sum(h.cpu_pct) / 100 for h in hosts if h.cpu_pct]),
        "process_cpu_median_pct": _median(proc), "process_cpu_max_pct": _max(proc),
        "workers_max": _max([h.workers for h in hosts if h.workers is not None]),
        "workers_cpu_median_pct": _median([h.workers_cpu_pct for h in hosts if h.workers and
                                           h.workers_cpu_pct is not None]),
        "memory_peak_bytes": _max([h.memory_used_bytes for h in hosts if h.memory_used_bytes is not None]),
        "memory_total_bytes": _max([h.memory_total_bytes for h in hosts if h.memory_total_bytes is not None]),
        "iowait_median_pct": _median([h.iowait_pct for h in hosts if h.iowait_pct is not None]),
    }


def step_summary(record: Record) -> dict[str, Any]:
    """The loop's own step events, where the command ran a gpuwise.Monitor: count, the step time's median, p95 and
    max, the data-wait share, and throughput over wall clock (``monitor.report``: the lowest rank's steps under
    torchrun)."""

    st, tp = step_stats(record), throughput(record)
    return {"count": st.count, "step_median_s": st.median_s, "step_p95_s": st.p95_s, "step_max_s": st.max_s,
            "data_wait_share_median": st.data_wait_share_median, "ooms": st.ooms, "wall_s": tp.wall_s,
            "steps_per_s": tp.steps_per_s, "items_per_s": tp.items_per_s}


__all__ = ["MemoryStats", "RankStats", "Report", "StepStats", "Throughput", "build_report", "device_summary",
           "diagnosis_json", "host_summary", "jsonable", "memory_stats", "percentile", "rank_stats", "step_stats",
           "step_summary", "throughput"]
