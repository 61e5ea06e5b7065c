"""Renderers: library results -> rich tables for people, plain dicts for ``--json``; one file per command.

Every command hands its result to ``emit``, which picks the table or the JSON view by the result's type.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from rich.console import Console

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator
from gpuwise.render._common import (
    SCHEMA_VERSION,
    json_document,
    print_json,
    print_wrapped,
    progress,
    show_progress,
    to_jsonable,
)
from gpuwise.render.bench import (
    comparison_json,
    comparison_sheet,
    render_bench,
    render_compare,
    render_comparison,
    render_report,
    report_json,
    report_sheet,
)
from gpuwise.render.doctor import doctor_json, render_doctor
from gpuwise.render.formats import write
from gpuwise.render.gpus import (
    catalog_json,
    catalog_sheet,
    local_json,
    local_sheet,
    render_accelerator,
    render_catalog,
    render_local,
)
from gpuwise.render.plan import (
    plan_json,
    plan_sheet,
    render_models,
    render_plan,
    render_solution,
    solution_json,
    solution_line,
)
from gpuwise.render.recommend import guide_json, recommend_json, recommend_sheet, render_guide, render_recommend
from gpuwise.render.train import TrainProgress, render_train, train_json
from gpuwise.render.watch import render_watch, watch_json

if TYPE_CHECKING:
    from gpuwise.models import ZooModel


@dataclasses.dataclass(frozen=True)
class CatalogRows:
    """``gpuwise gpus`` with filters: the rows that matched."""

    rows: tuple[Accelerator, ...]


@dataclasses.dataclass(frozen=True)
class ModelList:
    """``gpuwise plan --list-models``."""

    models: tuple[ZooModel, ...]


def _models_json(listing: ModelList) -> dict[str, Any]:
    return {"models": [{"name": m.name, "params": m.published_params, "blocks": m.n_layer, "inputs": m.inputs,
                        "default_seq": m.default_seq, "default_image_size": m.default_image_size, "source": m.source}
                       for m in listing.models]}


def _views() -> dict[str, tuple[Any, Any]]:
    """Result type name -> (table renderer, JSON view). By name: the torch-importing types load on demand."""
    return {
        "DoctorReport": (render_doctor, doctor_json),
        "LocalMachine": (render_local, local_json),
        "Accelerator": (render_accelerator, lambda a: catalog_json([a])),
        "CatalogRows": (lambda c, console: render_catalog(list(c.rows), console), lambda c: catalog_json(c.rows)),
        "ModelList": (lambda m, console: render_models(list(m.models), console), _models_json),
        "MemoryPlan": (render_plan, plan_json),
        "Solution": (render_solution, solution_json),
        "TrainSummary": (render_train, train_json),
        "Recommendation": (render_recommend, recommend_json),
        "Guide": (render_guide, guide_json),
        "BenchReport": (render_report, report_json),
        "BenchComparison": (render_comparison, comparison_json),
        "WatchResult": (render_watch, watch_json),
    }


DEFAULT_WIDTH = 80  # rich's own width when stdout is not a terminal
MIN_WIDTH = 20  # narrower, a table or a line would hold a word a line: the output is laid out at this width


class _Console(Console):
    """rich exits 1 when the pipe it prints into closes; the CLI decides the exit code (141, as cat gets). A
    ``COLUMNS`` that is no width (0, negative, not a number) is taken as unset: rich would print nothing at 0. The
    one place the output's width is decided: ``COLUMNS``, else the terminal's, else 80; never under ``MIN_WIDTH``."""

    def __init__(self, **kwargs: Any) -> None:
        raw = os.environ.get("COLUMNS")
        if raw is not None and "width" not in kwargs:
            try:
                bad = int(raw) <= 0
            except ValueError:
                bad = True
            if bad:
                kwargs["width"] = DEFAULT_WIDTH
        super().__init__(**kwargs)
        if self.width < MIN_WIDTH:
            self.width = MIN_WIDTH

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def terminal(**kwargs: Any) -> Console:
    """The console every command's table and lines print on: stdout unless ``file``, as wide as ``_Console``
    decides, no highlighting, no soft wrapping (the renderers lay out their own lines: render._common.wrap)."""
    return _Console(**{"highlight": False, "soft_wrap": False, **kwargs})


def _sheets() -> dict[str, Any]:
    """Result type name -> its rows (render._common.Sheet), for --format csv and md."""
    return {
        "CatalogRows": lambda c: catalog_sheet(list(c.rows)),
        "Accelerator": lambda a: catalog_sheet([a]),
        "LocalMachine": local_sheet,
        "BenchReport": report_sheet,
        "MemoryPlan": plan_sheet,
        "Recommendation": recommend_sheet,
        "Solution": lambda solution: dataclasses.replace(plan_sheet(solution.plan), notes=(solution_line(solution),)),
        "BenchComparison": comparison_sheet,
    }


def emit(result: Any, *, json: bool = False, format: str = "table", console: Console | None = None) -> None:
    """Print a command's result in ``format`` (formats.FORMATS; ``json`` is ``format="json"``): JSON as one object
    with ``schema_version`` first, csv or Markdown from its rows, else its tables (on stdout unless ``console``)."""
    table, as_json = _views()[type(result).__name__]
    if json or format == "json":
        print_json(json_document(as_json(result)))
    elif format in ("csv", "md"):
        sheet = _sheets().get(type(result).__name__)
        if sheet is None:
            raise GpuwiseError(f"--format {format} is not available for this output yet", "use --format table or json")
        write(sheet(result), format)
    else:
        table(result, console or terminal())


__all__ = ["MIN_WIDTH", "SCHEMA_VERSION", "CatalogRows", "ModelList", "TrainProgress", "emit", "print_json",
           "print_wrapped", "progress", "render_bench", "render_compare", "show_progress", "terminal", "to_jsonable"]
