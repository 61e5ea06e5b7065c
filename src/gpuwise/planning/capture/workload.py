"""The simulated step of one model and setup, independent of any GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import numpy as np

import gpuwise.planning.capture.cache as capture_cache
from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.capture.blocks import Stack, plan_stack
from gpuwise.planning.capture.scaling import (
    Misaligned,
    Timeline,
    batch_affine,
    capture_at,
    extrapolate_blocks,
    fewer_blocks_at,
)
from gpuwise.planning.capture.step import Capture, capture
from gpuwise.planning.capture.tracker import OpCosts
from gpuwise.planning.parallel.layout import stage_layers
from gpuwise.planning.parallel.rank import check as check_parallel
from gpuwise.planning.setup import Setup
from gpuwise.planning.transforms.lora import UnevenTargets


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
    captured_blocks: tuple[int, ...] | None  # (2, 3) when a stack of blocks was captured small and scaled (blocks.py)
    # The captures behind it, per block count (2 and 3, or the whole model): at the micro-batch, then those the
    # batch model came from (b+1, or b+1 and b+2). ``at`` predicts the step at other micro-batches from them.
    captures: tuple[tuple[Capture, ...], ...] = field(default=(), repr=False, compare=False)
    stack: Stack | None = None  # the stack the small captures were scaled to
    paged_bytes: int = 0  # optimizer state in paged memory (counted in the timeline's optimizer column too)
    embeddings: tuple[tuple[int, int], ...] = ()  # (rows, bytes a row) of the untied embeddings (Capture.embeddings)
    # routed-expert parameters among ``params`` (E / ep of each MoE layer's under --ep): sharding.py shards them over
    # the shard_gpus / ep ranks left, torchtitan's dp_shard_mod_ep
    expert_params: int = 0
    # (routed experts of each MoE layer, all GPUs together; top-k): a decode step reads the experts its tokens touch
    routed: tuple[int, int] | None = None
    expert_bytes: int = 0  # the bytes ``expert_params`` are stored in (their dtype, or --weights' format)

    def at(self, micro_batch: int, grad_accum: int) -> Workload | None:
        """The workload of this step at ``micro_batch`` x ``grad_accum`` without capturing it again: every live
        byte and every op's FLOPs and bytes affine in the micro-batch (what the batch model already assumes for
        memory), the forward and backward weighed for ``grad_accum``; without accumulation the first micro-batch
        of a capture that held two. Equal to ``simulate`` at that setup where the step is affine in the batch (it
        is for the zoo; tests/test_costs_affine.py). None where the captures cannot say: no batch model, more
        micro-batches held than captured, a micro-batch below the batch model's, or captures that do not pair."""
        if not self.captures or self.batch_model is None:
            return None
        held = min(grad_accum, 2)
        if held > min(self.setup.grad_accum, 2):
            return None
        setup = replace(self.setup, micro_batch=micro_batch, grad_accum=grad_accum)
        per_sample = self.tokens_per_step // (self.setup.micro_batch * self.setup.grad_accum)
        try:
            groups = []
            for group in self.captures:
                if micro_batch != group[0].batch:  # b, b+1 (or b+1, b+2): the pair the batch model came from
                    a, b = group[-2], group[-1]
                    if micro_batch < a.batch:
                        return None
                    group = (capture_at(a, b, micro_batch), capture_at(a, b, micro_batch + 1))
                groups.append(tuple((c.first_pass() if held == 1 else c).reweighed(grad_accum) for c in group))
            return replace(_assemble(self.model, setup, per_sample * micro_batch * grad_accum, groups, self.stack),
                           expert_params=self.expert_params, routed=self.routed,
                           expert_bytes=self.expert_bytes)
        except Misaligned:
            return None


_KEPT: ContextVar[dict | None] = ContextVar("gpuwise_captures_kept", default=None)


@contextlib.contextmanager
def keeping(captures: dict) -> Iterator[None]:
    """The captures made inside are kept in ``captures`` and read back from there (a Planner's: one model's, each
    captured once, whether first asked for with the batch model or without)."""
    token = _KEPT.set(captures)
    try:
        yield
    finally:
        _KEPT.reset(token)


def _alone(c: Capture) -> Timeline:
    return Timeline(labels=c.labels, base=c.live.astype(np.float64), slope=np.zeros(c.live.shape),
                    end_of_forward=c.end_of_forward)


