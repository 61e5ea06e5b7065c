"""A capture without importing TorchDynamo (compat.light_dynamo, issue 30's cold start), in a fresh process as the CLI
runs it: the heavy part of the package is never imported, the capture is the one the real package gives, and
torch.compile works afterwards in the same process, also on the torch functions the stand-in's ``disable`` wrapped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import json, sys
import torch
from gpuwise.planning.capture.step import capture
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.resolve import resolve_source

def digest(c):
    return [c.flops_per_step, c.bytes_per_step, c.live.tolist(), c.rows.bytes.tolist(), list(c.labels)]

source = resolve_source("gpt2", None)
setup = Setup(micro_batch=2, seq=16, grad_accum=2, checkpointing="full")
light = digest(capture(source, setup, batch=2, n_layer=2))
stand_in = type(sys.modules["torch._dynamo"]).__name__
heavy_before = "torch._dynamo.convert_frame" in sys.modules
wrapped = [f for f in sys.modules["torch._dynamo"].wrapped if getattr(f, "__dynamo_disable", None) is not None]

# a compiled training step after the capture: the optimizer's step is one of the functions torch wrapped in
# _disable_dynamo, whose cached stand-in wrapper must give way to the real one
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
@torch.compile(backend="eager")
def step(x):
    loss = model(x).square().mean()
    loss.backward()
    return loss
x = torch.ones(3, 4)
losses = []
for _ in range(3):
    losses.append(step(x).item())
    opt.step()
    opt.zero_grad()
cached_after = [f for f in sys.modules["torch._dynamo"].wrapped
                if getattr(getattr(f, "__dynamo_disable", None), "stand_in", None) is not None]
real = digest(capture(source, setup, batch=2, n_layer=2))  # the package real now: its disable wraps the fake ops
json.dump({"stand_in": stand_in, "heavy_before": heavy_before, "wrapped": len(wrapped) > 0,
           "heavy_after": "torch._dynamo.convert_frame" in sys.modules, "losses": losses,
           "stand_in_cached_after": len(cached_after), "same": light == real,
           "compiling": torch._dynamo.is_compiling()}, sys.stdout)
"""



def _run(script: str, **env) -> str:
    environ = {**os.environ, "GPUWISE_CACHE": "off", **env}
    if "GPUWISE_LIGHT_DYNAMO" not in env:  # the stand-in on, whatever the caller's environment says
        environ.pop("GPUWISE_LIGHT_DYNAMO", None)
    out = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _eager_losses() -> list[float]:
    """The compiled step's losses, run eagerly here (the script's model, seed and data)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x, losses = torch.ones(3, 4), []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    return losses


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="the stand-in is used from torch 2.13, the first release it was checked on")
def test_a_capture_imports_no_dynamo_and_compile_still_works_after():
    """Before, FakeTensorMode() imported all of torch._dynamo (1.2-1.7 s of CPU of a cold plan): now only its config
    and source modules load. torch.compile, run after in the same process, loads the rest, compiles a training step
    whose losses equal the eager run's, and the functions torch had cached the stand-in's ``disable`` for (the
    optimizer's, fake dispatch's) are handed the real one; a capture after that is the same capture."""
    got = json.loads(_run(SCRIPT))
    assert got.pop("losses") == pytest.approx(_eager_losses(), rel=1e-6)
    assert got == {"stand_in": "_LightDynamo", "heavy_before": False, "wrapped": True, "heavy_after": True,
                   "stand_in_cached_after": 0, "same": True, "compiling": False}


def test_the_switch_turns_it_off():
    """``GPUWISE_LIGHT_DYNAMO=0``: the real package, imported by the capture as torch does."""
    script = SCRIPT.split("stand_in = ")[0] + ("json.dump([type(sys.modules['torch._dynamo']).__name__, "
                                               "'torch._dynamo.convert_frame' in sys.modules], sys.stdout)")
    assert json.loads(_run(script, GPUWISE_LIGHT_DYNAMO="0")) == ["module", True]
