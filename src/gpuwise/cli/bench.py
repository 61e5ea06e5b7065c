"""``gpuwise bench``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated

import typer

from gpuwise.cli._app import DeviceOption, FormatOption, JsonFlag, app, check_plot, output_format
from gpuwise.errors import GpuwiseError


@contextlib.contextmanager
def _stops_like_ctrl_c() -> Iterator[list[int]]:
    """SIGTERM and SIGHUP (a scheduler's stop, a closed ssh session) end the run as Ctrl-C does, keeping what was
    measured, instead of killing it with nothing said; yields the signals received (none: Ctrl-C, if any)."""
    got: list[int] = []

    def stop(signum, frame):
        got.append(signum)
        raise KeyboardInterrupt

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        for name in ("SIGTERM", "SIGHUP"):  # by name: SIGHUP does not exist on Windows
            if hasattr(signal, name):
                previous[getattr(signal, name)] = signal.signal(getattr(signal, name), stop)
    try:
        yield got
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted_line(report, signum: int, *, table: bool, plot: bool) -> str:
    """ "interrupted after 5 of 12 cases: the 5 rows above are complete measurements, saved in run.json" """
    n = len(report.results)
    why = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    if n == 0:
        return f"interrupted{why} before any case finished: nothing was measured"
    if n == 1:
        what = f"the {'row above' if table else 'result'} is a complete measurement"
    else:
        what = f"the {n} {'rows above' if table else 'results'} are complete measurements"
    kept = f", saved in {report.saved}" if report.saved else ""
    return f"interrupted{why} after {n} of {report.planned} cases: {what}{kept}{'; no roofline drawn' if plot else ''}"


def _items(value: str | None) -> tuple[str, ...] | None:
    """``"gemm, Copy"`` -> ("gemm", "copy"); the library checks the names."""
    return None if value is None else tuple(v.strip().lower() for v in value.split(",") if v.strip())


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes, few repeats, at most 5 s a case (10-40 s on "
                                                        "a 2-core CPU).")] = False,
    ops: Annotated[str | None, typer.Option(help="Comma-separated: gemm, copy, h2d, attention, conv2d, block, "
                                                 "train-step (default: all).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="GEMM dtypes, comma-separated: fp32, tf32, fp16, "
                                                             "bf16, fp8 (default: fp32,bf16; all on a GPU).")] = None,
    device: DeviceOption = None,
    plot: Annotated[str | None, typer.Option(help="Draw a roofline to this PNG or SVG file.")] = None,
    save: Annotated[str | None, typer.Option(help="Write the results to this JSON file.")] = None,
    compare: Annotated[list[str] | None, typer.Option(help="A file from --save: compare this run with it; "
                                                           "give it twice to compare two files.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Store the measured GEMM and copy rates for "
                                                                "later plans of this device.")] = False,
    case_limit: Annotated[float | None, typer.Option(
        "--case-limit", help="Seconds one case may take, warm-up and repeats together: a size this run's own "
                             "measurements say would take longer runs smaller or not at all, and says why (a CPU "
                             "that emulates bf16) [5 with --quick, else 30; 0: no limit].")] = None,
    json_out: JsonFlag = False,
    output: FormatOption = None,
) -> None:
    """Time GEMMs, copies, attention backends, conv2d, a transformer block and a training step, honestly.

    Examples: gpuwise bench --quick; gpuwise bench --ops gemm --dtype bf16,fp8 --plot roofline.png;
    gpuwise bench --save h200.json; gpuwise bench --compare h200.json --compare a100.json;
    gpuwise bench --quick --format csv > bench.csv
    """
    fmt = output_format(output, json_out)
    check_plot(plot)
    from gpuwise import render
    from gpuwise.bench.run import BenchOptions, compare_runs, run_bench  # without torch: the options first

    options = BenchOptions(quick=quick, ops=_items(ops), dtypes=_items(dtype), device=device, save=save, plot=plot,
                           compare=tuple(compare or ()), calibrate=calibrate, case_limit=case_limit)
    if not options.runs:
        render.emit(compare_runs(*options.compare), format=fmt)
        return
    if options.compare and fmt != "table":
        flag = "--json" if json_out else f"--format {fmt}"
        raise GpuwiseError(f"{flag} prints this run's results; a comparison needs two saved runs",
                           f"run with --save new.json, then: gpuwise bench --compare {options.compare[0]} "
                           "--compare new.json")
    from gpuwise.hardware.calibration import data_dir
    from gpuwise.hardware.device import local_machine
    from gpuwise.render.bench import BenchStream, render_comparison

    machine = local_machine(os.environ)
    console = render.terminal()
    # a table shows each row as its case finishes; json, csv and md print once, at the end (after Ctrl-C too)
    stream = BenchStream(console, status=sys.stderr if render.show_progress(fmt) else None) if fmt == "table" else None
    with _stops_like_ctrl_c() as signals:
        try:
            if stream:
                stream.status("bench: loading torch")
            report = run_bench(options, machine, calibration_dir=data_dir(os.environ),
                               progress=stream.status if stream else None, on_start=stream.start if stream else None,
                               on_result=stream.row if stream else None)
        except KeyboardInterrupt:
            if not signals:
                raise  # Ctrl-C before the first case: "error: interrupted", 130
            print(f"error: interrupted ({signal.Signals(signals[-1]).name}) before any case ran", file=sys.stderr)
            raise typer.Exit(128 + signals[-1]) from None
        finally:
            if stream:
                stream.clear()
        if stream:
            stream.finish(report.results)
            if report.comparison is not None:
                render_comparison(report.comparison, console)
        else:
            render.emit(report, format=fmt)
    if report.calibration_skipped:
        print(f"calibration not stored: {report.calibration_skipped}", file=sys.stderr)
    elif report.calibration is not None and fmt == "table":
        quick_note = " (--quick sizes: below what the full suite reaches)" if report.quick else ""
        print(f"calibration for {report.calibration.device} stored in {report.calibration_path}{quick_note}: "
              "plans for it use these rates")
    if report.interrupted:
        signum = signals[-1] if signals else signal.SIGINT
        print(_interrupted_line(report, signum, table=stream is not None, plot=plot is not None), file=sys.stderr)
        raise typer.Exit(128 + signum)  # 130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP: as a shell says
    if plot is not None:
        from gpuwise.plot import plot_bench

        plot_bench(report, plot)
        if fmt == "table":
            print(f"roofline drawn to {plot}")
