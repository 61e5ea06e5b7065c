"""``gpuwise bench``."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from gpuwise.cli._app import DeviceOption, JsonFlag, app, check_png
from gpuwise.errors import GpuwiseError


def _items(value: str | None) -> tuple[str, ...] | None:
    """``"gemm, Copy"`` -> ("gemm", "copy"); the library checks the names."""
    return None if value is None else tuple(v.strip().lower() for v in value.split(",") if v.strip())


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes, few repeats (30-60 s on a 2-core CPU: "
                                                        "64 s of CPU time).")] = False,
    ops: Annotated[str | None, typer.Option(help="Comma-separated: gemm, copy, h2d, attention, conv2d, block, "
                                                 "train-step (default: all).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="GEMM dtypes, comma-separated: fp32, tf32, fp16, "
                                                             "bf16, fp8 (default: fp32,bf16; all on a GPU).")] = None,
    device: DeviceOption = None,
    plot: Annotated[str | None, typer.Option(help="Draw a roofline to this PNG file.")] = None,
    save: Annotated[str | None, typer.Option(help="Write the results to this JSON file.")] = None,
    compare: Annotated[list[str] | None, typer.Option(help="A file from --save: compare this run with it; "
                                                           "give it twice to compare two files.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Store the measured GEMM and copy rates for "
                                                                "later plans of this device.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Time GEMMs, copies, attention backends, conv2d, a transformer block and a training step, honestly.

    Examples: gpuwise bench --quick; gpuwise bench --ops gemm --dtype bf16,fp8 --plot roofline.png;
    gpuwise bench --save h200.json; gpuwise bench --compare h200.json --compare a100.json
    """
    check_png(plot)
    from gpuwise import render
    from gpuwise.bench.run import BenchOptions, compare_runs, run_bench  # without torch: the options first

    options = BenchOptions(quick=quick, ops=_items(ops), dtypes=_items(dtype), device=device, save=save, plot=plot,
                           compare=tuple(compare or ()), calibrate=calibrate)
    if not options.runs:
        render.emit(compare_runs(*options.compare), json=json_out)
        return
    if options.compare and json_out:
        raise GpuwiseError("--json prints this run's results; a comparison needs two saved runs",
                           f"run with --save new.json, then: gpuwise bench --compare {options.compare[0]} "
                           "--compare new.json")
    from gpuwise.hardware.calibration import cache_dir
    from gpuwise.hardware.device import local_machine

    machine = local_machine(os.environ)
    progress = None
    if sys.stderr.isatty() and not json_out:
        from rich.progress import Progress

        bar = Progress(transient=True, console=Console(stderr=True))
        task = bar.add_task("bench", total=None)
        bar.start()
        progress = lambda text: bar.update(task, description=text)  # noqa: E731
    try:
        report = run_bench(options, machine, calibration_dir=cache_dir(os.environ), progress=progress)
    finally:
        if progress is not None:
            bar.stop()
    render.emit(report, json=json_out)
    if report.calibration_skipped:
        print(f"calibration not stored: {report.calibration_skipped}", file=sys.stderr)
    elif report.calibration is not None and not json_out:
        quick_note = " (--quick sizes: below what the full suite reaches)" if report.quick else ""
        print(f"calibration for {report.calibration.device} stored in {report.calibration_path}{quick_note}: "
              "plans for it use these rates")
    if plot is not None:
        from gpuwise.plot import plot_bench

        plot_bench(report, plot)
        if not json_out:
            print(f"roofline drawn to {plot}")
