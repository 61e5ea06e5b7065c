"""Run one real step of the model on fake tensors and record it with the Tracker.

The step is the one the user would run: forward, loss, backward, optimizer step. The optimizer steps once
beforehand (on zero gradients; or allocates the state that step would: optimizers.init_state), so its state
exists, and the step recorded is the steady state: with
``zero_grad(set_to_none=True)`` every point of step 2 holds at least what step 1 held.

GPU-specific choices (besides those in tracker.py and autocast.py):
- torch's optimizers run with ``foreach=True``, PyTorch's default for CUDA parameters (the CPU default
  is the per-parameter loop); foreach AdamW allocates a temporary the size of the optimizer's
  second moment (``_foreach_sqrt``) during the step. The others are in optimizers.py.
- ``--optimizer-in-backward`` gives each parameter its own optimizer, stepped by a hook as soon as its
  gradient is accumulated, which then frees the gradient (optimizers.in_backward).
- Mixed precision uses CUDA's autocast op lists (autocast.py), not the CPU's.
- With gradient accumulation two micro-batches are recorded: from the second one on, the
  gradients of the first are alive during forward and backward.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from gpuwise.compat import (
    FAKE_TENSOR_LOGGER,
    DataDependentOutputException,
    DynamicOutputShapeException,
    fake_tensor_mode,
    tree_leaves,
)
from gpuwise.errors import GpuwiseError, NotApplicable, first_line
from gpuwise.optim import param_groups
from gpuwise.planning.capture.autocast import CudaEmulation
from gpuwise.planning.capture.blocks import find_blocks
from gpuwise.planning.capture.optimizers import in_backward, init_state, make_optimizer, paged_tensors, state_tensors
from gpuwise.planning.capture.routing import ASSUMPTION, BalancedRouting
from gpuwise.planning.capture.tracker import ALLOCATOR_ROUND_BYTES, OpCosts, OpRows, Storages, Tracker
from gpuwise.planning.parallel.rank import rank_step
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Built
from gpuwise.planning.transforms.checkpointing import apply_checkpointing
from gpuwise.planning.transforms.compiled import apply_compile
from gpuwise.planning.transforms.float8 import apply_float8
from gpuwise.planning.transforms.lora import apply_lora, select_targets
from gpuwise.planning.transforms.quantize import quantize_weights


@dataclass(frozen=True, kw_only=True)
class Capture:
    """One recorded step at one batch size (and, for scaled models, one number of blocks)."""

    batch: int
    labels: tuple[tuple[str, int | None], ...]  # (phase, block) of each sample
    ops: tuple[str, ...]
    live: np.ndarray = field(repr=False)  # (samples, categories) bytes
    end_of_forward: int
    flops_per_step: int  # one optimizer step: grad_accum micro-batches
    bytes_per_step: int
    costs: OpCosts = field(repr=False, compare=False)  # per op, weighted to one optimizer step like the totals
    uncosted: dict[str, int]
    params: int
    trainable_params: int
    block_bytes: int  # parameters and buffers of the largest block: what FSDP gathers at once
    block_trainable_params: int  # trainable parameters of that block: what FSDP reduces at once
    measured_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated() over the step, on a real GPU
    # What the weighted figures above come from, so that a capture can be re-weighed for another accumulation,
    # cut to its first micro-batch, or paired with a capture at another batch size (scaling.capture_at):
    grad_accum: int = 1  # micro-batches per optimizer step the costs and totals are weighed for
    held: int = 1  # micro-batches recorded: min(grad_accum, 2)
    rows: OpRows | None = field(default=None, repr=False, compare=False)  # every op recorded, in order
    fb_ops: int = 0  # rows (and fb_samples: samples) before the optimizer step
    fb_samples: int = 0
    first_ops: int = 0  # rows (and first_samples: samples) of the first micro-batch's forward and backward
    first_samples: int = 0
    uncosted_first: dict[str, int] = field(default_factory=dict)  # uncosted ops of the first micro-batch
    uncosted_optimizer: dict[str, int] = field(default_factory=dict)
    storages: Storages | None = field(default=None, repr=False, compare=False)  # what ``live`` sums
    paged_bytes: int = 0  # optimizer state in paged memory (in the optimizer column too): it can spill to the host
    # (rows, bytes a row) of each nn.Embedding not tied to a linear layer (a tied one is read whole, as the head):
    # a decode step reads one row a sequence of it, not the table (serving.DecodeRead)
    embeddings: tuple[tuple[int, int], ...] = ()
    routing: str | None = None  # the stand-in for an MoE router's data-dependent choice, where one was needed
    # the block label of each row of ``rows`` (tracker.NO_BLOCK: none): a capture with fewer blocks pairs its rows
    # with this one's (scaling.fewer_blocks_at)
    row_blocks: np.ndarray | None = field(default=None, repr=False, compare=False)

    def reweighed(self, grad_accum: int) -> Capture:
        """The same recording weighed for ``grad_accum`` micro-batches a step (holding as many as this one)."""
        if min(grad_accum, 2) != self.held:
            raise ValueError(f"a capture holding {self.held} micro-batches cannot stand for accumulation {grad_accum}")
        if grad_accum == self.grad_accum:
            return self
        return replace(self, grad_accum=grad_accum, **weighed(self.rows, self.fb_ops, self.held, grad_accum))

    def first_pass(self) -> Capture:
        """The step without accumulation (one micro-batch, then the optimizer), cut out of a capture holding two:
        its first micro-batch runs from the same state, and the optimizer step that follows is the same."""
        if self.held == 1:
            return self
        keep = np.r_[0:self.first_samples, self.fb_samples:len(self.labels)]
        rows = OpRows.concat(self.rows[:self.first_ops], self.rows[self.fb_ops:])
        return replace(
            self, labels=tuple(self.labels[i] for i in keep), ops=tuple(self.ops[i] for i in keep),
            live=self.live[keep],
            grad_accum=1, held=1, rows=rows, fb_ops=self.first_ops, fb_samples=self.first_samples, storages=None,
            row_blocks=None,
            uncosted=dict(Counter(self.uncosted_first) + Counter(self.uncosted_optimizer)),
            **weighed(rows, self.first_ops, 1, 1))


def weighed(rows: OpRows, fb_ops: int, held: int, grad_accum: int) -> dict:
    """The step's FLOPs, bytes and per-op costs from the ops recorded: the forward and backward of ``held``
    micro-batches weighed for ``grad_accum``, the optimizer step once."""
    fb, opt = rows[:fb_ops], rows[fb_ops:]
    return dict(flops_per_step=int(fb.flops.sum()) * grad_accum // held + int(opt.flops.sum()),
                bytes_per_step=int(fb.bytes.sum()) * grad_accum // held + int(opt.bytes.sum()),
                costs=OpCosts.combine(fb.costs().scaled(grad_accum / held), opt.costs()))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype``: ``module.to(dtype)`` cannot swap fake parameters."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _hook_blocks(blocks: nn.ModuleList, tracker: Tracker) -> list:
    """Label samples with the block that runs them: forward hooks, and in backward a gradient hook on
    each block's output (it fires when that block's backward starts)."""

    def enter(i: int):
        def hook(_grad):
            tracker.block = i

        return hook

    handles = []
    for i, block in enumerate(blocks):
        def pre(_mod, args, i=i):
            if tracker.phase != "forward":
                return
            tracker.block = i
            x = args[0] if args else None
            if i == 0 and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(enter(-1))  # block 0's backward ends when its input's gradient is ready

        def post(_mod, _args, out, i=i):
            if tracker.phase != "forward":
                return
            tracker.block = None
            y = out[0] if isinstance(out, tuple) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(enter(i))

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    return handles


def _homes(blocks: nn.ModuleList | None, opts: list[torch.optim.Optimizer], kv_cache: list | None) -> dict[int, int]:
    """Storage id -> block, for each block's parameters, buffers, optimizer states and KV cache (Storages.home)."""
    homes: dict[int, int] = {}
    if blocks is None:
        return homes
    states = {id(p): [v for v in state.values() if isinstance(v, torch.Tensor)]
              for o in opts for p, state in o.state.items()}
    for i, block in enumerate(blocks):
        params = list(block.parameters())
        held = [*params, *block.buffers(), *(v for p in params for v in states.get(id(p), ())),
                *(kv_cache[i] if kv_cache else ())]
        homes.update((id(t.untyped_storage()), i) for t in held)
    return homes


