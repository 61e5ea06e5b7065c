"""The monitor's diagnosis for people (short lines) and for ``--json`` (a plain dict), shared by ``gpuwise watch``
and ``gpuwise train``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gpuwise.monitor.window import ms, rounded
from gpuwise.units import human_bytes

if TYPE_CHECKING:
    from gpuwise.monitor.verdict import Diagnosis, Verdict


def jsonable(x: Any) -> Any:
    """Dicts, lists and plain scalars as json.dumps takes them: a non-finite float as None, anything else as str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _verdict_json(f: Verdict) -> dict[str, Any]:
    return {"bottleneck": f.bottleneck, "share": rounded(f.share), "summary": f.summary, "evidence": f.evidence,
            "fix": list(f.fix), "expected": f.expected, "source": f.source, "change": jsonable(f.change)}


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """A plain dict json.dumps takes: bottleneck, summary, evidence, fix, expected, findings, observed_vs_planned,
    note, steps."""
    return jsonable({"bottleneck": d.bottleneck, "summary": d.summary, "evidence": d.evidence, "fix": list(d.fix),
                      "expected": d.expected, "findings": [_verdict_json(f) for f in d.findings],
                      "observed_vs_planned": d.observed_vs_planned, "note": d.note, "steps": d.steps})


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
