"""A Workload on GPUs: peak memory, whether it fits, the largest micro-batch, and what to change if not.

>>> from gpuwise.planning import plan_model
>>> p = plan_model("gpt2", Setup(micro_batch=4, seq=256), gpu="rtx-4090")   # doctest: +SKIP
>>> p.gpus[0].fits, p.max_batch                                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.capture.workload import Workload, keeping, simulate_if_applicable
from gpuwise.planning.cost.comm import expert_parallel
from gpuwise.planning.cost.kv_cache import stored_as
from gpuwise.planning.cost.serving import DecodeRead
from gpuwise.planning.experts import Experts
from gpuwise.planning.fit import OVERHEAD_BYTES, TIGHT_FRACTION, GpuFit, fit_on
from gpuwise.planning.parallel.expert import AllToAll, hot_rank_factor
from gpuwise.planning.parallel.layout import Layout, layout, stage_layers
from gpuwise.planning.parallel.sharding import PerGpu, capture_setup, per_gpu
from gpuwise.planning.remedies import Remedy, remedies
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.checkpoint import stored_weights
from gpuwise.planning.sources.resolve import Model, as_source, resolve_source
from gpuwise.planning.transforms.quantize import experts_note

__all__ = ["OVERHEAD_BYTES", "TIGHT_FRACTION", "GpuFit", "MemoryPlan", "Remedy", "plan", "plan_model"]

DEFAULT_GPU = "h100-sxm"


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The itemised plan: every figure in bytes or FLOPs, per GPU."""

    model: str
    setup: Setup
    params: int
    trainable_params: int
    flops_per_step: int
    bytes_per_step: int
    tokens_per_step: int
    peak_bytes: int  # the step's tensors: torch.cuda.max_memory_allocated() less library workspaces
    overhead_bytes: int  # CUDA context and library workspaces
    paged_bytes: int  # of peak_bytes, optimizer state in paged memory: it can spill to the host (not in the fit)
    activations_bytes: int  # saved for backward at the end of the forward pass
    breakdown: dict[str, int]  # by category, at the peak
    peak_at: str  # phase (and block) of the peak
    gpu: str  # the GPU that fits, max_batch and remedies refer to
    fits: bool
    max_batch: int
    gpus: tuple[GpuFit, ...]
    remedies: tuple[Remedy, ...]
    uncosted: dict[str, int]
    captured_blocks: tuple[int, ...] | None
    host_bytes: int = 0  # host memory per GPU for --offload's state (not in the fit)
    layout: Layout | None = None  # --tp/--pp/--cp/--nodes/--offload: how the GPUs split the work (planning/parallel/)
    # a training step planned without accumulation: its peak if the gradients stayed alive through forward and
    # backward, as they do from the second micro-batch on when --batch is above --micro-batch (None otherwise)
    accumulation_peak_bytes: int | None = None
    timeline: np.ndarray = field(repr=False, compare=False)  # (samples, categories) bytes at this batch
    timeline_phases: tuple[str, ...] = field(repr=False, compare=False)
    decode: DecodeRead | None = None  # --task decode: what one step reads (each GPU's token floor is in gpus)
    experts: Experts | None = None  # a Mixture-of-Experts model's routed experts: total and active parameters
    routing: str | None = None  # how the routed tokens were split among the experts (planning/capture/routing.py)
    notes: tuple[str, ...] = ()  # what the figures rest on that a user may not expect (quantize.experts_note)
    all_to_all: AllToAll | None = None  # --ep: what one GPU's all-to-alls move over a step (parallel.expert.AllToAll)


