"""Saving and loading benchmark results, and the calibration a run gives."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from gpuwise.bench import saved_run_file
from gpuwise.bench.suite import BenchResult
from gpuwise.errors import GpuwiseError
from gpuwise.files import atomic_path, load_json
from gpuwise.hardware.calibration import Calibration


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def to_dicts(results: list[BenchResult]) -> list[dict]:
    return [{k: _clean(v) for k, v in dataclasses.asdict(r).items()} for r in results]


def save(results: list[BenchResult], path: str | os.PathLike, *, machine: dict, interrupted: bool = False) -> None:
    """The run's results as JSON, written atomically; ``interrupted``: the cases that finished before Ctrl-C."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"gpuwise_bench": 1, "machine": machine, "interrupted": interrupted,
                                   "results": to_dicts(results)}, indent=2))


def load(path: str | os.PathLike) -> tuple[dict, list[BenchResult]]:
    saved_run_file(path)
    try:
        data = load_json(Path(path).read_text())
        rows = data["results"]
        names = {f.name for f in dataclasses.fields(BenchResult)}
        results = [BenchResult(**{k: (math.nan if v is None and k.endswith("_s") else v)
                                  for k, v in row.items() if k in names}) for row in rows]
    except FileNotFoundError:
        raise GpuwiseError(f"no such file: {path}", "pass a file written by 'gpuwise bench --save FILE'") from None
    except IsADirectoryError:
        raise GpuwiseError(f"{path} is a folder", "pass a file written by 'gpuwise bench --save FILE'") from None
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError, UnicodeDecodeError) as exc:
        raise GpuwiseError(f"{path} is not a gpuwise bench file ({type(exc).__name__})",
                           "pass a file written by 'gpuwise bench --save FILE'") from None
    return data.get("machine", {}), results


def calibration_from_results(device: str, results: list[BenchResult]) -> Calibration:
    """The best GEMM rate per element type and the best copy bandwidth of a run, for ``device`` (a catalog key)."""
    tflops: dict[str, float] = {}
    for r in results:
        if r.op == "gemm" and r.tflops:
            tflops[r.dtype] = max(tflops.get(r.dtype, 0.0), r.tflops)
    copies = [r.gbps for r in results if r.op == "copy" and r.gbps]
    return Calibration(device=device, tflops=tflops, gbps=max(copies) if copies else None)
