"""Pictures of results, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gpuwise.files import atomic_path
from gpuwise.units import GiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from gpuwise.bench.run import BenchReport
    from gpuwise.planning.planner import MemoryPlan
    from gpuwise.recommend.option import Recommendation

_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
           "temporaries": "#8172b3", "inputs": "#937860", "kv_cache": "#da8bc3"}
FORMATS = (".png", ".svg")  # what --plot draws, by the file's suffix


def save(fig: Figure, path: str | os.PathLike) -> None:
    """Write ``fig`` as a PNG or an SVG, by the suffix of ``path`` (atomically), and free it."""
    import matplotlib.pyplot as plt

    kind = "svg" if os.fspath(path).lower().endswith(".svg") else "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=kind)
    plt.close(fig)


def plain(x: float) -> str:
    """A tick value as people write it, three significant figures and no exponent: 0.003, 0.3, 12, 1,500."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    text = f"{x:,.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def hours(h: float) -> str:
    """A duration given in hours, in the unit that reads best: "40 s", "20 min", "3 h", "1,200 h"."""
    if h < 1 / 60:
        return f"{plain(h * 3600)} s"
    return f"{plain(h * 60)} min" if h < 1 else f"{plain(h)} h"


def dollars(usd: float) -> str:
    """ "$0.3", "$12", "$1,500", "$25k", "$3M"."""
    if usd >= 1e6:
        return f"${plain(usd / 1e6)}M"
    return f"${plain(usd / 1e3)}k" if usd >= 1e4 else f"${plain(usd)}"


def _log_ticks(ax_axis, text: Callable[[float], str]) -> None:
    """Label a log axis in plain numbers with their unit (``text``): matplotlib's own choice of which ticks carry a
    label, without its "3×10⁻¹"."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return text(x)

    ax_axis.set_major_formatter(Plain(labelOnlyBase=False))
    ax_axis.set_minor_formatter(Plain(labelOnlyBase=False))


def plot_plan(plan: MemoryPlan, path: str | os.PathLike) -> None:
    """The memory timeline of one step, stacked by category, with the peak and each GPU's capacity marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpuwise.planning.capture.tracker import CATEGORIES

    live = plan.timeline / GiB
    x = np.arange(len(live))
    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    shown = [i for i, c in enumerate(CATEGORIES) if live[:, i].any()]
    ax.stackplot(x, *(live[:, i] for i in shown), labels=[CATEGORIES[i] for i in shown],
                 colors=[_COLORS[CATEGORIES[i]] for i in shown], linewidth=0)
    peak = int(live.sum(axis=1).argmax())
    ax.axvline(peak, color="black", linestyle=":", linewidth=1)
    ax.annotate(f"peak {plan.peak_bytes / GiB:.2f} GiB", (peak, live[peak].sum()), textcoords="offset points",
                xytext=(4, 4), fontsize=9)
    phases = plan.timeline_phases
    for i in range(1, len(phases)):
        if phases[i] != phases[i - 1]:
            ax.axvline(i, color="grey", linewidth=0.5)
            ax.text(i, ax.get_ylim()[1] * 0.01, f" {phases[i]}", fontsize=7, va="bottom", color="grey")
    if len(plan.gpus) == 1:
        cap = (plan.gpus[0].memory_bytes - plan.overhead_bytes) / GiB
        ax.axhline(cap, color="red", linewidth=1)
        ax.text(0, cap, f" {plan.gpus[0].gpu}: {cap:.1f} GiB for tensors", color="red", fontsize=8, va="bottom")
    ax.set_xlabel("allocating op in the step (forward, backward, optimizer)")
    ax.set_ylabel("live tensor memory (GiB)")
    ax.set_title(f"{plan.model}: {plan.setup.describe()}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(x=0)
    fig.tight_layout()
    save(fig, path)


def plot_bench(report: BenchReport, path: str | os.PathLike) -> None:
    """The roofline of a ``gpuwise bench`` run: a compute ceiling per GEMM dtype that ran and the bandwidth
    ceiling, from the device's catalog row, else the best this run reached."""
    results = report.results
    dtypes_run = sorted({r.dtype for r in results if r.op == "gemm" and r.tflops})
    acc = report.row
    if acc:  # a compute ceiling per dtype that ran, from the datasheet
        ceilings = {d: acc.peak_tflops.get(d) for d in dtypes_run if acc.peak_tflops.get(d)}
        peak_gbps = acc.memory_bandwidth_gbps
    else:  # no datasheet: the best this run reached
        ceilings = {d: max(r.tflops for r in results if r.op == "gemm" and r.dtype == d and r.tflops)
                    for d in dtypes_run}
        copies = [r.gbps for r in results if r.op == "copy" and r.gbps]
        peak_gbps = max(copies) if copies else None
    source = "catalog" if acc else "best measured"
    plot_roofline(results, path, title=f"{report.label}: ceilings from the {source}", ceilings=ceilings,
                  peak_gbps=peak_gbps)


def plot_roofline(results, path: str | os.PathLike, *, title: str, ceilings: dict[str, float],
                  peak_gbps: float | None) -> None:
    """Achieved TFLOPS against arithmetic intensity (FLOPs per byte the op must move), under the compute and
    bandwidth ceilings. Ops without a byte count (``BenchResult.bytes``) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in results if r.repeats and r.tflops and r.flops and r.bytes]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    xs = np.array([r.flops / r.bytes for r in points]) if points else np.array([1.0])
    lo, hi = max(xs.min() / 4, 0.01), xs.max() * 4
    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    styles = iter(["-", "--", "-.", ":", (0, (5, 1))])
    for dtype, tflops in sorted(ceilings.items(), key=lambda kv: -kv[1]):  # one roof per dtype that ran
        roof = np.minimum(grid * peak_gbps / 1e3, tflops) if peak_gbps else np.full_like(grid, tflops)
        ax.plot(grid, roof, color="black", linewidth=1.0, linestyle=next(styles, "-"),
                label=f"{dtype} roof: {tflops:.3g} TFLOPS" + (f", {peak_gbps:,.0f} GB/s" if peak_gbps else ""))
    if peak_gbps and not ceilings:  # GB/s = 1e9 B/s; x FLOP/B -> GFLOP/s; /1e3 -> TFLOPS
        ax.plot(grid, grid * peak_gbps / 1e3, color="black", linewidth=1.0, label=f"bandwidth {peak_gbps:,.0f} GB/s")
    for op in sorted({r.op for r in points}):
        mine = [r for r in points if r.op == op]
        ax.scatter([r.flops / r.bytes for r in mine], [r.tflops for r in mine], label=op, s=24)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte)")
    ax.set_ylabel("achieved TFLOPS")
    _log_ticks(ax.xaxis, plain)
    _log_ticks(ax.yaxis, plain)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)



def plot_recommend(rec: Recommendation, path: str | os.PathLike) -> None:
    """Time to the goal against its cost, one point per GPU and count, the Pareto front joined and labelled."""
    save(recommend_figure(rec), path)


def recommend_figure(rec: Recommendation) -> Figure:
    """The figure ``plot_recommend`` draws: both axes logarithmic, labelled in plain numbers with their units
    ("20 min", "3 h", "$12")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rent = rec.constraints.mode == "rent"
    serving = rec.traffic is not None
    if serving:  # the serving front: time per output token (or per batch) against the fleet's rent per hour
        points = [(o.step_time_s * 1e3, o.rent_usd_per_hour.usd * o.gpus_total if rent else o.buy_usd, o)
                  for o in rec.rows if (o.rent_usd_per_hour is not None if rent else o.buy_usd is not None)]
    else:
        points = [(o.time_to_goal_s / 3600, o.rent_usd if rent else o.buy_usd, o) for o in rec.rows
                  if o.time_to_goal_s is not None and (o.rent_usd if rent else o.buy_usd) is not None]
    if not points:
        from gpuwise.errors import GpuwiseError

        raise GpuwiseError("nothing to draw: no row has both a time and a price",
                           "give a goal (--tokens) and prices (--prices) for the GPUs you consider")
    from gpuwise.hardware.catalog import SEGMENTS, load_catalog

    catalog = load_catalog()
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    cmap = plt.get_cmap("tab10")
    for i, segment in enumerate(SEGMENTS):  # one colour a segment; the point grows with the GPU count
        mine = [p for p in points if (acc := catalog.find(p[2].gpu)) is not None and acc.segment == segment]
        if mine:
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], s=[12 + 6 * p[2].count ** 0.5 for p in mine],
                       color=cmap(i), alpha=0.6, linewidths=0, label=segment)
    ax.legend(loc="upper right", fontsize=8, title="point size: GPU count", title_fontsize=8)
    front = sorted((p for p in points if p[2].pareto), key=lambda p: p[0])
    ax.plot([p[0] for p in front], [p[1] for p in front], color="black", linewidth=1, marker="o", markersize=4)
    for t, cost, o in front:
        ax.annotate(f"{o.gpus_total}x {o.gpu}", (t, cost), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    if serving:
        ax.set_xlabel("time per output token" if rec.unit == "tokens" else "time per batch")
        ax.set_ylabel("rent of every replica per hour" if rent else "purchase price of the GPUs")
        _log_ticks(ax.xaxis, lambda ms: f"{plain(ms)} ms")
        _log_ticks(ax.yaxis, (lambda usd: dollars(usd) + "/h") if rent else dollars)
    else:
        ax.set_xlabel(f"time to {plain(rec.goal.amount)} {rec.unit}")
        ax.set_ylabel("rent for the job" if rent else "purchase price of the GPUs")
        _log_ticks(ax.xaxis, hours)
        _log_ticks(ax.yaxis, dollars)
    what = "serving" if serving else f"{rec.setup.task}, global batch {rec.setup.batch}"
    ax.set_title(f"{rec.model}: {what} (line: Pareto front)", fontsize=10)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    return fig


STALL_MARK = 2.0  # a step this many times the median is drawn red in the step-time panel (a picture's cue only; the
# stalls rule in monitor.step_rules decides what counts)


def plot_watch(result, path: str | os.PathLike) -> None:
    """The timeline of a ``gpuwise watch`` (``watch_figure``), as a PNG or an SVG."""
    save(watch_figure(result), path)


def _memory_unit(peak: float) -> tuple[float, str]:
    return (GiB, "GiB") if peak >= GiB else (2 ** 20, "MiB")


def watch_figure(result) -> Figure:
    """The figure ``plot_watch`` draws, one panel a row over the watch's seconds: per GPU its duty cycle, memory and
    power (the CPU side, host busy share and the command's CPU, where there are no GPU counters); where the command
    reported steps, each step's time with the median line (a stall stands out: red at ``STALL_MARK`` x the median)
    and its data-wait share; and the command's own memory (resident set, its workers', torch's allocator) where it
    was read, so a leak shows as a climbing line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpuwise.monitor.nvml import THROTTLING

    record = result.record
    samples = record.samples
    if not samples:
        from gpuwise.errors import GpuwiseError

        raise GpuwiseError("nothing to draw: no sample was taken", "watch a command that runs for a moment")
    by_index: dict[int, list] = {}
    for s in samples:
        for d in s.devices:
            by_index.setdefault(d.index, []).append((s.t, d))
    panels: list[str] = ["util", "memory", "power"] if by_index else ["cpu"]
    if record.steps:
        panels += ["step", "wait"]
    if any(s.allocator is not None or (s.host is not None and s.host.process_rss_bytes) for s in samples):
        panels.append("rss")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels) + 0.8), dpi=120, sharex=True,
                             squeeze=False)
    cmap = plt.get_cmap("tab10")

    def series(points, name):
        kept = [(t, getattr(d, name)) for t, d in points if getattr(d, name) is not None]
        return [t for t, _ in kept], [v for _, v in kept]

    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel == "util":
            for i, (index, points) in enumerate(sorted(by_index.items())):
                ax.plot(*series(points, "util_pct"), color=cmap(i % 10), linewidth=1, label=f"GPU {index}")
                t, sm = series(points, "sm_active_pct")
                if sm:
                    ax.plot(t, sm, color=cmap(i % 10), linewidth=1, linestyle=":", label=f"GPU {index} SM active")
            ax.set_ylabel("utilisation %")
            ax.set_ylim(0, 105)
        elif panel == "memory":
            for i, (index, points) in enumerate(sorted(by_index.items())):
                t, used = series(points, "memory_used_bytes")
                ax.plot(t, np.array(used) / GiB, color=cmap(i % 10), linewidth=1, label=f"GPU {index}")
                t, mine = series(points, "process_memory_bytes")
                if mine:
                    ax.plot(t, np.array(mine) / GiB, color=cmap(i % 10), linewidth=1, linestyle="--",
                            label=f"GPU {index}: the command")
                totals = [d.memory_total_bytes for _, d in points if d.memory_total_bytes]
                if totals:
                    ax.axhline(max(totals) / GiB, color=cmap(i % 10), linewidth=0.5, alpha=0.5)
            ax.set_ylabel("memory GiB")
        elif panel == "power":
            for i, (index, points) in enumerate(sorted(by_index.items())):
                ax.plot(*series(points, "power_w"), color=cmap(i % 10), linewidth=1, label=f"GPU {index}")
                limits = [d.power_limit_w for _, d in points if d.power_limit_w]
                if limits:
                    ax.axhline(max(limits), color=cmap(i % 10), linewidth=0.5, alpha=0.5)
                held = [t for t, d in points if set(d.clock_reasons or ()) & THROTTLING]
                if held:
                    ax.plot(held, [0] * len(held), "|", color="red", markersize=8, label=f"GPU {index} throttled")
            ax.set_ylabel("power W")
        elif panel == "cpu":
            hosts = [(s.t, s.host) for s in samples if s.host is not None]
            t = [t for t, h in hosts if h.cpu_pct]
            ax.plot(t, [sum(h.cpu_pct) / len(h.cpu_pct) for _, h in hosts if h.cpu_pct], color=cmap(0),
                    linewidth=1, label="host, all cores (% of the machine)")
            kept = [(t, h.process_cpu_pct) for t, h in hosts if h.process_cpu_pct is not None]
            ax.plot([t for t, _ in kept], [v for _, v in kept], color=cmap(1), linewidth=1,
                    label="the command (% of one core)")
            kept = [(t, h.workers_cpu_pct) for t, h in hosts if h.workers and h.workers_cpu_pct is not None]
            if kept:
                ax.plot([t for t, _ in kept], [v for _, v in kept], color=cmap(2), linewidth=1,
                        label="its child processes (% of one core)")
            ax.set_ylabel("CPU %")
            ax.set_ylim(bottom=0)
        elif panel == "step":  # each step's time, per rank where there are ranks, against the median
            timed = [s for s in record.steps if s.seconds > 0]
            ranks = sorted({s.rank for s in timed}, key=lambda r: -1 if r is None else r)
            for i, rank in enumerate(ranks):
                mine = sorted((s for s in timed if s.rank == rank), key=lambda s: s.t)
                ax.plot([s.t for s in mine], [s.seconds * 1e3 for s in mine], color=cmap(i % 10), linewidth=0.8,
                        marker=".", markersize=3, label="step time" if rank is None else f"rank {rank}")
            if timed:
                mid = float(np.median([s.seconds for s in timed]))
                ax.axhline(mid * 1e3, color="black", linewidth=0.8, linestyle="--",
                           label=f"median {mid * 1e3:.3g} ms")
                slow = [s for s in timed if s.seconds >= STALL_MARK * mid]
                if slow:
                    ax.scatter([s.t for s in slow], [s.seconds * 1e3 for s in slow], color="red", s=14, zorder=3,
                               label=f"{len(slow)} step{'s' if len(slow) > 1 else ''} >= {STALL_MARK:g}x the median")
            ax.set_ylabel("step ms")
            ax.set_ylim(bottom=0)
        elif panel == "rss":  # the command's own memory over time: a leak climbs
            hosts = [(s.t, s.host) for s in samples if s.host is not None]
            rss = [(t, h.process_rss_bytes) for t, h in hosts if h.process_rss_bytes]  # 0: the process had ended
            workers = [(t, h.workers_rss_bytes) for t, h in hosts if h.workers_rss_bytes]
            allocs = [(s.t, s.allocator) for s in samples if s.allocator is not None]
            peak = max([v for _, v in rss + workers] + [a.reserved_bytes for _, a in allocs] + [1])
            unit, name = _memory_unit(peak)
            lines = [("the command's RSS", rss, "-"), ("its workers' RSS", workers, ":"),
                     ("allocator: allocated", [(t, a.allocated_bytes) for t, a in allocs], "-"),
                     ("allocator: reserved", [(t, a.reserved_bytes) for t, a in allocs], "--")]
            for i, (label, points, style) in enumerate(lines):
                if points:
                    ax.plot([t for t, _ in points], [v / unit for _, v in points], color=cmap((4 + i) % 10),
                            linewidth=1, linestyle=style, label=label)
            ax.set_ylabel(f"process memory {name}")
            ax.set_ylim(bottom=0)
        else:  # the loop's own steps: the share of each spent waiting for data
            steps = [s for s in record.steps if s.seconds > 0]
            ax.bar([s.t - s.seconds / 2 for s in steps], [100 * s.data_wait_s / s.seconds for s in steps],
                   width=[s.seconds for s in steps], color=cmap(3), alpha=0.7, label="data wait, % of the step")
            ax.set_ylabel("data wait %")
            ax.set_ylim(0, 105)
        ax.grid(True, linewidth=0.3, alpha=0.5)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the command started")
    what = " ".join(result.command) if result.command else f"pid {result.pid}"
    title = (what if len(what) <= 70 else what[:67] + "...") + f"\n{result.diagnosis.bottleneck}"
    if not by_index:
        title += " (no GPU counters: the CPU side)"
    axes[0, 0].set_title(title, fontsize=9)  # two lines: the command, then the verdict, within the figure
    fig.tight_layout()
    return fig