class Planner:
    """Simulates the setups of one model, each capture once, and shards each run's setup once."""

    def __init__(self, source) -> None:
        self.source = source
        self._workloads: dict[tuple[Setup, bool], Workload] = {}
        self._per_gpu: dict[Setup, PerGpu] = {}
        self._captures: dict = {}  # (setup, batch, blocks) -> Capture: the batch model reuses the captures before it

    def workload(self, setup: Setup, *, batch_model: bool = False) -> Workload:
        """The capture of ``setup`` (one GPU: sharding applies after it), with the attention its step runs
        (``resolved_attention``: one capture whether or not the caller resolved it); NotApplicable if the model cannot
        take it."""
        # one capture whatever --kv-dtype stores the cache in (kv_cache.stored_as scales it after)
        key = replace(capture_setup(resolved_attention(self.source, setup)), kv_dtype=None)
        hit = self._workloads.get((key, True)) or (None if batch_model else self._workloads.get((key, False)))
        if hit is None:
            with keeping(self._captures):
                hit = simulate_if_applicable(self.source, key, batch_model=batch_model)
            self._workloads[key, batch_model] = hit
        return hit

    def per_gpu(self, setup: Setup, *, batch_model: bool = False) -> PerGpu:
        """One GPU of ``setup``; under --pp the worst stage's: the first (the most micro-batches in flight) or the
        last (the head and the loss), each captured as it runs (planning/parallel/)."""
        setup = resolved_attention(self.source, setup)
        hit = self._per_gpu.get(setup)
        if hit is None or (batch_model and hit.batch_model is None):
            if setup.pp > 1 and setup.stage is None:
                hit = max((self.per_gpu(replace(setup, stage=i), batch_model=batch_model) for i in (0, setup.pp - 1)),
                          key=lambda step: step.peak_bytes)
            else:
                plain = replace(setup, kv_dtype=None)
                hit = stored_as(per_gpu(self.workload(plain, batch_model=batch_model), plain), setup)
            self._per_gpu[setup] = hit
        return hit


@dataclass(frozen=True)
class RemedyGpu:
    """The GPU the remedies are for (``remedies.Gpu``): a setup the model cannot run there does not apply."""

    planner: Planner
    acc: Accelerator

    @property
    def bf16(self) -> bool:
        return self.acc.bf16  # no bf16 before Ampere

    def fit(self, setup: Setup, *, batch_model: bool = False) -> GpuFit:
        try:
            step = self.planner.per_gpu(setup, batch_model=batch_model)
        except GpuwiseError as exc:  # the model raised in a step the user did not ask for (bf16, LoRA...)
            raise NotApplicable(exc.message, exc.hint) from exc
        return fit_on(step, self.acc, timed=False)  # the remedies ask whether it fits, not how fast


def accumulation_peak(setup: Setup, live: np.ndarray, phases: tuple[str, ...]) -> int | None:
    """The peak of ``live`` (a step without accumulation) had the gradients been held through forward and backward:
    under accumulation every micro-batch after the first runs with all the gradients of the ones before alive
    (``zero_grad(set_to_none=True)`` frees them only after the optimizer step), and backward adds into them in
    place. Computed from this step's own timeline, not a second capture; None where it does not apply."""
    if not setup.training or setup.grad_accum > 1 or setup.optimizer_in_backward:
        return None
    g = CATEGORIES.index("gradients")
    held = live[:, g].max()
    passes = np.isin(np.asarray(phases), ("forward", "backward"))
    totals = live.sum(axis=1)
    totals[passes] += held - live[passes, g]
    return int(totals.max())


def _layout(step: PerGpu, n_layer: int | None) -> Layout | None:
    s = step.setup
    if not (s.parallel or s.ep > 1 or s.nodes > 1 or s.offload != "none"):
        return None
    return layout(s, n_layer, step.host_bytes)


def resolved_attention(source, setup: Setup) -> Setup:
    """``setup`` with the attention implementation its step runs (the source's: --attention, else an HF config's
    ``attn_implementation``, else SDPA), the one the kernel-time model prices; a model from a file runs its own."""
    if setup.attention is not None:
        return setup
    pick = getattr(source, "attention", None)
    return replace(setup, attention=pick(setup) if pick is not None else "sdpa")


