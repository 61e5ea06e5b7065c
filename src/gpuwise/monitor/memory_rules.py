"""The rules of memory over time: process RSS and the allocator growing, and when it runs out.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).
"""

from __future__ import annotations

from gpuwise.monitor.window import Earlier, Judged, Window


def memory_leak(view: Window, earlier: Earlier) -> Judged | None:
    return None


__all__ = ["memory_leak"]
