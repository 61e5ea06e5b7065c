"""One rank of an expert-parallel run (``--ep``) and the experts' share of ``--tp``, captured as they run.

The model stays plain PyTorch; these functions cut it from outside after it is built (gpt-fast's ``apply_tp``),
inside the fake mode, so the capture records what one rank allocates and computes.

Which modules are routed experts is experts.py's rule.

``--ep N`` (expert parallelism as torchtitan runs it: ``ExpertParallel`` in torchtitan/distributed/expert_parallel.py,
the EP mesh borrowed from the data- and context-parallel ranks, dp_shard x cp; DeepSpeed-MoE, Rajbhandari et al.
2022; Megatron-LM's ``--expert-model-parallel-size``): each rank holds E / N of every MoE layer's routed experts
(their stacked weight tensors cut along the expert dimension), the router, attention and shared experts whole;
with --tp too each of them is ffn / tp wide (expert tensor parallelism at the --tp degree, Megatron's etp = tp).
Its tokens' top-k rows go to the ranks holding their experts in an all-to-all (dispatch) and come back in another
(combine). Balanced routing sends each rank as many rows as it sends, tokens x k: its experts' activations and
FLOPs are those of the run without EP, their weights, gradients and optimizer states 1/N (and under FSDP they
shard over the dp_shard x cp / N ranks left, torchtitan's ``dp_shard_mod_ep``: sharding.py). Modelled as the
capture records it (``expert_parallel``): the experts module runs on the tokens it receives (its router's
choices mapped onto its E / N experts), and each all-to-all holds its send and receive buffers, tokens x k x
hidden each, live together while it runs and freed after (nothing of them is saved for backward: the experts'
grouped matmul saves the rows it received, as without EP); backward exchanges the gradients the same way.
``--moe-imbalance F`` (a capacity factor: no expert gets more than F times its balanced share of the routed rows,
Fedus et al. 2021 sec. 2.2, GShard's expert capacity): the plan is the busiest rank's, all of whose E / N experts
are at that bound, so it receives F x tokens x k rows (at most every rank's, N x tokens x k: min(F, N)), and its
experts' activations and FLOPs grow by as much. Without EP one GPU holds every expert and computes every routed
row whatever the split (a grouped matmul's memory and FLOPs do not depend on it); only a model that loops over
its experts (the routing stand-in of capture/routing.py) sees the busiest expert's F x share in its per-expert
buffers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.planning.experts import routed_modules
from gpuwise.planning.setup import Setup


def check_experts(source, setup: Setup) -> None:
    """--ep and --moe-imbalance against the model's routed experts (source.experts): one line each."""
    if setup.ep == 1 and setup.moe_imbalance == 1:
        return
    experts = getattr(source, "experts", None)
    flag = f"--ep {setup.ep}" if setup.ep > 1 else f"--moe-imbalance {setup.moe_imbalance:g}"
    if experts is None:
        raise GpuwiseError(f"{flag} applies to a Mixture-of-Experts model's routed experts; {source.name} has none",
                           f"drop {flag.split()[0]}")
    if experts.experts % setup.ep:
        fit = [n for n in range(2, experts.experts + 1) if experts.experts % n == 0]
        raise GpuwiseError(f"--ep {setup.ep} does not divide {source.name}'s {experts.experts} routed experts",
                           f"pass --ep {', '.join(map(str, fit[:8]))} (its divisors)" if fit else "drop --ep")
    most = experts.experts / experts.top_k  # every token's top-k on the busiest expert: it gets all the tokens
    if setup.moe_imbalance > most:
        raise GpuwiseError(f"--moe-imbalance {setup.moe_imbalance:g} is more than {source.name}'s busiest expert can "
                           f"get: every token, experts / top-k = {experts.experts} / {experts.top_k} = {most:g} "
                           "times its balanced share", f"pass --moe-imbalance between 1 and {most:g}")


def hot_rank_factor(setup: Setup) -> float:
    """The routed rows the plan's GPU receives over its balanced tokens x k: with --ep, every one of its experts at
    --moe-imbalance's bound, but never more than every rank's rows (ep x); without EP one GPU computes them all."""
    return min(setup.moe_imbalance, setup.ep) if setup.ep > 1 else 1.0


