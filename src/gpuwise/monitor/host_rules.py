"""The rules of the host's cores: threads and processes against the cores, and Python overhead.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).
"""

from __future__ import annotations

from gpuwise.monitor.window import Earlier, Judged, Window


def oversubscribed(view: Window, earlier: Earlier) -> Judged | None:
    return None


__all__ = ["oversubscribed"]
