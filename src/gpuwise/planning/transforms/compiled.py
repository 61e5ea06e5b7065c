"""``--compile``: each block as ``torch.compile(block, fullgraph=True)`` runs it (torchtitan's ``apply_compile``),
simulated on fake tensors: AOTAutograd's graphs and saved tensors, and the kernels inductor fuses.

What is modelled:

- The graphs: each block's forward and backward traced by AOTAutograd (``aot_function`` over the block with its
  parameters as inputs) with inductor's decompositions (``select_decomp_table``), split by the partitioner
  inductor uses for training, ``min_cut_rematerialization_partition``: what it saves between forward and backward is
  what the step keeps (tagged activations by the planner's saved-tensor hook, as eager's are), and what it
  recomputes runs, with its FLOPs, in backward. An inference step (``--task infer``, run under ``no_grad``) is traced
  into one forward graph, unpartitioned, as ``torch.compile`` traces a module called without grad.
- Fusion: inductor's scheduler fuses chains of pointwise ops, and reductions with the pointwise ops around them, into
  one kernel whose intermediates live in registers. Here a node is fusible if its aten op carries
  ``torch.Tag.pointwise`` or ``torch.Tag.reduction``, is a seeded random op (inductor generates the random numbers
  inside the kernel: ``inductor_random`` in torch/_inductor/lowering.py), or is a copy or concatenation inductor
  lowers as pointwise or writes in place (``COPIES``: clone, _to_copy, convert_element_type, cat). Fusible nodes
  connected directly or through views form a group, unless a kernel outside the group would then sit on a path
  between two of its members (the kernels could not be ordered; inductor's ``will_fusion_create_cycle``).
  Everything else is a kernel of its own whose output materialises: matmuls, attention, collectives, and ops
  inductor may lower otherwise (gather, embedding, index: conservative). A fusible node's output materialises only
  if something outside its group (or the graph's output: the block's result, a saved tensor, a gradient) reads it,
  directly or through views; the others are computed (on fake tensors) and told to the tracker as never allocated
  (``Tracker.discount``).
- Activation checkpointing inside the graph, as ``torch.compile`` of a checkpointed block does (torchtitan applies
  AC, then compile): the joint graph's forward ops carry the ``recompute`` tags dynamo's checkpoint leaves for the
  partitioner (``tag_checkpointing``): all of them for ``full``, torchtitan's op policy for ``selective``; the
  partitioner then saves the block's inputs (and the policy's outputs) and recomputes the rest inside the backward
  graph, fused like the rest of it. Random ops it recomputes replay their generator state (16 bytes kept).

What is not modelled: inductor's memory planning (buffer reuse inside a graph beyond freeing at last use, as eager
frees), its choice to recompute a pointwise node in two consumer kernels instead of storing it (here it is stored:
conservative), matmul epilogue and prologue fusion (max-autotune templates), horizontal fusion of independent
kernels, cudagraphs (``mode="reduce-overhead"`` keeps a static pool), fusion across blocks or into the loss (only
the blocks are compiled, as torchtitan does; ``gpuwise train --compile`` compiles the whole model), layouts inductor
picks (the CPU attention kernel's layout is traced; the planner hands out CUDA's, so a copy the GPU would skip can
remain), and the bytes a fused kernel does not move (the cost model still counts every op's reads and writes; FLOPs
are exact: the min-cut partitioner recomputes only ops without FLOPs unless checkpointing asks for more), and a
decode step (inductor updates the KV cache in place; the traced graph would copy it whole: Setup refuses it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from gpuwise.compat import tree_flatten, tree_unflatten
from gpuwise.errors import GpuwiseError, first_line

aten = torch.ops.aten

# Copies inductor lowers as pointwise kernels (torch/_inductor/lowering.py: ``clone`` and ``_to_copy`` lower to a
# ``Pointwise``); they carry no pointwise tag of their own.
# ``cat`` of fused inputs is a pointwise concatenation (``pointwise_cat``) or a ``ConcatKernel`` its inputs write into
# (``realize_into``): either way its inputs get no buffers of their own.
COPIES = frozenset({aten.clone.default, aten._to_copy.default, aten.cat.default,
                    torch.ops.prims.convert_element_type.default})
# Attention kernels stay whole in inductor (extern kernels); the decomposition table would expand the CPU flash
# kernel into a math path that keeps the s x s matrix, which no GPU run does.
_KEEP_WHOLE = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def decompositions() -> dict:
    """Inductor's decompositions (what its graphs are made of), attention kernels left whole."""
    from torch._inductor.decomposition import select_decomp_table

    return {op: fn for op, fn in select_decomp_table().items() if not any(k in str(op) for k in _KEEP_WHOLE)}


