"""A step planned without accumulation says what accumulating would cost (issue 14's "a full fine-tune planned with
--grad-accum 1 silently drops the gradient buffer that accumulation keeps alive")."""

from __future__ import annotations

import pytest

from conftest import run_cli
from gpuwise.planning import Setup, plan_model


@pytest.mark.parametrize("model", ["gpt2"])
def test_accumulation_peak_is_the_simulated_step_with_accumulation(model):
    """The figure computed from the one-micro-batch timeline equals the peak of the step simulated with two
    micro-batches (its second one runs with the first one's gradients alive), within 0.5%."""
    one = plan_model(model, Setup(seq=256, micro_batch=2), gpu="h100")
    two = plan_model(model, Setup(seq=256, micro_batch=2, grad_accum=2), gpu="h100")
    assert two.accumulation_peak_bytes is None  # it is the plan itself there
    assert one.accumulation_peak_bytes == pytest.approx(two.peak_bytes, rel=0.005)
    assert one.accumulation_peak_bytes > one.peak_bytes


def test_the_plan_says_so_only_where_it_matters(capsys):
    """A full fine-tune (gradients of every weight) gets the line; LoRA (a few MiB of adapter gradients) and
    inference do not."""
    code, out, _ = run_cli(capsys, "plan", "--model", "gpt2", "--seq", "256", "--gpu", "h100")
    assert code == 0 and "accumulation" in out and "--batch above --micro-batch" in out
    for extra in (["--task", "finetune-lora"], ["--task", "infer"]):
        code, out, _ = run_cli(capsys, "plan", "--model", "gpt2", "--seq", "256", "--gpu", "h100", *extra)
        assert code == 0 and "accumulation" not in out
