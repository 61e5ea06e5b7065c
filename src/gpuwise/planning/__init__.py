"""Planning: simulate a step on fake tensors, then fit it on GPUs.

The names load on first use: ``from gpuwise.planning import Setup`` does not import torch, so the CLI checks its
arguments before paying for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwise.planning.fit import GpuFit
    from gpuwise.planning.planner import MemoryPlan, plan, plan_model
    from gpuwise.planning.remedies import Remedy
    from gpuwise.planning.setup import Setup

_WHERE = {"GpuFit": "fit", "MemoryPlan": "planner", "plan": "planner", "plan_model": "planner", "Remedy": "remedies",
          "Setup": "setup"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'gpuwise.planning' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"gpuwise.planning.{_WHERE[name]}"), name)
    return value


__all__ = ["GpuFit", "MemoryPlan", "Remedy", "Setup", "plan", "plan_model"]
