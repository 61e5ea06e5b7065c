"""The monitor's diagnosis for people (short lines), shared by ``gpuwise watch`` and ``gpuwise train``; the plain dict
for ``--json`` is ``monitor.report.diagnosis_json`` (the monitor's own data), used from here too."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuwise.monitor.report import diagnosis_json, jsonable
from gpuwise.monitor.window import ms
from gpuwise.units import human_bytes

if TYPE_CHECKING:
    from gpuwise.monitor.verdict import Diagnosis


def render_lines(d: Diagnosis) -> list[str]:
    """Short lines for people: the bottleneck, the fix, the expected effect, the other findings, the plan, the note."""
    lines = [f"bottleneck: {d.bottleneck}" + (f" ({d.summary})" if d.summary else "")]
    for i, fix in enumerate(d.fix):
        lines.append(("fix: " if i == 0 else "     ") + fix)
    if d.expected:
        lines.append(f"expected: {d.expected}")
    for f in d.findings[1:]:
        lines.append(f"also: {f.bottleneck}" + (f" ({f.summary})" if f.summary else ""))
    ovp = d.observed_vs_planned
    if "step_s" in ovp:
        s = ovp["step_s"]
        lines.append(f"step: {ms(s['observed'])} observed vs {ms(s['planned'])} planned ({s['ratio']:.2f}×)")
    if "peak_bytes" in ovp:
        p = ovp["peak_bytes"]
        lines.append(f"peak memory: {human_bytes(p['observed'])} observed vs {human_bytes(p['planned'])} planned "
                     f"({p['ratio']:.2f}×)")
    if d.note:
        lines.append(f"note: {d.note}")
    return lines


__all__ = ["diagnosis_json", "jsonable", "render_lines"]