@dataclass(frozen=True, kw_only=True)
class AllToAll:
    """The all-to-alls of one GPU's step under --ep: what they move and how much.

    Per MoE layer and micro-batch a GPU runs a dispatch (its tokens x k rows out, the rows for its experts in) and a
    combine (the reverse) in forward, the same two in backward (the gradients, the other way), and the dispatch again
    where --checkpointing recomputes the block (``dispatches`` 2: torch's checkpoint recomputes up to the last tensor
    backward needs, the experts' saved inputs, so the combine after them is not run again; the capture runs it so).
    Balanced, each exchange moves ``unit`` = moe_layers x tokens x top_k x hidden x itemsize x (ep - 1) / ep bytes
    out of a GPU and as many in (of the rows it sends, the 1/ep whose experts it holds itself stay on the GPU:
    torchtitan's all_to_all_single hands them to itself). Under --moe-imbalance the plan's GPU is the busiest: it
    takes ``factor`` x as many rows in each dispatch and in the combine's backward, and sends as many back in the
    combine and the dispatch's backward; every exchange waits for it, so the time is ``exchanges x factor x unit``
    over the link."""

    moe_layers: int  # MoE layers on the GPU (its pipeline stage's)
    tokens: int  # the GPU's tokens over the step (every micro-batch)
    top_k: int
    hidden: int
    itemsize: int  # bytes an element, in the dtype the experts take
    ep: int
    factor: float = 1.0  # the busiest GPU's routed rows over its balanced tokens x k (hot_rank_factor)
    dispatches: int = 1  # forward dispatches a layer: 2 where checkpointing recomputes the block
    seconds: float | None = None  # the exchanges' time on the plan's GPU (cost.step.all_to_all_time), if timed
    link: str | None = None  # the link they are timed over, or why they are not

    @property
    def unit(self) -> float:
        """Bytes one balanced exchange sends out of a GPU over the step (all its MoE layers and micro-batches)."""
        return self.moe_layers * self.tokens * self.top_k * self.hidden * self.itemsize * (self.ep - 1) / self.ep

    @property
    def exchanges(self) -> int:
        """All-to-alls a MoE layer runs per micro-batch: dispatch and combine in forward and in backward, and the
        recomputed dispatches."""
        return self.dispatches + 1 + 2

    @property
    def bytes(self) -> int:
        """Bytes the plan's GPU sends over a step: its tokens' rows in each dispatch (forward and recomputed) and in
        the combine's backward, its experts' rows (``factor`` x) in the combine and the dispatch's backward."""
        return int(self.unit * (self.dispatches + 1 + 2 * self.factor))

    @property
    def received(self) -> int:
        """Bytes it receives: the other way round, ``factor`` x in each dispatch and in the combine's backward."""
        return int(self.unit * ((self.dispatches + 1) * self.factor + 2))

    @property
    def busiest(self) -> int:
        """The bytes the exchanges wait on: in each, the busiest GPU's ``factor`` x rows in or out."""
        return int(self.unit * self.exchanges * max(self.factor, 1.0))


def _exchange(like: torch.Tensor, send: int, receive: int, out: int) -> torch.Tensor:
    """One all-to-all on ``like``'s rows: its send and receive buffers (``send`` and ``receive`` rows) live together,
    then freed; the ``out`` rows it hands on."""
    buffers = like.new_empty((send, like.shape[1])), like.new_empty((receive, like.shape[1]))
    del buffers
    return like.new_empty((out, like.shape[1]))


class _Dispatch(torch.autograd.Function):
    """The dispatch all-to-all: this rank's ``tokens`` x k rows out, ``rows`` x k in (its send and receive buffers
    live together, then freed); given to the experts module as the ``rows`` tokens they are. Backward sends the
    received rows' gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        ctx.rows, ctx.k, ctx.tokens = rows, k, x.shape[0]
        return _exchange(x, x.shape[0] * k, rows * k, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.rows * ctx.k, ctx.tokens * ctx.k, ctx.tokens), None, None


class _Combine(torch.autograd.Function):
    """The combine all-to-all: the experts' outputs for the ``rows`` x k rows received go back, ``tokens`` x k rows
    come in; backward sends the output gradients to the experts' ranks."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
        ctx.rows, ctx.k, ctx.tokens = y.shape[0], k, tokens
        return _exchange(y, y.shape[0] * k, tokens * k, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.tokens * ctx.k, ctx.rows * ctx.k, ctx.rows), None, None


