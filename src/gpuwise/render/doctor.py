"""``gpuwise doctor``: the findings table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.doctor import DoctorReport
from gpuwise.render._common import _STATUS_STYLE, to_jsonable

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    pass


def doctor_json(report: DoctorReport) -> dict[str, Any]:
    """``doctor --json``: every check's finding, in order, under "findings"."""
    return {"findings": [to_jsonable(f) for f in report.findings]}


def render_doctor(report: DoctorReport, console: Console) -> None:
    table = Table(title="gpuwise doctor", show_lines=False, expand=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding", overflow="fold")
    for f in report.findings:
        label, style = _STATUS_STYLE[f.status]
        finding = Text(f.message)
        if f.fix:
            finding.append(f"\nfix: {f.fix}", style="cyan")
        table.add_row(Text(label, style=style), f.check, finding)
    console.print(table)
    fails = sum(f.status == "fail" for f in report.findings)
    warns = sum(f.status == "warn" for f in report.findings)
    verdict = "stack OK" if not fails else "stack has problems: apply the fixes above"
    console.print(f"{fails} failed, {warns} warnings, {len(report.findings) - fails - warns} ok: {verdict}")
