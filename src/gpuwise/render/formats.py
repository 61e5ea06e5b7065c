"""``--format table|json|csv|md``: a result as rows (a ``Sheet``), written as a table that fits the terminal, as csv
for programs and spreadsheets, or as a GitHub Markdown table for a README or an issue.

A renderer gives its result's rows once (``catalog_sheet``, ``report_sheet``, ...); each format writes them. JSON
stays each command's own view (``emit`` with ``json``), with ``schema_version`` first.
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any

from rich.text import Text

from gpuwise.errors import GpuwiseError
from gpuwise.render._common import Sheet

FORMATS = ("table", "json", "csv", "md")


def _raw(value: Any) -> Any:
    """A csv cell: numbers as Python writes them (repr: they read back exactly), none or not finite as empty."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ";".join(str(v) for v in value)
    return value


def to_csv(sheet: Sheet) -> str:
    """Every column, header once, one line a row; csv.DictReader reads it back, numbers with ``float``."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[c.key for c in sheet.columns], lineterminator="\n")
    writer.writeheader()
    for row in sheet.rows:
        writer.writerow({c.key: _raw(row.get(c.key)) for c in sheet.columns})
    return out.getvalue()


def _md_cell(cell: str | Text) -> str:
    text = cell.plain if isinstance(cell, Text) else str(cell)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def to_markdown(sheet: Sheet) -> str:
    """A GitHub table of the columns a terminal table shows, every one of them, numbers right-aligned; the notes
    follow as a paragraph."""
    columns = sheet.shown
    lines = ["| " + " | ".join(_md_cell(c.title) for c in columns) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in columns) + "|"]
    lines += ["| " + " | ".join(_md_cell(c.text(row)) for c in columns) + " |" for row in sheet.rows]
    if sheet.notes:
        lines += ["", *(_md_cell(n) for n in sheet.notes)]
    return "\n".join(lines) + "\n"


def write(sheet: Sheet, output_format: str) -> None:
    """Print rows as csv or Markdown on stdout."""
    print(to_csv(sheet) if output_format == "csv" else to_markdown(sheet), end="")


def check_format(output_format: str | None, json_flag: bool = False) -> str:
    """The output format from ``--format`` and ``--json`` (its alias), checked before any work: "table" when
    neither is given.

    e.g. ``check_format("csv")`` -> "csv"; ``check_format(None, json_flag=True)`` -> "json"
    """
    if output_format is None:
        return "json" if json_flag else "table"
    fmt = output_format.strip().lower()
    if fmt == "markdown":
        fmt = "md"
    if fmt not in FORMATS:
        import difflib

        close = difflib.get_close_matches(fmt, FORMATS, n=1)
        raise GpuwiseError(f"--format {output_format!r} is not one of {', '.join(FORMATS)}",
                           f"pass --format {close[0] if close else 'csv'}")
    if json_flag and fmt != "json":
        raise GpuwiseError(f"--json and --format {fmt} ask for two outputs", f"pass one: --format {fmt} or --json")
    return fmt