def _takes_router_choice(module: nn.Module) -> bool:
    """transformers' experts modules called with (hidden_states, top_k_index, top_k_weights)."""
    try:
        params = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)
    except (TypeError, ValueError):
        return False
    return params[1:4] == ["hidden_states", "top_k_index", "top_k_weights"]


def expert_parallel(model: nn.Module, setup: Setup, seq: int | None = None) -> None:
    """One rank of ``setup.ep``-way expert parallelism, in place (module docstring): every routed experts module
    holds E / ep of its E experts and runs between a dispatch and a combine all-to-all. ``seq``, the tokens of one
    sequence on the rank: the busiest rank's extra rows are rounded per sequence, so that they stay affine in the
    micro-batch (the batch model pairs captures at b and b + 1)."""
    ep, factor = setup.ep, hot_rank_factor(setup)
    routed = routed_modules(model)
    for name, module in routed:
        experts = getattr(module, "num_experts", None)
        if not _takes_router_choice(module) or not isinstance(experts, int) or experts % ep:
            raise GpuwiseError(f"--ep {ep}: {type(module).__name__} ({name}) is not an experts module the planner "
                               "can split (transformers' stacked experts, called with the router's top-k choice)",
                               "drop --ep")
        local = experts // ep
        for pname, p in list(module.named_parameters()):
            if p.dim() == 0 or p.shape[0] % experts:
                raise GpuwiseError(f"--ep {ep}: {name}.{pname} {tuple(p.shape)} is not stacked along its "
                                   f"{experts} experts", "drop --ep")
            owner, _, leaf = pname.rpartition(".")
            new = nn.Parameter(torch.empty((p.shape[0] // experts * local, *p.shape[1:]), dtype=p.dtype,
                                           device=p.device), requires_grad=p.requires_grad)
            setattr(module.get_submodule(owner) if owner else module, leaf, new)
        for sub in module.modules():  # the experts' own count (histc's bins, the loop over those hit)
            for attr in ("num_experts", "moe_num_experts"):
                if getattr(sub, attr, None) == experts:
                    setattr(sub, attr, local)
        inner = module.forward

        def forward(hidden_states, top_k_index, top_k_weights, *args, _inner=inner, _local=local, **kwargs):
            shape, k = hidden_states.shape, top_k_index.shape[-1]
            x = hidden_states.reshape(-1, shape[-1])
            tokens = x.shape[0]
            if seq and tokens % seq == 0:
                rows = tokens // seq * max(1, round(seq * factor))
            else:
                rows = max(1, round(tokens * factor))
            index, weights = top_k_index.reshape(tokens, k) % _local, top_k_weights.reshape(tokens, k)
            if rows != tokens:  # the busiest rank's rows: this rank's routing, repeated
                copies = -(-rows // tokens)
                index, weights = index.repeat(copies, 1)[:rows], weights.repeat(copies, 1)[:rows]
            out = _inner(_Dispatch.apply(x, rows, k), index, weights, *args, **kwargs)
            return _Combine.apply(out.reshape(rows, shape[-1]), tokens, k).reshape(shape)

        module.forward = forward
    if not routed:
        raise GpuwiseError(f"--ep {ep}: no routed experts found in {type(model).__name__}", "drop --ep")



# or not; JetMoE's input_linear), the second row-parallel (down; JetMoE's output_linear); a row-parallel bias is
# added once, after the all-reduce, so it stays whole
_EXPERT_COLUMN = frozenset({"gate_up_proj", "up_proj", "gate_proj", "input_linear"})
_EXPERT_ROW = frozenset({"down_proj", "output_linear"})
# the experts' own record of their FFN width, which some forwards view by (DBRX's ffn_hidden_size)
_EXPERT_WIDTHS = ("intermediate_dim", "intermediate_size", "expert_dim", "ffn_hidden_size")


def _expert_cut(module: nn.Module, pname: str, p: torch.Tensor) -> int | None:
    """The dimension of ``module.pname`` (a stacked experts tensor) that ``--tp`` cuts, None for one it leaves
    whole: transformers' ``[E, out, in]`` (``[E, in, out]`` where ``is_transposed``: GPT-OSS, Aria, Llama 4), a bias
    ``[E, out]``, DBRX's ``[E x ffn, hidden]`` for all three of w1, v1 and w2 (the expert index and the FFN width
    flattened together: dim 0), JetMoE's ``ParallelExperts.weight`` ``[E, out, in]`` named by its module."""
    owner, _, leaf = pname.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    role = leaf
    if leaf == "weight" and owner:  # JetMoE: input_linear.weight / output_linear.weight
        role = owner.rpartition(".")[2]
    if role in ("w1", "v1", "w2") and p.dim() == 2:  # DBRX: every matrix stacked [E x ffn, hidden]
        return 0
    bias = role.endswith("_bias")
    role = role.removesuffix("_bias")
    if role in _EXPERT_ROW:
        if bias:
            return None
        transposed = getattr(holder, "is_transposed", None)
        if transposed is None:  # Llama 4 stores [E, in, out] without saying so: down_proj [E, ffn, hidden]
            transposed = _transposed_by_shape(module)
        return 1 if transposed else 2
    if role in _EXPERT_COLUMN:
        if bias:
            return 1
        transposed = getattr(holder, "is_transposed", None)
        if transposed is None:
            transposed = _transposed_by_shape(module)
        return 2 if transposed else 1
    return None


def _transposed_by_shape(module: nn.Module) -> bool:
    """Whether gate_up_proj and down_proj are stored ``[E, in, out]``: gate_up's input is down's output (hidden)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return False
    return gate_up.shape[1] == down.shape[2] and gate_up.shape[2] != down.shape[1]


def shard_experts(module: nn.Module, name: str, tp: int) -> int:
    """One rank's share of a routed experts module under ``--tp`` (expert tensor parallelism, as Megatron-LM's
    ``--expert-tensor-parallel-size`` and torchtitan's ``TensorParallel`` on ``GroupedExperts`` run it), in place:
    every expert's gate and up matrices column-parallel and its down matrix row-parallel, so each rank holds every
    expert (or its --ep share) at ffn / tp wide, and runs every routed row through that slice: expert weights,
    activations and FLOPs / tp; the partial outputs are all-reduced as the dense MLP's. A fused ``gate_up_proj``
    ``[E, 2 ffn, hidden]`` becomes ``[E, 2 ffn / tp, hidden]``, whose two halves (gate, up) are each ffn / tp, as
    a rank holds them (torchtitan shards w1 and w3 apart; transformers' interleaved GPT-OSS layout, gate and up
    alternating, keeps its pairs). The number of tensors cut."""
    cut = 0
    for pname, p in list(module.named_parameters()):
        dim = _expert_cut(module, pname, p)
        if dim is None or p.dim() <= dim:
            continue
        if p.shape[dim] % tp:
            raise GpuwiseError(f"--tp {tp} does not divide {name}.{pname}'s {p.shape[dim]} features",
                               f"pass a --tp that divides {p.shape[dim]}")
        shape = list(p.shape)
        shape[dim] //= tp
        owner, _, leaf = pname.rpartition(".")
        new = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
        setattr(module.get_submodule(owner) if owner else module, leaf, new)
        cut += 1
    if cut:
        for sub in module.modules():  # the width the forward may view the matrices by (DBRX), or just records
            for attr in _EXPERT_WIDTHS:
                if isinstance(getattr(sub, attr, None), int) and not isinstance(getattr(sub, attr), bool):
                    setattr(sub, attr, getattr(sub, attr) // tp)
            if type(sub).__name__ == "JetMoeParallelExperts":  # its forward reads neither, but keep them true
                w = sub.weight
                sub.output_size, sub.input_size = w.shape[1], w.shape[2]
    return cut
