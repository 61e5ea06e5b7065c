"""Training: the loop (trainer.py) and its parts (meter.py: timing and MFU; interrupt.py: Ctrl-C; loss.py;
checkpoint.py: the Checkpointer and RNG states), its config in the planner's vocabulary (config.py), the run's
one plan (runplan.py), parallelism applied from outside (parallelize.py), data and tasks, torchrun ranks, and
``run_training`` (what ``gpuwise train`` calls). The names below load on first use (most import torch)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Trainer": "trainer", "Runtime": "trainer", "TrainResult": "trainer", "StepLog": "trainer",
            "TrainConfig": "config", "TrainOptions": "config", "Checkpointer": "checkpoint",
            "TrainSummary": "run", "run_training": "run", "RunPlan": "runplan"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"gpuwise.training.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'gpuwise.training' has no attribute {name!r}")
