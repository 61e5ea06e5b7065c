"""``gpuwise bench``: timings, rates and comparisons."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from rich import box
from rich.console import Console
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from gpuwise.render._common import (
    Column,
    Sheet,
    _cells,
    _layout,
    _num,
    _seconds,
    _stacked,
    fit_table,
    hidden_note,
    print_lines,
    print_table,
    print_wrapped,
    title_over,
)

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.bench.run import BenchComparison, BenchReport, BenchStart
    from gpuwise.bench.suite import BenchResult


def _rate(row: dict[str, Any]) -> str:
    """Three figures, in a unit that keeps them short: "812 TF/s", "1.23 TF/s", "70.4 GF/s" (a CPU), "0.84 GF/s",
    "4,812 GB/s", "10.2 GB/s"; never "0.00419 TF/s" or "1.23e+03 TF/s"."""
    if row["gbps"] is not None:
        gbps = row["gbps"]
        return f"{gbps:,.0f} GB/s" if gbps >= 99.95 else f"{gbps:.3g} GB/s" if gbps >= 0.9995 else f"{gbps:.2g} GB/s"
    tflops = row["tflops"]
    if tflops is None:
        return "-"
    gflops = float(f"{tflops * 1e3:.3g}")  # rounded before the unit is chosen: 999.6 GF/s is 1 TF/s
    if gflops < 1000:  # two figures below 1 ("0.84 GF/s", an emulated dtype): nine characters at most on a CPU
        return f"{gflops:g} GF/s" if gflops >= 1 else f"{tflops * 1e3:.2g} GF/s"
    rounded = float(f"{tflops:.3g}")
    return f"{rounded:g} TF/s" if rounded < 1000 else f"{tflops:,.0f} TF/s"


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


def _bench_columns(show_peak: bool, show_cpu: bool) -> tuple[Column, ...]:
    return (
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


def _bench_row(r: BenchResult, columns: tuple[Column, ...]) -> dict[str, Any]:
    return {**{c.key: getattr(r, c.key, None) for c in columns}, "spread_pct": _spread_pct(r)}


def _bench_notes(rows: tuple[dict[str, Any], ...], show_peak: bool) -> list[str]:
    notes = ["median of timed repeats after warm-up, the device synchronised before every clock read; ±: half the "
             "p10-p90 spread" + ("; peak: share of the catalog's dense figure for this device and dtype (bandwidth "
                                 "for copies)" if show_peak else "") + "."]
    notes += [f"{_op(row)} {row['dtype']} {row['shape']}: {row['note'] or 'not run'}" for row in rows
              if not row["repeats"] or (row["note"] or "").startswith("smaller than")]
    return notes


def bench_sheet(results: list[BenchResult], header: str) -> Sheet:
    """A run's cases for every format: times in seconds, rates in TFLOPS and GB/s, shares in percent."""
    show_peak = any(r.pct_of_peak is not None for r in results)
    show_cpu = any(r.speedup_vs_cpu is not None for r in results)
    columns = _bench_columns(show_peak, show_cpu)
    rows = tuple(_bench_row(r, columns) for r in results)
    return Sheet(title=f"gpuwise bench: {header}", columns=columns, rows=rows,
                 notes=tuple(_bench_notes(rows, show_peak)))


# The widest a figure of a row is expected to print (_rate: 9 characters on a CPU, 10 on a GPU), so a table printed
# row by row has its widths before any case ran; a wider one folds onto a second line.
_WIDEST = {"median_s": "999.99 ms", "spread_pct": "999%", "pct_of_peak": "100%", "speedup_vs_cpu": "9999.9x"}
_WIDEST_RATE = {False: "99.9 GF/s", True: "4,812 GB/s"}  # by whether the device is a GPU


_STOPS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)}


@contextlib.contextmanager
def _whole() -> Iterator[None]:
    """Ctrl-C (SIGTERM, SIGHUP) waits until the block is done: a row is printed whole or not at all. Stopped
    between rich's write and the clearing of its buffer, the row came out again with the next print (three copies:
    the reader of a pipe, woken by the write, can send the signal at just that moment). A signal that came
    meanwhile goes to the handler it was for afterwards."""
    if threading.current_thread() is not threading.main_thread():  # handlers are set in the main thread only
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in _STOPS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if got:
            handler = previous[got[0]]
            if callable(handler):  # Python's own raises KeyboardInterrupt for SIGINT
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(got[0])


