"""``gpuwise bench`` as a library call: the options, checked before anything runs; the run on the device the
machine resolves; what it stored; and the comparison of two saved runs.

>>> options = BenchOptions(quick=True, ops=("gemm",), device="cpu")
>>> report = run_bench(options, local_machine(os.environ))  # doctest: +SKIP
>>> report.results[0].op, report.catalog                     # doctest: +SKIP
('gemm', None)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwise.bench import DTYPES, OPS, saved_run_file
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.device import resolve_device

if TYPE_CHECKING:  # the suite and its results load torch: imported where they run, after the options are checked
    from gpuwise.bench.suite import BenchResult, Case
    from gpuwise.hardware.calibration import Calibration
    from gpuwise.hardware.catalog import Accelerator
    from gpuwise.hardware.detect import LocalMachine

CPU_DTYPES = ("fp32", "bf16")  # GEMM element types timed on a CPU unless --dtype says otherwise (GPUs: all)


def _check_choices(items: tuple[str, ...] | None, allowed: tuple[str, ...], flag: str) -> None:
    if items is None:
        return
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise GpuwiseError(f"{flag} {','.join(items)!r}: {', '.join(bad) or 'empty'} not one of {', '.join(allowed)}",
                           f"pass a comma-separated list, e.g. {flag} {allowed[0]},{allowed[1]}")


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What ``gpuwise bench`` was asked for; every combination that cannot run is refused here.

    ``ops`` and ``dtypes`` None mean all ops, and all GEMM element types on a GPU (fp32 and bf16 on a CPU).
    ``compare`` holds one saved run (compared with this run) or two (compared with each other, nothing runs).
    """

    quick: bool = False
    ops: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    device: str | None = None  # None: the machine's default device
    save: str | None = None  # write the results to this JSON file
    plot: str | None = None  # a roofline will be drawn here: checked to be writable before the run
    compare: tuple[str, ...] = ()
    calibrate: bool = False  # store the GEMM and copy rates for later plans of this device
    case_limit: float | None = None  # seconds one case may take (0: no limit); None: --quick's or the full suite's

    def __post_init__(self) -> None:
        if len(self.compare) > 2:
            raise GpuwiseError("--compare takes one file (against this run) or two",
                               "pass --compare A.json [--compare B.json]")
        if len(self.compare) == 2:
            extra = [f for f, v in (("--save", self.save), ("--plot", self.plot), ("--calibrate", self.calibrate),
                                    ("--quick", self.quick), ("--ops", self.ops), ("--dtype", self.dtypes),
                                    ("--device", self.device), ("--case-limit", self.case_limit))
                     if v is not None and v is not False]
            if extra:
                raise GpuwiseError(f"two --compare files run nothing, so {extra[0]} has nothing to act on",
                                   f"drop {extra[0]}, or compare one file against a new run")
        for path in self.compare:  # before the machine is probed and torch loads (load() says the same)
            saved_run_file(path)
        if self.case_limit is not None and not (isinstance(self.case_limit, (int, float))
                                                and 0 <= self.case_limit < float("inf")):
            raise GpuwiseError(f"--case-limit {self.case_limit}: not a number of seconds, 0 or more",
                               "pass e.g. --case-limit 60 (0: no limit)")
        _check_choices(self.ops, OPS, "--ops")
        _check_choices(self.dtypes, DTYPES, "--dtype")
        if self.calibrate and not {"gemm", "copy"} <= set(self.ops or OPS):
            raise GpuwiseError("--calibrate stores GEMM and copy rates", "include gemm,copy in --ops (or drop --ops)")

    @property
    def runs(self) -> bool:
        """False when two saved runs are compared and nothing is timed."""
        return len(self.compare) < 2


@dataclass(frozen=True, kw_only=True)
class BenchStart:
    """What a run is about to time, for output that shows each case as it finishes: the device's label, whether
    the rows will have a share of the catalog's peak and a CPU speed-up, and the cases planned (with the smaller
    size each may run at instead)."""

    label: str
    peak: bool
    vs_cpu: bool
    cases: tuple[Case, ...]


@dataclass(frozen=True, kw_only=True)
class BenchComparison:
    """Results of the same op, dtype, shape and backend in two runs: (a, b, a's median over b's)."""

    names: tuple[str, str]  # what to call run a and run b
    pairs: tuple[tuple[BenchResult, BenchResult, float], ...]


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    """One ``gpuwise bench`` run: the results on ``device``, and what was done with them."""

    device: str  # torch's name, "cuda:1"
    label: str  # "cuda:1 (NVIDIA A100-SXM4-80GB), torch 2.13.0"
    row: Accelerator | None  # the device's catalog row: pct_of_peak and the roofline's ceilings come from it
    quick: bool
    results: tuple[BenchResult, ...]
    comparison: BenchComparison | None = None  # against the one --compare file
    calibration: Calibration | None = None  # stored, with --calibrate on a catalog device
    calibration_path: Path | None = None  # where it was stored
    calibration_skipped: str | None = None  # why --calibrate stored nothing
    interrupted: bool = False  # Ctrl-C (or SIGTERM, SIGHUP) stopped the run: ``results`` are the cases that finished
    planned: int = 0  # how many cases were to run
    saved: Path | None = None  # where --save wrote the results

    @property
    def catalog(self) -> str | None:
        """The catalog key of the device, as saved files record it."""
        return self.row.key if self.row else None


