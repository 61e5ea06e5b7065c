"""The rules of the step's own time: outliers and periodic stalls, and where the time went.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).
"""

from __future__ import annotations

from gpuwise.monitor.window import Earlier, Judged, Window


def stalls(view: Window, earlier: Earlier) -> Judged | None:
    return None


__all__ = ["stalls"]