class BenchStream:
    """``gpuwise bench``'s table printed row by row, each as its case finishes: the title and header when the
    cases are known (``start``), a row per result (``row``), the notes at the end (``finish``), laid out as
    ``print_table`` lays out the whole table (on a terminal too narrow for one, each row as lines). ``status``
    shows the case running on a terminal's stderr, a line the next row wipes."""

    def __init__(self, console: Console, status: TextIO | None = None) -> None:
        self.console, self._status = console, status
        self.columns: tuple[Column, ...] = ()
        self.hidden: tuple[Column, ...] = ()
        self._table: Table | None = None
        self._shown: tuple[Column, ...] = ()
        self._stack = False  # too narrow for a table: rows as "header: value" lines
        self.started = False
        self.printed: list[BenchResult] = []
        self.show_peak = False

    def start(self, start: BenchStart) -> None:
        cases = [c for case in start.cases for c in (case, case.smaller) if c is not None]
        self.show_peak = start.peak
        self.columns = _bench_columns(start.peak, start.vs_cpu)
        shown = tuple(c for c in self.columns if c.table)
        widest = {**_WIDEST, "tflops": _WIDEST_RATE[start.vs_cpu]}
        rows = [[widest.get(c.key) or c.text({"op": case.op, "backend": case.backend, "dtype": case.dtype,
                                               "shape": case.shape}) for c in shown] for case in cases]
        rows = rows or [["" for _ in shown]]
        width, title = self.console.width, f"gpuwise bench: {start.label}"
        self._stack = not _layout(shown, _cells(shown, rows)[1], width, True)[1]
        with _whole():
            self.clear()
            self.started = True
            if self._stack:
                self._shown = shown
                print_wrapped(self.console, Text(title, style="italic"))
                return
            self._table, self.hidden = fit_table(shown, rows, width)
            self._shown = tuple(c for c in shown if c not in self.hidden)  # fit_table's, in its order
            header = self._copy(header=True)
            title_over(self.console, header, title)  # as print_table places it
            self._print_lines(header, drop_last=True)

    def status(self, text: str) -> None:
        if self._status is not None:
            width = max(10, self.console.width - 1)
            self._status.write(f"\r\x1b[K{text[:width]}")
            self._status.flush()

    def clear(self) -> None:
        """Wipe the status line (before a row, and before the command ends)."""
        if self._status is not None:
            self._status.write("\r\x1b[K")
            self._status.flush()

    def _copy(self, *, header: bool) -> Table:
        """An empty table with the started one's columns and widths, with its header or without."""
        assert self._table is not None
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=True, show_header=header)
        for col in self._table.columns:
            table.add_column(col.header, justify=col.justify, width=col.width, no_wrap=col.no_wrap,
                             overflow=col.overflow)
        return table

    def _print_lines(self, table: Table, *, drop_first: bool = False, drop_last: bool = False) -> None:
        lines = self.console.render_lines(table, self.console.options, pad=False)
        for line in lines[1 if drop_first else 0:len(lines) - 1 if drop_last else None]:
            self.console.print(Segments([*line, Segment.line()]), end="")

    def row(self, result: BenchResult) -> None:
        """Print ``result`` as the table's next row (the edge lines of its one-row table left out)."""
        if not self.started:
            return
        row = _bench_row(result, self.columns)
        cells = [c.text(row) for c in self._shown]
        with _whole():
            self.clear()
            if self._stack:
                print_lines(self.console, _stacked(self._shown, _cells(self._shown, [cells])[1], set(),
                                                   self.console.width))
            else:
                table = self._copy(header=False)
                table.add_row(*cells)
                self._print_lines(table, drop_first=True, drop_last=True)
            self.printed.append(result)

    def finish(self, results: tuple[BenchResult, ...]) -> None:
        """The rows not printed yet (a Ctrl-C between a result and its row), the table's last edge, its notes."""
        self.clear()
        if not self.started:
            return
        for result in results[len(self.printed):]:
            self.row(result)
        rows = tuple(_bench_row(r, self.columns) for r in results)
        with _whole():
            if not self._stack:
                self.console.print()
            for note in _bench_notes(rows, self.show_peak):
                print_wrapped(self.console, note)
            if self.hidden:
                print_wrapped(self.console, hidden_note(self.hidden, self.console.width))


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
    """``bench --json``: the run's results, as ``--save`` writes them, under "results"; "interrupted": Ctrl-C
    stopped the run, and they are the cases that finished."""
    from gpuwise.bench.results import to_dicts

    return {"interrupted": report.interrupted, "results": to_dicts(list(report.results))}


def comparison_json(comparison: BenchComparison) -> dict[str, Any]:
    """``bench --compare A --compare B --json``: the two runs' names and their common cases, under "pairs"."""
    return {"a": comparison.names[0], "b": comparison.names[1],
            "pairs": [{"op": a.op, "dtype": a.dtype, "shape": a.shape, "backend": a.backend,
                       "a_median_s": a.median_s, "b_median_s": b.median_s, "speedup": ratio}
                      for a, b, ratio in comparison.pairs]}
