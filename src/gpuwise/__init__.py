"""gpuwise: measured answers to GPU questions for deep-learning practitioners.

The library returns frozen dataclasses and never prints; ``gpuwise.render`` and ``gpuwise.cli``
turn them into tables and JSON. Importing gpuwise does not import torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from gpuwise.doctor import DoctorReport, Finding, diagnose
from gpuwise.environment import Environment, gather_environment
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.hardware.detect import LocalMachine, describe_local

__all__ = [
    "Accelerator", "Catalog", "DoctorReport", "Environment", "Finding", "GpuwiseError", "LocalMachine",
    "Measurement", "MemoryPlan", "Monitor", "Setup", "__version__", "describe_local", "diagnose", "gather_environment",
    "load_catalog", "measure", "plan", "plan_model",
]  # fmt: skip

_PLANNING = {"MemoryPlan", "Setup", "plan", "plan_model"}  # these import torch, so only when asked for
_BENCH = {"Measurement", "measure"}


def __getattr__(name: str):
    if name in _PLANNING:
        import gpuwise.planning

        return getattr(gpuwise.planning, name)
    if name in _BENCH:
        import gpuwise.bench

        return getattr(gpuwise.bench, name)
    if name == "Monitor":
        from gpuwise.monitor.sampler import Monitor

        return Monitor
    raise AttributeError(f"module 'gpuwise' has no attribute {name!r}")
