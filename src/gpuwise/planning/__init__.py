"""Planning: simulate a step on fake tensors, then fit it on GPUs."""

from gpuwise.planning.fit import GpuFit
from gpuwise.planning.plan import MemoryPlan, plan, plan_model
from gpuwise.planning.remedies import Remedy
from gpuwise.planning.setup import Setup

__all__ = ["GpuFit", "MemoryPlan", "Remedy", "Setup", "plan", "plan_model"]