# Ops that only name part of their input's storage; ``getitem`` picks one result of a multi-output op.
_VIEWS = frozenset({aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
                    aten.chunk.default})


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and (node.target.is_view or node.target in _VIEWS)


def _fusible(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    op = node.target
    tags = op.tags
    return (torch.Tag.pointwise in tags or torch.Tag.reduction in tags or op in COPIES
            or (torch.Tag.nondeterministic_seeded in tags and "rand" in op.name()))


def fused_away(graph: fx.Graph) -> set[fx.Node]:
    """The fusible nodes of ``graph`` whose outputs stay inside their fused kernel (see the module docstring)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    fusible = {n for n in nodes if _fusible(n)}
    # ancestors of each node as a bitset over ``nodes``; a group may not contain two members with a node outside the
    # group (a kernel: views and inputs are none) on a path between them, or the kernels could not be ordered
    anc = [0] * len(nodes)
    kernels = 0  # bitset: nodes that are kernels of their own (not views, inputs or outputs)
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            anc[i] |= anc[index[a]] | (1 << index[a])
        if n.op == "call_function" and not _is_view(n):
            kernels |= 1 << i

    group = {n: 1 << index[n] for n in fusible}  # root -> members bitset
    parent = {n: n for n in fusible}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def acyclic(members: int) -> bool:
        ancestors = 0
        rest = members
        while rest:
            low = rest & -rest
            ancestors |= anc[low.bit_length() - 1]
            rest ^= low
        outside = ancestors & kernels & ~members
        while outside:
            low = outside & -outside
            if anc[low.bit_length() - 1] & members:
                return False
            outside ^= low
        return True

    def through_views(n: fx.Node) -> fx.Node | None:
        """The fusible node a chain of views starts from, if any."""
        while _is_view(n):
            n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if n is None:
                return None
        return n if n in fusible else None

    for n in nodes:
        if n not in fusible:
            continue
        for a in n.all_input_nodes:
            src = through_views(a)
            if src is None:
                continue
            p, q = root(src), root(n)
            if p is q:
                continue
            merged = group[p] | group[q]
            if acyclic(merged):
                parent[p] = q
                group[q] = merged

    def readers(n: fx.Node) -> list[fx.Node]:
        """Who reads ``n``'s storage: its users, through views."""
        out = []
        for u in n.users:
            out.extend(readers(u) if _is_view(u) else [u])
        return out

    return {n for n in fusible
            if all(u in fusible and root(u) is root(n) for u in readers(n))}


class FusedInterpreter(fx.Interpreter):
    """Run an AOTAutograd graph op by op (on fake or real tensors); the outputs of fused-away nodes are handed to
    ``on_fused`` (the planner's tracker counts them as never allocated)."""

    def __init__(self, gm: fx.GraphModule, on_fused: Callable[[object], None] | None) -> None:
        super().__init__(gm)
        self.on_fused = on_fused
        self.fused = fused_away(gm.graph) if on_fused is not None else set()

    def call_function(self, target, args, kwargs):
        # The partitioner wraps random ops it recomputes in these to replay the generator's state; a simulated
        # step needs no replay: run the op itself (its state is a few bytes).
        from torch._prims import rng_prims

        if target is rng_prims.run_and_save_rng_state:
            return torch.zeros(16, dtype=torch.uint8), args[0](*args[1:], **kwargs)
        if target is rng_prims.run_with_rng_state:
            return args[1](*args[2:], **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n in self.fused:
            self.on_fused(out)
        return out


def _forward_nodes(joint: fx.Graph) -> list[fx.Node]:
    """The joint graph's forward: the ops that depend on no tangent (the incoming gradient)."""
    backward: set[fx.Node] = set()
    out = []
    for n in joint.nodes:
        if n.op == "placeholder":
            if "tangents" in n.name:
                backward.add(n)
            continue
        if any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        elif n.op == "call_function":
            out.append(n)
    return out


def tag_checkpointing(joint: fx.GraphModule, checkpointing: str) -> None:
    """Mark the joint graph's forward as checkpointing inside ``torch.compile`` does (the ``recompute`` tags that
    dynamo's ``tag_activation_checkpoint`` leaves for the partitioner): ``full`` recomputes every forward op in
    backward; ``selective`` is torchtitan's op policy (checkpointing.selective_policy): the outputs of the save list's
    ops are kept, except every second mm, and the rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from gpuwise.planning.transforms.checkpointing import selective_save_list

    save_list = selective_save_list()
    matmuls = (aten.mm.default, aten._scaled_mm.default)
    mms = 0
    for n in _forward_nodes(joint.graph):
        save = False
        if checkpointing == "selective":
            if n.target in matmuls:
                mms += 1
                save = mms % 2 == 1
            else:
                src = n.args[0] if n.target.__name__ == "getitem" and n.args else n
                save = getattr(src, "target", None) in save_list
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["ac_graph_id"] = 0


@dataclass
class CompiledBlocks:
    """The graphs each compiled block was traced into (one entry per distinct block and input signature)."""

    # [forward, backward] of each training trace run (an inference trace's one graph: its function's ``graphs``)
    graphs: list[list[fx.GraphModule]] = field(default_factory=list)
    on_fused: Callable[[object], None] | None = None  # the planner's tracker: counts these outputs as never allocated
    pause: Callable[[bool], None] | None = None  # the planner's tracker: stop (True) and resume recording


def _meta(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (type(x).__name__, tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    return ("V", repr(x))


# Traced blocks, shared by every block (and every capture) with the same structure, inputs and context: a 70B
# model's plan traces each distinct block once, not once per block and capture.
_TRACES: dict[tuple, Callable] = {}
_MAX_TRACES = 64


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_().requires_grad_(
        t.requires_grad)


def _first_call(fn: Callable, params: list[torch.Tensor], inputs: list[torch.Tensor],
                pause: Callable[[bool], None] | None) -> None:
    """Trace ``fn`` and compile its backward (now, not lazily in the step's backward) on stand-ins, unrecorded: the
    first call keeps its inputs alive for a while, and the step's own tensors must not be those."""
    if pause is not None:
        pause(True)
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            fn([_like(p) for p in params], *(_like(x) for x in inputs))
    finally:
        if pause is not None:
            pause(False)


def apply_compile(blocks: nn.ModuleList, *, checkpointing: str = "none", context: str = "",
                  decompose: bool = True) -> CompiledBlocks:
    """Run every block as the compiled graph AOTAutograd and inductor would make of it (``torch.compile(block)``),
    with ``checkpointing`` ("none", "full", "selective") applied inside the graph as torchtitan stacks them.

    A block is traced at its first call with a new input signature; blocks of the same structure, inputs and
    ``context`` (what else shapes the graph: the planner passes its Setup, whose precision sets autocast) share one
    trace, across captures too: a block whose ``forward`` was wrapped unlike its siblings' would run theirs (what
    differs at the ends of the stack goes in hooks, which run outside the traced forward: parallel/tensor.py's
    sequence parallelism). The planner sets ``CompiledBlocks.on_fused`` and ``pause`` to its tracker's.
    """
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.nn.utils.stateless import _reparametrize_module

    state = CompiledBlocks()
    table = decompositions() if decompose else {}

    def partition(joint: fx.GraphModule, inputs, **kwargs):
        if checkpointing != "none":
            tag_checkpointing(joint, checkpointing)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def trace(block: nn.Module, inner: Callable, names: list[str], leaves: list, spec, tensors: list[int]):
        fixed = [None if i in tensors else a for i, a in enumerate(leaves)]  # keeps none of the step's tensors

        def step(params, *xs):
            call = list(fixed)
            for i, x in zip(tensors, xs, strict=True):
                call[i] = x
            args, kwargs = tree_unflatten(call, spec)
            with _reparametrize_module(block, dict(zip(names, params, strict=True))):
                return inner(*args, **kwargs)

        def compiler(gm: fx.GraphModule, _example):
            def run(*inputs):
                return FusedInterpreter(gm, owner[0].on_fused).run(*inputs)

            return make_boxed_func(run)

        def forward_compiler(gm, example):
            graphs.append(gm)
            return compiler(gm, example)

        def backward_compiler(gm, example):
            graphs.append(gm)
            return compiler(gm, example)

        graphs: list[fx.GraphModule] = []
        owner = [state]  # the CompiledBlocks (so the tracker) of the capture running the graphs now
        fn = aot_function(step, forward_compiler, backward_compiler, partition_fn=partition, decompositions=table)
        fn.graphs, fn.owner = graphs, owner  # type: ignore[attr-defined]
        return fn

    for block in blocks:
        inner = block.forward
        names = [n for n, _ in block.named_parameters()]
        structure = (type(block).__qualname__, repr(block), checkpointing, context, decompose,
                     tuple((n, _meta(t)) for n, t in block.named_buffers()))

        def forward(*args, _block=block, _inner=inner, _names=names, _structure=structure, **kwargs):
            params = [p for _, p in _block.named_parameters()]
            leaves, spec = tree_flatten((args, kwargs))  # tensors anywhere in the call are the graph's inputs
            tensors = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
            key = (_structure, str(spec), tuple(_meta(a) for a in leaves),
                   tuple((n, _meta(p)) for n, p in zip(_names, params, strict=True)))
            fn = _TRACES.get(key)
            if fn is None:
                if len(_TRACES) >= _MAX_TRACES:
                    _TRACES.clear()
                try:
                    fn = trace(_block, _inner, _names, leaves, spec, tensors)
                    _first_call(fn, params, [leaves[i] for i in tensors], state.pause)
                except Exception as exc:
                    raise GpuwiseError(f"--compile: AOTAutograd could not trace {type(_block).__name__} "
                                       f"({first_line(exc)})", "drop --compile") from exc
                _TRACES[key] = fn
            fn.owner[0] = state  # a trace shared with an earlier capture now reports to this one (and its backward)
            out = fn(params, *(leaves[i] for i in tensors))
            if len(fn.graphs) == 2 and fn.graphs not in state.graphs:
                state.graphs.append(fn.graphs)
            return out

        block.forward = forward
    return state


def saved_bytes(forward: fx.GraphModule, outputs: int = 1, rounding: int = 1) -> int:
    """Bytes the partitioned forward graph hands to backward that it allocates itself (not its inputs): what the
    min-cut partitioner chose to save, read from the graph (each node's ``val`` metadata), each storage rounded up to
    ``rounding``. The first ``outputs`` results are the block's own."""
    out = next(n for n in forward.graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    total = 0
    for node in out.args[0][outputs:]:
        if not isinstance(node, fx.Node):
            continue
        base = node
        while _is_view(base) and base.target is not operator.getitem:  # one result of several is a storage
            base = base.args[0]
        if base.op == "placeholder" or base in seen:
            continue
        seen.add(base)
        val = base.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += -(-val.untyped_storage().nbytes() // rounding) * rounding
    return total