def compare_runs(a_path: str | os.PathLike, b_path: str | os.PathLike) -> BenchComparison:
    """Two files from ``gpuwise bench --save`` (this version's or an earlier one's), compared case by case."""
    from gpuwise.bench import results as store
    from gpuwise.bench.suite import compare

    (_, a), (_, b) = store.load(a_path), store.load(b_path)
    return BenchComparison(names=(str(a_path), str(b_path)), pairs=tuple(compare(a, b)))


def _check_writable(path: str) -> None:
    folder = Path(path).parent
    if Path(path).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise GpuwiseError(f"cannot write {path}", "pick a file in a folder you can write to")


def run_bench(options: BenchOptions, machine: LocalMachine, *, calibration_dir: Path | None = None,
              progress: Callable[[str], None] | None = None, on_start: Callable[[BenchStart], None] | None = None,
              on_result: Callable[[BenchResult], None] | None = None) -> BenchReport:
    """Run the suite on ``options.device`` of ``machine``, save and calibrate as asked, compare with a baseline.

    The device and its catalog row come from ``resolve_device`` alone. ``calibration_dir`` is where
    ``--calibrate`` stores its rates (``hardware.calibration.cache_dir``). Two ``compare`` files: use
    ``compare_runs``. ``on_start`` hears what will run, ``on_result`` each result as its case finishes. Ctrl-C
    returns the report of the cases that finished (``interrupted``): ``--save`` keeps them, ``--calibrate`` stores
    nothing (rates of part of a run would undercut the device in every later plan).
    """
    if not options.runs:
        raise ValueError("two --compare files run nothing: compare them with compare_runs")
    for path in (options.save, options.plot):  # fail before a run of minutes, not after it
        if path is not None:
            _check_writable(path)
    from gpuwise.bench import results as store
    from gpuwise.bench.pace import limit_for
    from gpuwise.bench.suite import Interrupted, compare, run_suite

    baseline = store.load(options.compare[0])[1] if options.compare else None
    target = resolve_device(options.device, machine)  # checked before anything runs
    import torch

    label = f"{target.name} ({target.model}), torch {torch.__version__}"
    ops = options.ops or OPS
    dtypes = options.dtypes or (DTYPES if target.gpu else CPU_DTYPES)
    limit_s, budget_s = limit_for(options.quick, options.case_limit)
    planned = 0

    def start(cases: list[Case]) -> None:
        nonlocal planned
        planned = len(cases)
        if on_start:
            on_start(BenchStart(label=label, peak=target.row is not None, vs_cpu=target.name != "cpu",
                                cases=tuple(cases)))

    interrupted = False
    try:
        results = run_suite(target.name, quick=options.quick, ops=ops, dtypes=dtypes, accelerator=target.row,
                            bf16=target.bf16, progress=progress, limit_s=limit_s, budget_s=budget_s, on_start=start,
                            on_result=on_result)
    except Interrupted as stop:
        results, interrupted = stop.results, True
    if not results and not interrupted:
        raise GpuwiseError(f"nothing of --ops {','.join(ops)} runs on {target.name}",
                           "h2d needs a CUDA GPU; see 'gpuwise bench --help' for the ops")
    comparison = None
    if baseline is not None:
        comparison = BenchComparison(names=(options.compare[0], "this run"), pairs=tuple(compare(baseline, results)))
    saved = None
    if options.save is not None and results:
        store.save(results, options.save, machine={"device": label, "catalog": target.row.key if target.row else None},
                   interrupted=interrupted)
        saved = Path(options.save)
    calibration = where = skipped = None
    if options.calibrate and target.row is None:
        skipped = f"plans are for catalog GPUs and {target.name} matches none"
    elif options.calibrate and interrupted:
        skipped = "the run was interrupted, and part of a run would undercut this GPU's rates in every later plan"
    elif options.calibrate:
        from gpuwise.hardware.calibration import save_calibration

        if calibration_dir is None:
            raise ValueError("--calibrate needs calibration_dir, the folder to store the rates in")
        calibration = store.calibration_from_results(target.row.key, results)
        where = save_calibration(calibration, calibration_dir)
    return BenchReport(device=target.name, label=label, row=target.row, quick=options.quick, results=tuple(results),
                       comparison=comparison, calibration=calibration, calibration_path=where,
                       calibration_skipped=skipped, interrupted=interrupted, planned=planned, saved=saved)
