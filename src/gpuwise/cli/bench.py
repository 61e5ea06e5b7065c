"""``gpuwise bench``."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from gpuwise.cli._app import DeviceOption, FormatOption, JsonFlag, app, check_plot, output_format
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
    plot: Annotated[str | None, typer.Option(help="Draw a roofline to this PNG or SVG file.")] = None,
    save: Annotated[str | None, typer.Option(help="Write the results to this JSON file.")] = None,
    compare: Annotated[list[str] | None, typer.Option(help="A file from --save: compare this run with it; "
                                                           "give it twice to compare two files.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Store the measured GEMM and copy rates for "
                                                                "later plans of this device.")] = False,
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
                           compare=tuple(compare or ()), calibrate=calibrate)
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

    machine = local_machine(os.environ)
    enabled = render.show_progress(fmt)
    with render.progress("bench", enabled=enabled) as say:
        report = run_bench(options, machine, calibration_dir=data_dir(os.environ), progress=say if enabled else None)
    render.emit(report, format=fmt)
    if report.calibration_skipped:
        print(f"calibration not stored: {report.calibration_skipped}", file=sys.stderr)
    elif report.calibration is not None and fmt == "table":
        quick_note = " (--quick sizes: below what the full suite reaches)" if report.quick else ""
        print(f"calibration for {report.calibration.device} stored in {report.calibration_path}{quick_note}: "
              "plans for it use these rates")
    if plot is not None:
        from gpuwise.plot import plot_bench

        plot_bench(report, plot)
        if fmt == "table":
            print(f"roofline drawn to {plot}")