def _state_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _make_optimizers(setup: Setup, model: nn.Module, params: list[nn.Parameter]) -> list[torch.optim.Optimizer]:
    """One optimizer over every trainable parameter, or under --optimizer-in-backward one per parameter."""
    # The trainer's groups: foreach AdamW steps each group on its own, so its sqrt temporary is the larger group's,
    # not all parameters'. The decay itself is in place (0.1 is TrainConfig's; any value costs the same).
    groups = [{"params": params}] if setup.optimizer == "sgd" else param_groups(model, weight_decay=0.1)
    if not setup.optimizer_in_backward:
        return [make_optimizer(setup.optimizer, groups)]
    return [make_optimizer(setup.optimizer, [{**g, "params": [p]}]) for g in groups for p in g["params"]]


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback before re-raising a failing op; we report the error in one line."""
    log = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _model_errors(name: str) -> Iterator[None]:
    """The model's own exceptions as one-line errors; fake tensors have no values to read."""
    try:
        yield
    except GpuwiseError:
        raise
    except DataDependentOutputException as exc:
        error = GpuwiseError(f"{name} reads a tensor's value ({exc.func}) while it runs",
                             "the plan runs on fake tensors without values: avoid .item() and data-dependent "
                             "branches in forward")
        error.while_running = True  # capture() tries again with concrete constants; a build's value read is final
        raise error from exc
    except Exception as exc:
        error = GpuwiseError(f"running {name} on fake tensors raised {first_line(exc)}",
                             "if one step runs on real tensors, an op's fake-tensor rule failed: report it with "
                             "GPUWISE_DEBUG=1's traceback")
        error.while_running = True
        raise error from exc


