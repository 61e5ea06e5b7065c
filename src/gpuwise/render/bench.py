"""``gpuwise bench``: timings, rates and comparisons."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.render._common import _seconds

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.bench.run import BenchComparison, BenchReport
    from gpuwise.bench.suite import BenchResult


def _rate(r: BenchResult) -> str:
    if r.gbps is not None:
        return f"{r.gbps:,.1f} GB/s"
    return f"{r.tflops:.3g} TF/s" if r.tflops is not None else "-"


def render_bench(results: list[BenchResult], header: str, console: Console) -> None:
    show_peak = any(r.pct_of_peak is not None for r in results)
    show_cpu = any(r.speedup_vs_cpu is not None for r in results)
    table = Table(title=f"gpuwise bench: {header}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    columns = [("op", "left"), ("dtype", "left"), ("shape", "left"), ("median", "right"), ("±", "right"),
               ("rate", "right")] + [("peak", "right")] * show_peak + [("vs CPU", "right")] * show_cpu
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=col not in ("shape",), overflow="fold")
    for r in results:
        op = f"{r.op} {r.backend}" if r.backend else r.op
        if not r.repeats:
            table.add_row(op, r.dtype, r.shape, Text(r.note or "not run", style="yellow"), "", "",
                          *[""] * (show_peak + show_cpu))
            continue
        spread = 50 * (r.p90_s - r.p10_s) / r.median_s if r.median_s else 0.0
        row = [op, r.dtype, r.shape, _seconds(r.median_s), f"{spread:.0f}%", _rate(r)]
        if show_peak:
            row.append("-" if r.pct_of_peak is None else f"{r.pct_of_peak:.0f}%")
        if show_cpu:
            row.append("-" if r.speedup_vs_cpu is None else f"{r.speedup_vs_cpu:.1f}x")
        table.add_row(*row)
    console.print(table)
    console.print("median of timed repeats after warm-up, the device synchronised before every clock read; ±: "
                  "half the p10-p90 spread" + ("; peak: share of the catalog's dense figure for this device and "
                                                "dtype (bandwidth for copies)" if show_peak else "") + ".")


def render_compare(pairs: list[tuple[BenchResult, BenchResult, float]], names: tuple[str, str],
                   console: Console) -> None:
    # the runs' names (file paths, often long) are said above the table, so the columns keep short headers
    console.print(Text(f"A: {names[0]}\nB: {names[1]}", overflow="fold"))
    table = Table(title="B against A", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col, justify in (("op", "left"), ("dtype", "left"), ("shape", "left"), ("A", "right"),
                         ("B", "right"), ("speed-up", "right")):
        # the op and shape fold; the timings and the ratio never split
        table.add_column(col, justify=justify, overflow="fold", no_wrap=justify == "right")
    for a, b, ratio in pairs:
        op = f"{a.op} ({a.backend})" if a.backend else a.op
        style = "green" if ratio > 1.05 else "red" if ratio < 0.95 else ""
        table.add_row(op, a.dtype, a.shape, _seconds(a.median_s), _seconds(b.median_s),
                      Text(f"{ratio:.2f}x", style=style))
    console.print(table)
    if not pairs:
        console.print("no results in common (same op, dtype, shape and backend)")


def render_report(report: BenchReport, console: Console) -> None:
    """A run's table, then its comparison with the baseline file when there is one."""
    render_bench(list(report.results), report.label, console)
    if report.comparison is not None:
        render_comparison(report.comparison, console)


def render_comparison(comparison: BenchComparison, console: Console) -> None:
    render_compare(list(comparison.pairs), comparison.names, console)


def report_json(report: BenchReport) -> list[dict]:
    from gpuwise.bench.results import to_dicts

    return to_dicts(list(report.results))


def comparison_json(comparison: BenchComparison) -> list[dict]:
    return [{"op": a.op, "dtype": a.dtype, "shape": a.shape, "backend": a.backend, "a_median_s": a.median_s,
             "b_median_s": b.median_s, "speedup": ratio} for a, b, ratio in comparison.pairs]
