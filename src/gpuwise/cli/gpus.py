"""``gpuwise gpus``."""

from __future__ import annotations

import os
import re
from typing import Annotated

import typer

from gpuwise.cli._app import FormatOption, JsonFlag, app, output_format
from gpuwise.errors import GpuwiseError


@app.command()
def gpus(
    name: Annotated[str | None, typer.Argument(help="Show one accelerator, e.g. h100, 4090, mi300x.")] = None,
    segment: Annotated[str | None, typer.Option(help="consumer, workstation, datacenter or edge.")] = None,
    vendor: Annotated[str | None, typer.Option(help="NVIDIA, AMD, Intel, Huawei, Google or Apple.")] = None,
    min_memory: Annotated[str | None, typer.Option(
        help="At least this much memory, e.g. 24GB (10^9 bytes) or 24GiB (2^30 bytes); "
             "vendors' '24GB' cards hold 24 GiB.")] = None,
    local: Annotated[bool, typer.Option("--local", help="Show this machine's GPUs and CPU instead.")] = False,
    json_out: JsonFlag = False,
    output: FormatOption = None,
) -> None:
    """List the hardware catalog, show one accelerator with its sources, or this machine.

    Examples: gpuwise gpus; gpuwise gpus h100; gpuwise gpus --segment consumer --min-memory 24GB;
    gpuwise gpus --local --json; gpuwise gpus --format csv > catalog.csv; gpuwise gpus --segment consumer --format md
    """
    fmt = output_format(output, json_out)
    from gpuwise import render
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.units import parse_bytes

    filters = segment is not None or vendor is not None or min_memory is not None
    if local:
        if name is not None or filters:
            raise GpuwiseError("--local shows this machine and takes no name or filters",
                               hint="run 'gpuwise gpus --local' alone")
        from gpuwise.hardware.device import local_machine

        render.emit(local_machine(os.environ), format=fmt)
        return
    catalog = load_catalog()
    if name is not None:
        if filters:
            raise GpuwiseError("a NAME shows one accelerator and takes no filters",
                               hint=f"run 'gpuwise gpus {name}' alone, or filters without a name")
        row = catalog.get(name)
        others = catalog.variants(name)
        if len(others) > 1 and fmt == "table":  # "a100": the 40 GB SXM row is one of three; say which, name the rest
            # at the table's width, broken at spaces only: a key is never split at its hyphen
            render.print_wrapped(render.terminal(), f"note: {name!r} matches {', '.join(others)}; showing {row.key} "
                                 "(name one for the others)", indent=2)
        render.emit(row, format=fmt)
        return
    if min_memory is not None and re.fullmatch(r"\s*[\d.]+\s*", min_memory):
        raise GpuwiseError(f"--min-memory {min_memory} has no unit", f"pass --min-memory {min_memory.strip()}GB "
                           f"(10^9 bytes) or {min_memory.strip()}GiB (2^30 bytes)")
    rows = catalog.filter(segment=segment, vendor=vendor,
                          min_memory_bytes=parse_bytes(min_memory) if min_memory is not None else None)
    render.emit(render.CatalogRows(tuple(rows)), format=fmt)
