"""The smaller stack's capture at batch + 1 derived from the others instead of run (scaling.fewer_blocks_at, issue 30's
cold start): field by field the capture that running it gives, across zoo models and setups; refused where the
captures do not pair, so that the step is then captured."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpuwise.planning.capture.blocks import Stack, plan_stack
from gpuwise.planning.capture.scaling import Misaligned, fewer_blocks_at
from gpuwise.planning.capture.step import capture
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.resolve import resolve_source

CASES = [
    ("gpt2", Setup(micro_batch=2, grad_accum=2, seq=32)),  # bf16 autocast, two micro-batches held
    ("gpt2", Setup(micro_batch=1, seq=32, precision="fp32", checkpointing="full", optimizer="sgd")),
    ("gpt2", Setup(micro_batch=1, seq=32, task="finetune-lora", checkpointing="selective")),
    ("gpt2", Setup(micro_batch=2, seq=32, task="infer")),
    ("llama2-7b", Setup(micro_batch=1, grad_accum=2, seq=32, precision="bf16")),  # the FSDP probe's capture
    ("bert-base", Setup(micro_batch=1, seq=32, precision="fp16-mixed", optimizer_in_backward=True)),
    ("mlp", Setup(micro_batch=3, optimizer="adafactor")),
]


def assert_same(a, b, path: str = "capture") -> None:
    """Every field equal: arrays in dtype, shape and value, nested dataclasses field by field."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


def _captures(name: str, setup: Setup, batch: int):
    source = resolve_source(name, None)
    stack = plan_stack(getattr(source, "layer_kinds", None), source.n_layer)
    small, large = stack.captured
    return source, stack, [capture(source, setup, batch=b, n_layer=n)
                           for n, b in ((small, batch), (large, batch), (large, batch + 1))]


@pytest.mark.parametrize(("name", "setup"), CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_the_derived_capture_is_the_capture(name, setup):
    """2 blocks at b, 3 at b and b+1 give 2 at b+1 without running it: labels, ops, every op row (FLOPs, bytes,
    GEMM shapes), every storage (size, life, category), the timeline, the totals and the per-op costs."""
    b = setup.micro_batch
    source, stack, (small, large, large_next) = _captures(name, setup, b)
    derived = fewer_blocks_at(small, large, large_next, stack)
    assert_same(derived, capture(source, setup, batch=b + 1, n_layer=stack.small))
    assert derived.live.sum() > small.live.sum() and derived.flops_per_step > small.flops_per_step  # it grew


def test_captures_that_do_not_pair_are_not_derived():
    """ViT at batch 1 takes another path (its class token) than at batch 2: the 3-block captures do not pair, so the
    2-block one at batch 2 is not derived from them (it is captured, and batch 3 with it: workload._captures). Nor
    is a capture paired with another stack's than its own."""
    _, stack, (small, large, large_next) = _captures("vit-b16", Setup(micro_batch=1), 1)
    with pytest.raises(Misaligned):
        fewer_blocks_at(small, large, large_next, stack)
    _, stack, (small, large, large_next) = _captures("gpt2", Setup(micro_batch=1, seq=32), 1)
    with pytest.raises(Misaligned):
        fewer_blocks_at(small, large, large_next, Stack(n_layer=12, period=2))  # 2 blocks and 4
    with pytest.raises(Misaligned):  # the larger step at the same batch twice: no growth to carry over
        fewer_blocks_at(small, large, large, stack)


@pytest.mark.parametrize("config", ["DEEPSEEK_V3", "GEMMA"])
def test_a_mixed_stacks_derived_capture_is_the_capture(tmp_path, config):
    """Dense-then-MoE and sliding-and-global stacks (test_blocks.py's configs), whose inserted unit is block 3 (an MoE
    one) and blocks 2-3: the capture derived at batch 3 is the one run there."""
    pytest.importorskip("transformers")
    import test_blocks

    source = test_blocks._source(tmp_path, getattr(test_blocks, config))
    setup = Setup(micro_batch=2, seq=16)
    stack = plan_stack(source.layer_kinds, source.n_layer)
    small, large = stack.captured
    derived = fewer_blocks_at(capture(source, setup, batch=2, n_layer=small), capture(source, setup, batch=2,
                              n_layer=large), capture(source, setup, batch=3, n_layer=large), stack)
    assert_same(derived, capture(source, setup, batch=3, n_layer=small))
