"""``gpuwise bench``."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from gpuwise.cli._app import DeviceOption, JsonFlag, app
from gpuwise.errors import GpuwiseError


def _csv(value: str | None, allowed: tuple[str, ...], flag: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(v.strip().lower() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise GpuwiseError(f"{flag} {value!r}: {', '.join(bad) or 'empty'} not one of {', '.join(allowed)}",
                           f"pass a comma-separated list, e.g. {flag} {allowed[0]},{allowed[1]}")
    return items


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes, few repeats (about a minute on a CPU).")] = False,
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
    from gpuwise import render
    from gpuwise.bench import results as store

    if plot is not None and not plot.lower().endswith(".png"):
        raise GpuwiseError(f"--plot {plot}: the picture is a PNG", f"pass --plot {plot.rsplit('.', 1)[0]}.png")
    compare = compare or []
    if len(compare) > 2:
        raise GpuwiseError("--compare takes one file (against this run) or two",
                           "pass --compare A.json [--compare B.json]")
    if len(compare) == 2:
        extra = [f for f, v in (("--save", save), ("--plot", plot), ("--calibrate", calibrate), ("--quick", quick),
                                ("--ops", ops), ("--dtype", dtype), ("--device", device)) if v]
        if extra:
            raise GpuwiseError(f"two --compare files run nothing, so {extra[0]} has nothing to act on",
                               f"drop {extra[0]}, or compare one file against a new run")
        (_, a), (_, b) = store.load(compare[0]), store.load(compare[1])
        from gpuwise.bench.suite import compare as pair

        pairs = pair(a, b)
        if json_out:
            render.print_json([{"op": x.op, "dtype": x.dtype, "shape": x.shape, "backend": x.backend,
                                "a_median_s": x.median_s, "b_median_s": y.median_s, "speedup": r}
                               for x, y, r in pairs])
        else:
            render.render_compare(pairs, (compare[0], compare[1]), Console(highlight=False, soft_wrap=False))
        return
    if compare and json_out:
        raise GpuwiseError("--json prints this run's results; a comparison needs two saved runs",
                           f"run with --save new.json, then: gpuwise bench --compare {compare[0]} --compare new.json")
    baseline = store.load(compare[0])[1] if compare else None
    for target in (save, plot):  # fail before a run of minutes, not after it
        if target is not None:
            from pathlib import Path

            folder = Path(target).parent
            if Path(target).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
                raise GpuwiseError(f"cannot write {target}", "pick a file in a folder you can write to")
    import torch

    from gpuwise.bench.suite import DTYPES, OPS, run_suite

    chosen_ops = _csv(ops, OPS, "--ops") or OPS
    if calibrate and not {"gemm", "copy"} <= set(chosen_ops):
        raise GpuwiseError("--calibrate stores GEMM and copy rates", "include gemm,copy in --ops (or drop --ops)")
    from gpuwise.hardware.device import local_machine, resolve_device

    target = resolve_device(device, local_machine(os.environ))  # checked before anything runs
    name, accelerator = target.name, target.row
    label = f"{name} ({target.model}), torch {torch.__version__}"
    chosen_dtypes = _csv(dtype, DTYPES, "--dtype") or (DTYPES if target.gpu else ("fp32", "bf16"))

    progress = None
    if sys.stderr.isatty() and not json_out:
        from rich.progress import Progress

        bar = Progress(transient=True, console=Console(stderr=True))
        task = bar.add_task("bench", total=None)
        bar.start()
        progress = lambda text: bar.update(task, description=text)  # noqa: E731
    try:
        results = run_suite(name, quick=quick, ops=chosen_ops, dtypes=chosen_dtypes, accelerator=accelerator,
                            progress=progress)
    finally:
        if progress is not None:
            bar.stop()
    if not results:
        raise GpuwiseError(f"nothing of --ops {','.join(chosen_ops)} runs on {name}",
                           "h2d needs a CUDA GPU; see 'gpuwise bench --help' for the ops")
    if json_out:
        render.print_json(store.to_dicts(results))
    else:
        render.render_bench(results, label, Console(highlight=False, soft_wrap=False))
        if baseline is not None:
            from gpuwise.bench.suite import compare as pair

            render.render_compare(pair(baseline, results), (compare[0], "this run"),
                                  Console(highlight=False, soft_wrap=False))
    machine = {"device": label, "catalog": accelerator.key if accelerator else None}
    if save is not None:
        store.save(results, save, machine=machine)
    if calibrate and accelerator is None:
        print(f"calibration not stored: plans are for catalog GPUs and {name} matches none", file=sys.stderr)
    elif calibrate:
        from gpuwise.hardware.calibration import cache_dir, save_calibration

        cal = store.calibration_from_results(accelerator.key, results)
        where = save_calibration(cal, cache_dir(os.environ))
        if not json_out:
            quick_note = " (--quick sizes: below what the full suite reaches)" if quick else ""
            print(f"calibration for {cal.device} stored in {where}{quick_note}: plans for it use these rates")
    if plot is not None:
        from gpuwise.plot import plot_roofline

        dtypes_run = sorted({r.dtype for r in results if r.op == "gemm" and r.tflops})
        if accelerator:  # a compute ceiling per dtype that ran, from the datasheet
            ceilings = {d: accelerator.peak_tflops.get(d) for d in dtypes_run if accelerator.peak_tflops.get(d)}
            peak_gbps = accelerator.memory_bandwidth_gbps
        else:  # no datasheet: the best this run reached
            ceilings = {d: max(r.tflops for r in results if r.op == "gemm" and r.dtype == d and r.tflops)
                        for d in dtypes_run}
            copies = [r.gbps for r in results if r.op == "copy" and r.gbps]
            peak_gbps = max(copies) if copies else None
        source = "catalog" if accelerator else "best measured"
        plot_roofline(results, plot, title=f"{label}: ceilings from the {source}", ceilings=ceilings,
                      peak_gbps=peak_gbps)
        if not json_out:
            print(f"roofline drawn to {plot}")
