"""``gpuwise doctor``: the findings table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.doctor import DoctorReport
from gpuwise.render._common import _STATUS_STYLE, print_fields, print_wrapped, to_jsonable

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    pass


def doctor_json(report: DoctorReport) -> dict[str, Any]:
    """``doctor --json``: every check's finding, in order, under "findings"."""
    return {"findings": [to_jsonable(f) for f in report.findings]}


def render_doctor(report: DoctorReport, console: Console) -> None:
    """One line a check: its status, its name, what it found and the fix, wrapped at spaces beside them (under them
    where the terminal is narrow), so a version, a path or a URL is never split."""
    rows: list[tuple[Text, Text]] = []
    for f in report.findings:
        label, style = _STATUS_STYLE[f.status]
        finding = Text(f.message)
        if f.fix:
            finding.append(f"\nfix: {f.fix}", style="cyan")
        rows.append((Text(f"{label:<4}", style=style) + Text(f"  {f.check}", style="bold"), finding))
    print_fields(console, rows, title=Text("gpuwise doctor", style="bold"))
    fails = sum(f.status == "fail" for f in report.findings)
    warns = sum(f.status == "warn" for f in report.findings)
    verdict = "stack OK" if not fails else "stack has problems: apply the fixes above"
    print_wrapped(console, f"{fails} failed, {warns} warnings, {len(report.findings) - fails - warns} ok: {verdict}")