def plan(source, setup: Setup, *, gpu: str | None = None, primary: str | None = None,
         catalog: Catalog | None = None, calibrations: dict[str, Calibration] | None = None) -> MemoryPlan:
    """Simulate ``setup`` for ``source`` and fit it on ``gpu`` (a catalog name) or on every catalog GPU, each with
    the step's time there (``GpuFit.step``: cost/step.py's StepTime, the figure recommend ranks by).

    ``max_batch`` and the remedies are for ``gpu``, else ``primary`` (this machine's GPU, say), else the H100 SXM.
    ``source`` is a source (sources/), or a zoo name or a model factory: ``plan(lambda: MyNet(), Setup())``.
    """
    source = as_source(source)  # a name or a model factory (Python API) is resolved here
    # a checkpoint's stored weight format is the default --weights (sources/checkpoint.py)
    setup, stored = stored_weights(source.name, getattr(source, "checkpoint", None), setup)
    catalog = catalog or load_catalog()
    primary_acc = catalog.get(gpu or primary or DEFAULT_GPU)
    if setup.spec.float8 and gpu and not primary_acc.fp8:
        raise GpuwiseError(f"--precision fp8 needs fp8 tensor cores (Ada, Hopper or newer): {primary_acc.name} has "
                           "none", "pass --precision bf16-mixed, or a GPU with fp8 (--gpu h100-sxm)")
    if setup.task == "decode" and setup.context is None:  # the plan names the context it chose
        source.check(setup)
        setup = replace(setup, context=source.context(setup))
    setup = resolved_attention(source, setup)
    planner = Planner(source)
    try:
        step = planner.per_gpu(setup, batch_model=True)
    except NotApplicable as exc:  # the user asked for it: LoRA on a model without linear layers in its blocks
        raise GpuwiseError(*exc.args) from exc
    w, tl, live = step.workload, step.timeline, step.live
    experts = getattr(source, "experts", None)
    i = int(live.sum(axis=1).argmax())
    phase, block = tl.labels[i]
    calibrations = calibrations or {}
    a2a = _all_to_all(step, experts, source.n_layer, primary_acc)
    fits = tuple(fit_on(step, acc, calibration=calibrations.get(acc.key), all_to_all=a2a)
                 for acc in ([primary_acc] if gpu else list(catalog)))
    mine = next((f for f in fits if f.gpu == primary_acc.key), None) or fit_on(
        step, primary_acc, calibration=calibrations.get(primary_acc.key),
        all_to_all=a2a)  # the table has it unless --gpu was elsewhere
    return MemoryPlan(
        model=w.model, setup=setup, params=w.params, trainable_params=w.trainable_params,
        flops_per_step=w.flops_per_step, bytes_per_step=w.bytes_per_step, tokens_per_step=w.tokens_per_step,
        peak_bytes=step.peak_bytes, overhead_bytes=OVERHEAD_BYTES, paged_bytes=step.paged_bytes,
        activations_bytes=int(live[tl.end_of_forward, CATEGORIES.index("activations")]) if setup.training else 0,
        breakdown={c: int(v) for c, v in zip(CATEGORIES, live[i], strict=True)},
        peak_at=phase if block is None or block < 0 else f"{phase}, block {block}",
        gpu=primary_acc.key, fits=mine.fits, max_batch=mine.max_batch, gpus=fits,
        remedies=remedies(setup, RemedyGpu(planner, primary_acc)) if not mine.fits else (),
        uncosted=w.uncosted, captured_blocks=w.captured_blocks,
        host_bytes=step.host_bytes, layout=_layout(step, source.n_layer),
        accumulation_peak_bytes=accumulation_peak(setup, live, tuple(ph for ph, _ in tl.labels)),
        timeline=live, timeline_phases=tuple(ph for ph, _ in tl.labels),
        decode=DecodeRead.of(step) if setup.task == "decode" else None,
        experts=experts, routing=routing_assumption(w, experts, setup),
        notes=tuple(n for n in (experts_note(setup, experts), stored) if n),
        all_to_all=a2a,
    )


