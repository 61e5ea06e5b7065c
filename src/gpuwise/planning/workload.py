"""The simulated step of one model and setup, independent of any GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.capture import Capture, capture
from gpuwise.planning.scaling import Misaligned, Timeline, batch_affine, extrapolate_blocks
from gpuwise.planning.setup import Setup
from gpuwise.planning.tracker import OpCosts


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Everything the step does: parameters, FLOPs, bytes moved and the memory timeline."""

    model: str
    setup: Setup  # the step captured: one GPU (the run's GPUs and sharding apply after: sharding.per_gpu)
    params: int
    trainable_params: int
    block_bytes: int  # what FSDP gathers at once
    block_trainable_params: int
    flops_per_step: int
    bytes_per_step: int
    costs: OpCosts = field(repr=False, compare=False)  # per op, summing to flops_per_step and bytes_per_step
    tokens_per_step: int
    timeline: Timeline = field(repr=False)  # exact at setup.micro_batch
    batch_model: Timeline | None = field(repr=False)  # affine in the batch, valid from setup.micro_batch (+1 at worst)
    uncosted: dict[str, int]
    captured_blocks: tuple[int, ...] | None  # (2, 3) when a stack of blocks was captured small and scaled


def _alone(c: Capture) -> Timeline:
    return Timeline(labels=c.labels, base=c.live.astype(np.float64), slope=np.zeros(c.live.shape),
                    end_of_forward=c.end_of_forward)


def _timelines(
    source, setup: Setup, n_layer: int | None, batch_model: bool
) -> tuple[Capture, Timeline, Timeline | None]:
    """The capture at the batch, its timeline, and the batch model: captures at b and b+1 share their op
    sequence except where an op takes another path at batch 1 (ViT's class token); then b+1 and b+2 give it."""
    b = setup.micro_batch
    c = capture(source, setup, batch=b, n_layer=n_layer)
    if not batch_model:
        return c, _alone(c), None
    c1 = capture(source, setup, batch=b + 1, n_layer=n_layer)
    try:
        tl = batch_affine(c, c1)
        return c, tl, tl
    except Misaligned:
        return c, _alone(c), batch_affine(c1, capture(source, setup, batch=b + 2, n_layer=n_layer))


def simulate(source, setup: Setup, *, batch_model: bool = True) -> Workload:
    """Capture ``setup`` on fake tensors; a deep stack of identical blocks is captured with 2 and 3 blocks and scaled.

    ``batch_model=False`` skips the second capture that makes the memory affine in the batch (no max batch then).
    A setup the model cannot take (LoRA on blocks without linear layers, checkpointing without blocks) is the
    caller's request, so a one-line GpuwiseError.
    """
    try:
        return simulate_if_applicable(source, setup, batch_model=batch_model)
    except NotApplicable as exc:
        raise GpuwiseError(*exc.args) from exc  # raised as NotApplicable(message, hint)


def simulate_if_applicable(source, setup: Setup, *, batch_model: bool = True) -> Workload:
    """``simulate`` for a setup the planner chose (a remedy): one the model cannot take raises NotApplicable."""
    source.check(setup)
    n_layer = source.n_layer
    tokens = source.tokens(setup) * setup.micro_batch * setup.grad_accum
    if n_layer is not None and n_layer > 3:
        c2, t2, m2 = _timelines(source, setup, 2, batch_model)
        c3, t3, m3 = _timelines(source, setup, 3, batch_model)
        try:
            timeline = extrapolate_blocks(t2, t3, n_layer)
            model = None
            if batch_model:
                model = timeline if m2 is t2 and m3 is t3 else extrapolate_blocks(m2, m3, n_layer)
            k = n_layer - 2

            def lin(x2: int, x3: int) -> int:
                return x2 + k * (x3 - x2)

            return Workload(
                model=source.name, setup=setup, params=lin(c2.params, c3.params),
                trainable_params=lin(c2.trainable_params, c3.trainable_params), block_bytes=c3.block_bytes,
                block_trainable_params=c3.block_trainable_params,
                flops_per_step=lin(c2.flops_per_step, c3.flops_per_step),
                bytes_per_step=lin(c2.bytes_per_step, c3.bytes_per_step), tokens_per_step=tokens,
                costs=OpCosts.combine(c2.costs.scaled(1 - k), c3.costs.scaled(k)),
                timeline=timeline, batch_model=model,
                uncosted={op: lin(c2.uncosted.get(op, 0), c3.uncosted.get(op, 0))
                          for op in {**c2.uncosted, **c3.uncosted}},
                captured_blocks=(2, 3),
            )
        except Misaligned:
            pass  # not a clean stack of identical blocks: capture the whole model
    c, timeline, model = _timelines(source, setup, None, batch_model)
    return Workload(
        model=source.name, setup=setup, params=c.params, trainable_params=c.trainable_params,
        block_bytes=c.block_bytes, block_trainable_params=c.block_trainable_params,
        flops_per_step=c.flops_per_step, bytes_per_step=c.bytes_per_step, costs=c.costs,
        tokens_per_step=tokens, timeline=timeline, batch_model=model, uncosted=c.uncosted, captured_blocks=None,
    )