def _capture(source, setup: Setup, *, batch: int, n_layer: int | None) -> Capture:
    """``capture``, read from the disk cache where this model and setup were captured before (capture/cache.py), or
    from the captures kept in process (``keeping``)."""
    kept, mine = _KEPT.get(), (setup, batch, n_layer)
    if kept is not None and mine in kept:
        return kept[mine]
    c = _disk_or_capture(source, setup, batch=batch, n_layer=n_layer)
    if kept is not None:
        kept[mine] = c
    return c


def _disk_or_capture(source, setup: Setup, *, batch: int, n_layer: int | None) -> Capture:
    name = capture_cache.key(source, setup, batch, n_layer)
    hit = capture_cache.load(name)
    if isinstance(hit, Capture) and hit.batch == batch:
        return hit
    c = capture(source, setup, batch=batch, n_layer=n_layer)
    capture_cache.store(name, c)
    return c


def _captures(source, setup: Setup, n_layer: int | None, batch_model: bool, c: Capture | None = None
              ) -> tuple[Capture, ...]:
    """The capture at the batch (``c`` where already made) and, for the batch model, at b+1; where an op takes another
    path at batch 1 (ViT's class token) the captures at b and b+1 do not pair, and b+2 is captured too."""
    b = setup.micro_batch
    c = c if c is not None else _capture(source, setup, batch=b, n_layer=n_layer)
    if not batch_model:
        return (c,)
    c1 = _capture(source, setup, batch=b + 1, n_layer=n_layer)
    try:
        batch_affine(c, c1)
        return c, c1
    except Misaligned:
        pass
    c2 = _capture(source, setup, batch=b + 2, n_layer=n_layer)
    try:
        batch_affine(c1, c2)
        return c, c1, c2
    except Misaligned:  # the ops keep changing with the batch (an MoE hitting more of its experts): no batch model
        return (c,)


def _stack_captures(source, setup: Setup, stack: Stack, batch_model: bool) -> list[tuple[Capture, ...]]:
    """The captures of ``stack.captured`` blocks (``_captures`` of each). The smaller stack's capture at b+1 is derived
    from the larger's pair where that pairs (scaling.fewer_blocks_at: what the batch adds to each op and storage is
    what it adds to the same op and storage of the larger step), not run: a capture is the cold plan's cost."""
    small, large = stack.captured
    c = _capture(source, setup, batch=setup.micro_batch, n_layer=small)
    big = _captures(source, setup, large, batch_model)
    if len(big) == 2:
        try:
            return [(c, fewer_blocks_at(c, *big, stack)), big]
        except Misaligned:
            pass
    return [_captures(source, setup, small, batch_model, c), big]


def _timelines(group: tuple[Capture, ...]) -> tuple[Capture, Timeline, Timeline | None]:
    """The capture at the batch, its timeline, and the batch model: captures at b and b+1 share their op
    sequence except where an op takes another path at batch 1; then b+1 and b+2 give it."""
    c = group[0]
    if len(group) == 1:
        return c, _alone(c), None
    if len(group) == 2:
        tl = batch_affine(c, group[1])
        return c, tl, tl
    return c, _alone(c), batch_affine(group[1], group[2])


