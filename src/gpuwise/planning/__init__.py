"""Planning: simulate a step on fake tensors, then fit it on GPUs."""

from gpuwise.planning.plan import GpuFit, MemoryPlan, Remedy, plan, plan_model
from gpuwise.planning.setup import Setup

__all__ = ["GpuFit", "MemoryPlan", "Remedy", "Setup", "plan", "plan_model"]