def routing_assumption(w, experts: Experts | None, setup: Setup) -> str | None:
    """The routing assumption the plan rests on: the balanced stand-in where the model read the router's choice,
    else none is needed (grouped and batched expert matmuls cost the same for any split of the routed tokens);
    under --ep, balanced across the ranks; and what --moe-imbalance changed (planning/parallel/'s docstrings)."""
    stand_in = next((c.routing for group in w.captures for c in group if c.routing), None)
    if experts is None:
        return stand_in
    f, ep = setup.moe_imbalance, setup.ep
    if ep > 1:
        text = (f"{'balanced' if f == 1 else 'imbalanced'} across {ep} expert-parallel GPUs: each holds "
                f"{experts.experts // ep} of {experts.experts} experts")
        if f == 1:
            return text + (f" and receives as many routed rows as it sends, tokens x top-{experts.top_k} (its "
                           "experts' activations and FLOPs as without EP)")
        rank = hot_rank_factor(setup)
        return text + (f"; the busiest GPU's experts each get {f:g}x their balanced share (--moe-imbalance, a "
                       f"capacity factor), so it receives {rank:g}x tokens x top-{experts.top_k} rows (at most "
                       f"every GPU's, {ep}x): its experts' activations and FLOPs {rank:g}x, the plan's")
    if stand_in:
        return stand_in + ("" if f == 1 else f"; the busiest expert gets {f:g}x its share (--moe-imbalance), the "
                           "rest share what is left")
    text = (f"any split: each token's top-{experts.top_k} of {experts.experts} experts run as one grouped matmul, "
            "whose memory and FLOPs do not depend on which experts")
    return text + ("" if f == 1 else f"; --moe-imbalance {f:g} changes nothing on one GPU holding every expert")


def _all_to_all(step: PerGpu, experts: Experts | None, n_layer: int | None, acc=None) -> AllToAll | None:
    """--ep: what one GPU moves over a step in the all-to-alls of its MoE layers (parallel.expert.AllToAll),
    in the dtype the experts take (the captured residual stream's: fp32 under autocast over fp32 weights, 16-bit
    where the step computes with 16-bit parameters, as sharded runs do); the busiest GPU's under --moe-imbalance,
    the dispatch run again where --checkpointing recomputes the block; timed on ``acc`` where it has a link."""
    s, w = step.setup, step.workload
    if experts is None or s.ep == 1:
        return None
    layers = experts.layers
    if s.pp > 1 and n_layer:  # the plan's stage holds its blocks' share
        layers = layers * stage_layers(n_layer, s) // n_layer
    a2a = AllToAll(moe_layers=layers, tokens=w.tokens_per_step, top_k=experts.top_k, hidden=experts.hidden,
                   itemsize=w.setup.weight_dtype.itemsize, ep=s.ep, factor=hot_rank_factor(s),
                   dispatches=2 if s.checkpointing != "none" else 1)
    timed = None if acc is None else expert_parallel(a2a, acc, micro_batches=s.grad_accum, tp=s.tp)
    if timed is None:
        return replace(a2a, link=None if acc is None else f"not timed: {acc.name} has no link figure")
    return replace(a2a, seconds=timed.exposed_s, link=timed.basis)


def plan_model(model: Model | None, setup: Setup, *, hf_config: str | None = None, gpu: str | None = None,
               primary: str | None = None, catalog: Catalog | None = None,
               calibrations: dict[str, Calibration] | None = None) -> MemoryPlan:
    """``plan`` for ``--model NAME``, ``--model file.py:function``, a model factory, or ``--hf-config PATH_OR_ID``."""
    return plan(resolve_source(model, hf_config), setup, gpu=gpu, primary=primary, catalog=catalog,
                calibrations=calibrations)


def plan_here(model: Model | None, setup: Setup, *, environ: Mapping[str, str], hf_config: str | None = None,
              gpu: str | None = None, device: str | None = None) -> MemoryPlan:
    """``gpuwise plan``: ``plan_model`` with this machine's context (``where``)."""
    return plan_model(model, setup, hf_config=hf_config, **where(environ, gpu=gpu, device=device))


def where(environ: Mapping[str, str], *, gpu: str | None = None, device: str | None = None) -> dict:
    """The GPUs ``gpuwise plan`` fits on, as ``plan``'s keywords: ``gpu``, else (``primary``) ``device``'s (else the
    default device's) when the catalog knows it; stored calibrations (``gpuwise bench --calibrate``) replace the
    datasheet's rates for the GPUs they measured. The one decision plan and ``plan --solve`` (solve.py) share."""
    from gpuwise.hardware.calibration import stored_calibrations
    from gpuwise.hardware.device import local_machine, resolve_device

    primary = None
    if gpu is None:
        target = resolve_device(device, local_machine(environ))
        primary = target.row.key if target.row is not None and target.gpu else None
    elif device is not None:
        raise GpuwiseError("--gpu names a catalog GPU and --device this machine's: give one",
                           f"drop --device, or drop --gpu {gpu}")
    return {"gpu": gpu, "primary": primary, "calibrations": stored_calibrations(environ)}
