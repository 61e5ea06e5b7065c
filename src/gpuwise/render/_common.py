"""What every renderer shares: number formats and the JSON view of dataclasses."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from gpuwise.hardware.catalog import Accelerator

_STATUS_STYLE = {"ok": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red")}


def _num(value: float | None, fmt: str = "g") -> str:
    return "-" if value is None else format(value, fmt)


def _short(value: float | None) -> str:
    """A rate or bandwidth for a narrow column: whole numbers from 100 up, else 3 digits."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain JSON-ready values. JSON has no Infinity or NaN (json.dumps writes
    them, and strict readers refuse them): such a figure is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Accelerator):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(data: Any) -> None:
    print(json.dumps(to_jsonable(data), indent=2))


def _count(n: int) -> str:
    """Parameters as people say them: 124.4 M, 6.74 B."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.4g} M" if n >= 1e6 else f"{n:,}"


def _seconds(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _seconds3(s: float | None) -> str:
    """Three significant figures, for a narrow column: 95.1 µs, 604 ms, 1.23 s, 4210 s."""
    if s is None or s != s:
        return "-"
    s = float(f"{s:.3g}")  # rounded before the unit is chosen: 0.9996 s is 1 s, never "1e+03 ms"
    if s >= 100:
        return f"{s:.0f} s"
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def step_parts(phases: dict[str, float] | None, families: dict[str, float] | None) -> str:
    """A modelled step's time by phase and its largest op families, for one line under a table: "forward 12.1 ms,
    backward 24.0 ms, optimizer 1.2 ms, communication 3.0 ms; matmul 71%, elementwise 9%, ..." (zero phases left
    out; families over 3% of the kernels' time, "launch" the time waiting on the CPU)."""
    if not phases:
        return ""
    text = ", ".join(f"{name} {_seconds3(v)}" for name, v in phases.items() if v > 0)
    total = sum((families or {}).values())
    if total > 0:
        big = sorted(((v, f) for f, v in (families or {}).items() if v / total >= 0.03), reverse=True)
        text += "; " + ", ".join(f"{f} {100 * v / total:.0f}%" for v, f in big)
    return text
