"""What the scenario scripts share: a small MLP and its training step, and the one line each script prints for
``benchmarks/watch_truth.py`` (``MARK`` then a JSON object). gpuwise is imported only by the scripts that use it:
scenario a's loop must not know it is watched."""

from __future__ import annotations

import json
import time

import torch
from torch import nn

MARK = "WATCH_TRUTH "  # the harness reads the line that starts with it


def mlp(width: int, depth: int = 3) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Trainer:
    """One SGD step of ``model`` on (x, y) with an MSE loss: the compute of every scenario's normal step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()


def batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pre-made batches: the loader costs nothing, so the scenario's cause is only what it adds."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(n)]


def diagnosis(mon) -> dict:
    from gpuwise.render.diagnosis import diagnosis_json

    return diagnosis_json(mon.diagnose())


def report(mon) -> dict:
    """``Monitor.report()`` as JSON, or the error it raised (it is new with issue 29)."""
    try:
        return mon.report().to_dict()
    except Exception as exc:  # the harness shows it in the row
        return {"error": f"{type(exc).__name__}: {exc}"}


def monitored(trainer, loader, steps: int, batch: int):
    """Train ``steps`` batches of ``loader`` under a Monitor (its loader and step hooks); the monitor and the wall
    seconds the loop took."""
    from gpuwise import Monitor

    with Monitor(interval_s=0.5) as mon:
        clock = Clock()
        for i, (x, y) in enumerate(mon.loader(loader)):
            trainer.step(x, y)
            mon.step(items=batch)
            if i + 1 == steps:
                break
        wall = clock.seconds()
    return mon, wall


def emit(**fields) -> None:
    print(MARK + json.dumps(fields, default=str), flush=True)


class Clock:
    """Wall time of the loop, from its first step's start to its last step's end."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.t0