def _emulation(setup: Setup, device: str, *, autocast: bool, cache: bool):
    """What the forward (and its recomputation under checkpointing) runs in: on the CPU our emulation of
    CUDA (autocast lists, dropout); on a real GPU its own autocast."""
    if device == "cpu":
        return CudaEmulation(setup.compute_dtype if autocast else None, cache=cache)
    return torch.autocast(device, dtype=setup.compute_dtype) if autocast and cache else contextlib.nullcontext()


def capture(source, setup: Setup, *, batch: int, n_layer: int | None = None, device: str = "cpu",
            fake: bool = True) -> Capture:
    """Simulate ``setup`` at micro-batch ``batch`` (with ``n_layer`` blocks if given) and record one step.

    ``fake=False`` runs the same step for real on ``device`` (tests on the CPU; a GPU check on "cuda",
    which also reads ``torch.cuda.max_memory_allocated()``). A model that reads a fake tensor's value is recorded
    again with concrete twins of its constants (planning/capture/routing.py): a Mixture-of-Experts model that reads its
    router's choice under the balanced routing stand-in, a dense one that reads a constant it made (Longformer's
    all-ones mask, X-MOD's language ids) exactly. A value read neither answers fails as before, after both tries.
    """
    try:
        return _record(source, setup, batch=batch, n_layer=n_layer, device=device, fake=fake, routing=None)
    except GpuwiseError as exc:
        if not fake or not isinstance(exc.__cause__, (DataDependentOutputException, DynamicOutputShapeException)) \
                or not getattr(exc, "while_running", False):  # a build that reads a value reads it again
            raise
    skew = setup.moe_imbalance if setup.ep == 1 else 1.0  # under --ep the busiest rank's rows (parallel/expert.py)
    return _record(source, setup, batch=batch, n_layer=n_layer, device=device, fake=fake,
                   routing=BalancedRouting(skew))


