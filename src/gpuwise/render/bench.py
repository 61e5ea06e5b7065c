"""``gpuwise bench``: timings, rates and comparisons."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.render._common import Column, Sheet, _num, _seconds, print_table

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.bench.run import BenchComparison, BenchReport
    from gpuwise.bench.suite import BenchResult


def _rate(row: dict[str, Any]) -> str:
    if row["gbps"] is not None:
        return f"{row['gbps']:,.1f} GB/s"
    return f"{row['tflops']:.3g} TF/s" if row["tflops"] is not None else "-"


def _median(row: dict[str, Any]) -> str | Text:
    return _seconds(row["median_s"]) if row["repeats"] else Text("not run", style="yellow")


def _ran(show: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    """A figure of a case that ran; a blank beside "not run"."""
    return lambda row: show(row) if row["repeats"] else ""


def _op(row: dict[str, Any]) -> str:
    return f"{row['op']} {row['backend']}" if row["backend"] else row["op"]


def _spread_pct(r: BenchResult) -> float | None:
    """Half the p10-p90 spread as a share of the median: the "±" of the table."""
    return 50 * (r.p90_s - r.p10_s) / r.median_s if r.repeats and r.median_s else None


def bench_sheet(results: list[BenchResult], header: str) -> Sheet:
    """A run's cases for every format: times in seconds, rates in TFLOPS and GB/s, shares in percent."""
    show_peak = any(r.pct_of_peak is not None for r in results)
    show_cpu = any(r.speedup_vs_cpu is not None for r in results)
    columns = (
        Column(key="op", priority=0, show=_op),
        Column(key="backend", table=False),
        Column(key="dtype", priority=3),
        Column(key="shape", priority=4, wrap=True),
        Column(key="device", table=False),
        Column(key="median_s", header="median", priority=1, numeric=True, show=_median),
        Column(key="spread_pct", header="±", priority=6, numeric=True,
               show=_ran(lambda r: _num(r["spread_pct"], ".0f") + "%")),
        Column(key="p10_s", table=False),
        Column(key="p90_s", table=False),
        Column(key="tflops", header="rate", priority=2, numeric=True, show=_ran(_rate)),
        Column(key="gbps", table=False),
        Column(key="pct_of_peak", header="peak", priority=5, numeric=True, table=show_peak,
               show=_ran(lambda r: "-" if r["pct_of_peak"] is None else f"{r['pct_of_peak']:.0f}%")),
        Column(key="speedup_vs_cpu", header="vs CPU", priority=7, numeric=True, table=show_cpu,
               show=_ran(lambda r: "-" if r["speedup_vs_cpu"] is None else f"{r['speedup_vs_cpu']:.1f}x")),
        Column(key="repeats", table=False),
        Column(key="flops", table=False),
        Column(key="bytes", table=False),
        Column(key="peak_memory_bytes", table=False),
        Column(key="note", table=False),
    )
    rows = tuple({**{c.key: getattr(r, c.key, None) for c in columns}, "spread_pct": _spread_pct(r)}
                 for r in results)
    notes = ["median of timed repeats after warm-up, the device synchronised before every clock read; ±: half the "
             "p10-p90 spread" + ("; peak: share of the catalog's dense figure for this device and dtype (bandwidth "
                                 "for copies)" if show_peak else "") + "."]
    notes += [f"{_op(row)} {row['dtype']} {row['shape']}: {row['note'] or 'not run'}" for row in rows
              if not row["repeats"]]
    return Sheet(title=f"gpuwise bench: {header}", columns=columns, rows=rows, notes=tuple(notes))


def render_bench(results: list[BenchResult], header: str, console: Console) -> None:
    print_table(bench_sheet(results, header), console)


def _speedup(row: dict[str, Any]) -> Text:
    ratio = row["speedup"]
    return Text(f"{ratio:.2f}x", style="green" if ratio > 1.05 else "red" if ratio < 0.95 else "")


_COMPARE_COLUMNS = (
    Column(key="op", priority=0, show=lambda r: f"{r['op']} ({r['backend']})" if r["backend"] else r["op"]),
    Column(key="backend", table=False),
    Column(key="dtype", priority=3),
    Column(key="shape", priority=4, wrap=True),
    Column(key="a_median_s", header="A", priority=1, numeric=True, show=lambda r: _seconds(r["a_median_s"])),
    Column(key="b_median_s", header="B", priority=2, numeric=True, show=lambda r: _seconds(r["b_median_s"])),
    Column(key="speedup", header="speed-up", priority=0, numeric=True, show=_speedup),
)


def compare_sheet(pairs: list[tuple[BenchResult, BenchResult, float]], names: tuple[str, str]) -> Sheet:
    """Two runs' common cases: each one's median in seconds and B's speed-up over A (A's time over B's)."""
    rows = tuple({"op": a.op, "backend": a.backend, "dtype": a.dtype, "shape": a.shape, "a_median_s": a.median_s,
                  "b_median_s": b.median_s, "speedup": ratio} for a, b, ratio in pairs)
    notes = (f"A: {names[0]}", f"B: {names[1]}")
    if not pairs:
        notes += ("no results in common (same op, dtype, shape and backend)",)
    return Sheet(title="B against A", columns=_COMPARE_COLUMNS, rows=rows, notes=notes)


def render_compare(pairs: list[tuple[BenchResult, BenchResult, float]], names: tuple[str, str],
                   console: Console) -> None:
    # the runs' names (file paths, often long) are said above the table, so the columns keep short headers
    console.print(Text(f"A: {names[0]}\nB: {names[1]}", overflow="fold"))
    sheet = compare_sheet(pairs, names)
    print_table(dataclasses.replace(sheet, notes=sheet.notes[2:]), console)


def render_report(report: BenchReport, console: Console) -> None:
    """A run's table, then its comparison with the baseline file when there is one."""
    render_bench(list(report.results), report.label, console)
    if report.comparison is not None:
        render_comparison(report.comparison, console)


def render_comparison(comparison: BenchComparison, console: Console) -> None:
    render_compare(list(comparison.pairs), comparison.names, console)


def report_sheet(report: BenchReport) -> Sheet:
    return bench_sheet(list(report.results), report.label)


def comparison_sheet(comparison: BenchComparison) -> Sheet:
    return compare_sheet(list(comparison.pairs), comparison.names)


def report_json(report: BenchReport) -> dict[str, Any]:
    """``bench --json``: the run's results, as ``--save`` writes them, under "results"."""
    from gpuwise.bench.results import to_dicts

    return {"results": to_dicts(list(report.results))}


def comparison_json(comparison: BenchComparison) -> dict[str, Any]:
    """``bench --compare A --compare B --json``: the two runs' names and their common cases, under "pairs"."""
    return {"a": comparison.names[0], "b": comparison.names[1],
            "pairs": [{"op": a.op, "dtype": a.dtype, "shape": a.shape, "backend": a.backend,
                       "a_median_s": a.median_s, "b_median_s": b.median_s, "speedup": ratio}
                      for a, b, ratio in comparison.pairs]}
