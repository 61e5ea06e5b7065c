"""The fake-tensor capture against the same step run for real on the CPU: our tracker on real tensors,
and PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) as an independent reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from gpuwise.models import get_model
from gpuwise.models.gpt import GPTConfig
from gpuwise.optim import param_groups
from gpuwise.planning.capture.step import capture
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource

SMALL_GPT = ZooSource(zoo=replace(get_model("gpt2"), config=GPTConfig(n_layer=2, n_head=4, n_embd=256,
                                                                       vocab_size=4096, block_size=256)))


@pytest.mark.parametrize("setup", [
    Setup(micro_batch=4, seq=128, precision="fp32"),
    Setup(micro_batch=4, seq=128, precision="bf16-mixed", checkpointing="full"),
    Setup(micro_batch=2, seq=128, task="infer"),
], ids=["fp32", "bf16-mixed+checkpointing", "infer"])
def test_fake_capture_equals_real_run(setup):
    fake = capture(SMALL_GPT, setup, batch=setup.micro_batch)
    torch.manual_seed(0)
    real = capture(SMALL_GPT, setup, batch=setup.micro_batch, fake=False)
    assert fake.ops == real.ops
    np.testing.assert_array_equal(fake.live, real.live)
    assert fake.flops_per_step == real.flops_per_step


def test_peak_matches_pytorch_memtracker():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    setup = Setup(micro_batch=4, seq=128, precision="fp32")
    ours = capture(SMALL_GPT, setup, batch=4).live.sum(axis=1).max()

    torch.manual_seed(0)
    model = SMALL_GPT.zoo.instantiate()
    (idx,), targets = SMALL_GPT.zoo.make_inputs(4, seq=128, image_size=None, dtype=torch.float32)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-4, foreach=True)  # as the trainer's
    for p in model.parameters():  # the optimizer state exists, as in the planned steady-state step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt, idx, targets)
    with mt:
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    print(f"\npeak: ours {ours:,} B, MemTracker {theirs:,} B, ratio {ours / theirs:.4f}")
    assert ours == pytest.approx(theirs, rel=0.05)