def simulate(source, setup: Setup, *, batch_model: bool = True) -> Workload:
    """Capture ``setup`` on fake tensors; a deep stack of blocks is captured with 2 and 3 blocks (or 2 and 3 repeating
    units after its first blocks: blocks.py) and scaled.

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
    check_parallel(source, setup)
    w = _simulate(source, setup, batch_model)
    experts = getattr(source, "experts", None)
    if experts is None:
        return w
    share = experts.params
    if setup.pp > 1:  # a pipeline stage holds its blocks' share (its blocks are all alike: HFSource.check)
        share = share * stage_layers(source.n_layer, setup) // source.n_layer
    split = setup.ep * setup.tp  # --ep holds E / ep of them, --tp each at ffn / tp (parallel/expert.py's shard_experts)
    return replace(w, expert_params=share // split, routed=(experts.experts, experts.top_k),
                   expert_bytes=int(share * _expert_bytes_per_param(setup, experts)) // split)


def _expert_bytes_per_param(setup: Setup, experts) -> float:
    """Bytes a routed-expert parameter is stored in: the weights' dtype, or ``--weights``' format where it applies to
    experts (quantize.py: nn.Linear experts always; transformers 5's fused 3-D experts under vLLM's formats only)."""
    from gpuwise.planning.transforms.quantize import EXPERT_FORMATS, FORMATS

    held = float(setup.weight_dtype.itemsize)
    if not setup.quantized or not experts.params:
        return held
    packed = FORMATS[setup.weights].bytes_per_weight()
    fused = min(experts.fused, experts.params)
    return (fused * (packed if setup.weights in EXPERT_FORMATS else held) + (experts.params - fused) * packed) \
        / experts.params


def _simulate(source, setup: Setup, batch_model: bool) -> Workload:
    n_layer = source.n_layer
    whole = None  # the blocks a whole-model capture builds: the model's own, or a pipeline stage's
    if n_layer is not None and setup.pp > 1:
        n_layer = whole = stage_layers(n_layer, setup)
    tokens = source.tokens(setup) * setup.micro_batch * setup.grad_accum // setup.cp  # one GPU's: s / cp under --cp
    # which blocks are alike (a source that does not say, and a pipeline stage, has them all alike)
    stack = plan_stack(getattr(source, "layer_kinds", None) if whole is None else None, n_layer)
    if stack is not None:
        try:
            return _assemble(source.name, setup, tokens, _stack_captures(source, setup, stack, batch_model), stack)
        except (Misaligned, UnevenTargets):
            pass  # not a clean stack of repeated blocks (or LoRA targets only some): capture the whole model
    try:
        groups = [_captures(source, setup, whole, batch_model)]
    except Misaligned as exc:  # a pipeline stage built as the model's first blocks is not them
        raise NotApplicable(f"--pp {setup.pp}: a stage of {source.name} does not build as its first {whole} blocks "
                            f"({exc})", "plan without --pp") from exc
    return _assemble(source.name, setup, tokens, groups, None)


def _assemble(name: str, setup: Setup, tokens: int, groups: list[tuple[Capture, ...]], stack: Stack | None
              ) -> Workload:
    """The workload from its captures: one group for the whole model, or two (``stack.captured`` blocks) scaled to
    the stack. Misaligned if the larger capture is not the smaller one plus a unit of blocks."""
    if stack is None:
        c, timeline, model = _timelines(groups[0])
        return Workload(
            model=name, setup=setup, params=c.params, trainable_params=c.trainable_params,
            block_bytes=c.block_bytes, block_trainable_params=c.block_trainable_params,
            flops_per_step=c.flops_per_step, bytes_per_step=c.bytes_per_step, costs=c.costs,
            tokens_per_step=tokens, timeline=timeline, batch_model=model, uncosted=c.uncosted, captured_blocks=None,
            captures=tuple(groups), paged_bytes=c.paged_bytes, embeddings=c.embeddings,
        )
    (c2, t2, m2), (c3, t3, m3) = (_timelines(g) for g in groups)
    timeline = extrapolate_blocks(t2, t3, stack)
    model = None
    if m2 is not None and m3 is not None:  # either capture may have no batch model (an MoE's changing ops)
        model = timeline if m2 is t2 and m3 is t3 else extrapolate_blocks(m2, m3, stack)
    k = stack.copies

    def lin(x2: int, x3: int) -> int:
        return x2 + k * (x3 - x2)

    return Workload(
        model=name, setup=setup, params=lin(c2.params, c3.params),
        trainable_params=lin(c2.trainable_params, c3.trainable_params), block_bytes=c3.block_bytes,
        block_trainable_params=c3.block_trainable_params,
        flops_per_step=lin(c2.flops_per_step, c3.flops_per_step),
        bytes_per_step=lin(c2.bytes_per_step, c3.bytes_per_step), tokens_per_step=tokens,
        costs=OpCosts.combine(c2.costs.scaled(1 - k), c3.costs.scaled(k)),
        timeline=timeline, batch_model=model,
        uncosted={op: lin(c2.uncosted.get(op, 0), c3.uncosted.get(op, 0))
                  for op in {**c2.uncosted, **c3.uncosted}},
        captured_blocks=stack.captured, captures=tuple(groups), stack=stack,
        paged_bytes=lin(c2.paged_bytes, c3.paged_bytes), embeddings=c3.embeddings,
    )