def _record(source, setup: Setup, *, batch: int, n_layer: int | None, device: str, fake: bool,
            routing: BalancedRouting | None) -> Capture:
    """``capture``, with ``routing`` (if given) under the recorded step."""
    mode = fake_tensor_mode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode, _quiet_fake_tensor_log(), warnings.catch_warnings():
        # deepcopy of a fake parameter (nn.TransformerEncoder clones its layer) warns about data pointers
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        # Frozen weights (LoRA base, inference) need no fp32 master copy: they are stored in the compute dtype;
        # QLoRA as PEFT prepares it (prepare_model_for_kbit_training) holds every weight not in 4 bits in fp32.
        frozen_dtype = setup.compute_dtype
        build_dtype = (setup.weight_dtype if setup.task == "train" else torch.float32 if setup.peft_qlora
                       else frozen_dtype)
        # Only building runs under the device context: it is a torch-function mode, and checkpointing's
        # early stop raises through whatever modes are active during recomputation.
        with default_dtype(build_dtype), torch.device(device):
            built: Built = source.build(setup, batch, n_layer)
            built = rank_step(built, setup)  # one GPU's slice under --tp/--pp (planning/parallel/)
        model = built.model
        params = sum(p.numel() for p in model.parameters())
        blocks = find_blocks(model)
        if setup.task == "finetune-lora":
            # PEFT keeps adapters in fp32 over a 4-bit base (autocast_adapter_dtype); the depth lets targets
            # that differ between blocks send the plan to a whole-model capture (transforms.UnevenTargets)
            apply_lora(model, blocks, rank=setup.lora_rank,
                       adapter_dtype=torch.float32 if setup.peft_qlora else setup.weight_dtype,
                       quantize_base=setup.qlora, compute_dtype=setup.compute_dtype, targets=setup.lora_targets,
                       dropout=setup.lora_dropout, depth=source.n_layer if n_layer is not None else None)
        if setup.spec.float8:  # --precision fp8: torchao's Float8Linear for every linear layer but the head
            apply_float8(model, setup.compute_dtype, select_targets(model, blocks, None)[2])
        compiled = None
        if setup.compile:  # each block compiled, with checkpointing inside its graph (planning/transforms/compiled.py)
            if blocks is None:
                raise NotApplicable("--compile compiles each repeated block (torchtitan's apply_compile), and the "
                                    "model has none (an nn.ModuleList)",
                                    "put the layers in an nn.ModuleList, or drop --compile")
            compiled = apply_compile(blocks, checkpointing=setup.checkpointing, context=repr(setup))
        if setup.training and setup.checkpointing != "none" and not setup.compile:  # compiled: inside the graph
            if blocks is None:
                raise NotApplicable(f"--checkpointing {setup.checkpointing}: the model has no repeated blocks (an "
                                    "nn.ModuleList)",
                                    "put the layers in an nn.ModuleList, or pass --checkpointing none")
            # torch.utils.checkpoint restores real autocast by itself; our emulation must be re-entered. What the
            # selective policy keeps is held by the checkpoint, not autograd: tagged as activations here.
            apply_checkpointing(blocks, lambda: _emulation(setup, device, autocast=mixed, cache=False),
                                selective=setup.checkpointing == "selective",
                                on_saved=lambda out: tracker.tag(tree_leaves(out), "activations"), allow_mutation=True)
        if setup.quantized:  # --weights: the blocks' linear layers as the serving library stores them
            quantize_weights(blocks, setup.weights, setup.compute_dtype, model_name=source.name)
        if not setup.training:
            model.eval()  # BatchNorm uses its running statistics, dropout is off
        largest = max(blocks, key=_state_bytes) if blocks is not None else nn.Module()
        block_bytes = _state_bytes(largest)
        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        embeddings = tuple((m.num_embeddings, m.embedding_dim * m.weight.element_size()) for m in model.modules()
                           if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights)
        # inference trains nothing, whatever requires_grad says (modules are built with it on)
        block_trainable = sum(p.numel() for p in largest.parameters() if p.requires_grad) if setup.training else 0
        trainable = [p for p in model.parameters() if p.requires_grad] if setup.training else []
        if setup.training and not trainable:
            raise GpuwiseError("the model has no trainable parameters", "plan --task infer, or unfreeze some weights")
        mixed = setup.mixed and setup.training
        kv_cache = None
        if built.kv_cache_shape is not None:
            n_blocks = len(blocks) if blocks is not None else 0
            kv_cache = [(torch.zeros(built.kv_cache_shape, dtype=frozen_dtype, device=device),
                         torch.zeros(built.kv_cache_shape, dtype=frozen_dtype, device=device)) for _ in range(n_blocks)]

        tracker = Tracker()
        if compiled is not None:
            compiled.on_fused = tracker.discount
            compiled.pause = lambda on: setattr(tracker, "paused", on)
        opts = _make_optimizers(setup, model, trainable) if setup.training else []
        # --optimizer-in-backward: each parameter's own optimizer, stepped by a hook during backward
        per_param = {o.param_groups[0]["params"][0]: o for o in opts} if setup.optimizer_in_backward else None

        def forward() -> torch.Tensor:
            tracker.phase, tracker.block = "forward", None
            def saved(t: torch.Tensor) -> torch.Tensor:
                tracker.tag(t, "activations")  # what autograd keeps for backward
                return t

            with (_emulation(setup, device, autocast=mixed, cache=True),
                  torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t), _model_errors(source.name)):
                out = built.run(model, built.inputs, built.targets, kv_cache)
            if built.cache_tensors is not None:  # a cache the model allocated itself (transformers' DynamicCache)
                tracker.tag(built.cache_tensors(out), "kv_cache")
            tracker.mark("end_of_forward")
            return out

        def backward(loss: torch.Tensor) -> None:
            tracker.phase = "backward"
            stepping = (in_backward(per_param, on_grad=lambda p: tracker.tag(p.grad, "gradients"))
                        if per_param is not None else contextlib.nullcontext())
            with _model_errors(source.name), stepping:
                loss.backward()
            tracker.block = None
            tracker.tag([p.grad for p in trainable], "gradients")

        def optimizer_step() -> None:
            tracker.phase, tracker.block = "optimizer", None
            if per_param is None:  # in backward, every parameter has stepped already
                for i, block in enumerate(blocks if blocks is not None else ()):  # per-parameter ops get labels
                    for p in block.parameters():
                        tracker.own([p, p.grad, *(v for o in opts for v in o.state.get(p, {}).values())], i)
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                tracker.block = None

        if setup.training:  # step 1, not recorded, creates the optimizer state; its gradients need no backward
            for p in trainable:
                p.grad = torch.zeros_like(p)
            for opt in opts:
                init_state(opt)
                opt.zero_grad(set_to_none=True)

        handles = _hook_blocks(blocks, tracker) if blocks is not None else []
        tracker.homes = _homes(blocks, opts, kv_cache)
        tracker.tag(list(model.parameters()) + list(model.buffers()), "weights")
        tracker.tag([*built.inputs, built.targets], "inputs")
        if kv_cache is not None:
            tracker.tag([t for pair in kv_cache for t in pair], "kv_cache")
        if built.kv_filled is not None:
            tracker.tag(built.kv_filled(), "kv_cache")
        tracker.tag(state_tensors(opts), "optimizer")
        tracker.homes = None
        paged = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in paged_tensors(opts)}
        paged_bytes = sum(-(-n // ALLOCATOR_ROUND_BYTES) * ALLOCATOR_ROUND_BYTES for n in paged.values())
        micro = min(setup.grad_accum, 2)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with routing or contextlib.nullcontext(), tracker:
            if setup.training:
                backward(forward())
                end_of_forward = tracker.marks["end_of_forward"]  # of the first micro-batch
                first_ops, first_samples, uncosted_first = tracker.n_ops, len(tracker.labels), dict(tracker.uncosted)
                for _ in range(micro - 1):
                    backward(forward())
                fb_ops, fb_samples, uncosted_fb = tracker.n_ops, len(tracker.labels), Counter(tracker.uncosted)
                optimizer_step()
            else:
                with torch.no_grad():
                    forward()
                fb_ops, fb_samples, uncosted_fb = tracker.n_ops, len(tracker.labels), Counter(tracker.uncosted)
                first_ops, first_samples, uncosted_first = fb_ops, fb_samples, dict(uncosted_fb)
                end_of_forward = tracker.marks["end_of_forward"]
        for h in handles:
            h.remove()
        measured = torch.cuda.max_memory_allocated() if device == "cuda" else None
        rows, storages = tracker.op_rows(), tracker.storages()
        return Capture(
            batch=batch, labels=tuple(tracker.labels), ops=tuple(tracker.ops),
            live=storages.timeline(len(tracker.labels)), end_of_forward=end_of_forward,
            **weighed(rows, fb_ops, micro, setup.grad_accum),
            uncosted=dict(tracker.uncosted), params=params, trainable_params=sum(p.numel() for p in trainable),
            block_bytes=block_bytes, block_trainable_params=block_trainable, measured_peak_bytes=measured,
            grad_accum=setup.grad_accum, held=micro, rows=rows, fb_ops=fb_ops, fb_samples=fb_samples,
            first_ops=first_ops, first_samples=first_samples, uncosted_first=uncosted_first,
            uncosted_optimizer=dict(Counter(tracker.uncosted) - uncosted_fb), storages=storages,
            paged_bytes=paged_bytes, embeddings=embeddings, routing=ASSUMPTION if routing and routing.used else None,
            row_blocks=tracker.op_blocks(),
        )
