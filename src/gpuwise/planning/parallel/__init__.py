"""One GPU's slice of a tensor-, pipeline- or context-parallel run, captured as it runs (not a formula after).

The model stays plain PyTorch; these functions cut it from outside after it is built (gpt-fast's ``apply_tp``),
inside the fake mode, so the capture records what one rank allocates and computes:

- ``--tp N`` (Megatron-LM, Shoeybi et al. 2019 sec. 3; torchtitan's ``parallelize_llama``): in every block the
  first linear layer of each pair is column-parallel (q, k, v, gate, up: output features / N), the second
  row-parallel (o, down: input features / N), so each rank runs heads / N (and kv heads / N) and ffn / N (a
  Mixture-of-Experts' routed experts too, transformers' stacked 3-D tensors: every expert ffn / N wide, every routed
  row through each rank's slice, as Megatron-LM's expert tensor parallelism and torchtitan's TensorParallel on
  GroupedExperts run them: ``shard_experts``); the
  residual stream, the norms and the row-parallel outputs stay whole (they are all-reduced: Korthikanti et al.
  2022 Table 2, ``sbh(10 + 24/t + 5as/(ht))``; no sequence parallelism). The token embedding and the LM head are
  vocabulary-parallel (vocab / N rows each, ``ceil``), as Megatron and torchtitan (``loss_parallel``) run them:
  the logits and the cross-entropy's fp32 copies are vocab / N wide, which at a 128k vocabulary is most of the
  step's temporaries. Learned positions (GPT's ``wpe``) stay replicated.
  With ``sp`` (sequence parallelism, as torchtitan's TP plan runs it: SequenceParallel norms, PrepareModuleInput
  all-gathers): between the attention and MLP the residual stream, the norms and their saved inputs are s / N tokens;
  each all-gathers its input (saved whole by the column-parallel linears, as DTensor's all-gather feeds F.linear)
  and reduce-scatters its output. Per GPT layer without dropout, flash attention: sbh(4 + 28/t) bytes, where
  Megatron's own SP, which saves the shard and gathers again in backward, keeps Korthikanti's sbh(32/t).
- ``--pp N`` with the 1F1B schedule (Narayanan et al. 2021): a stage holds ``layers / N`` blocks; the first also the
  embedding, the last the final norm, the head and the loss. A stage's output is sent on and its tensor freed
  (Megatron's ``deallocate_output_tensor``): the first stage's capture stops after its last block and takes its
  output gradient from the next stage in backward; the last stage's starts from a received activation. Stage i
  holds ``min(N - i, micro-batches)`` micro-batches' activations at once (``in_flight``); the first stage, with the
  most in flight, or the last, with the head, is the worst, and the plan reports that one.
- ``--cp N`` (ring attention as torchtitan runs it: torch.distributed.tensor.experimental.context_parallel; Liu et
  al. 2023): each rank holds s / N tokens (inputs, positions, every activation), and SDPA runs as the ring does:
  N flash-attention steps against the K/V chunk received from the previous rank (a receive buffer each, K and V),
  the first on its own chunk (causal), the others, load-balanced (head-tail sharding), on half a chunk each, the
  partial outputs merged by their logsumexp; saved for backward: the local q, k, v, the output and the logsumexp;
  backward passes the K/V chunks around again with their dK/dV accumulators. So attention FLOPs per rank are 1/N
  of the whole causal attention. The model states shard over the data- and context-parallel ranks together
  (torchtitan's ``dp_shard_cp`` mesh: context-parallel ranks hold the same parameters).
- ``--ep N`` (expert parallelism as torchtitan runs it: ``ExpertParallel`` in torchtitan/distributed/expert_parallel.py,
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
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.planning.setup import Setup

# The linear layers of a block, as each model spells them: the first of each pair column-parallel, the second
# row-parallel (zoo Llama: wq wk wv w1 w3 / wo w2; zoo GPT and its attention's packed q,k,v: c_attn c_fc / c_proj;
# Hugging Face decoders: q_proj k_proj v_proj gate_proj up_proj / o_proj down_proj).
COLUMN = frozenset({"wq", "wk", "wv", "w1", "w3", "c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj",
                    "up_proj"})
ROW = frozenset({"wo", "w2", "c_proj", "o_proj", "down_proj"})
HEADS = ("n_head", "n_kv_head", "num_heads", "num_key_value_heads")  # attributes a block's attention may size by
# (embeddings, final norm, head) of the built-in decoders; Hugging Face models say theirs themselves
_ENDS = {"Llama": (("tok_embeddings",), "norm", "output"), "GPT": (("wte", "wpe"), "ln_f", "lm_head")}
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def stage_layers(n_layer: int, setup: Setup) -> int:
    """Blocks on ``setup.stage`` (the first stages take one more when ``pp`` does not divide the layers)."""
    stage = setup.stage or 0
    return n_layer // setup.pp + (1 if stage < n_layer % setup.pp else 0)


def in_flight_micro_batches(setup: Setup) -> int:
    """Micro-batches whose activations stage ``setup.stage`` holds at once under 1F1B: ``pp - stage`` (the
    warm-up forwards before its first backward), at most the micro-batches of a step (``grad_accum``)."""
    if setup.pp == 1:
        return 1
    return max(1, min(setup.pp - (setup.stage or 0), setup.grad_accum))


def check(source, setup: Setup) -> None:
    """What the model must allow: blocks to split, heads that divide, as many layers as stages, experts to split.
    One line each."""
    check_experts(source, setup)
    if not setup.parallel:
        return
    flags = " ".join(f"--{k} {n}" for k, n in (("tp", setup.tp), ("pp", setup.pp), ("cp", setup.cp)) if n > 1)
    if source.n_layer is None:
        raise GpuwiseError(f"{flags} splits a stack of blocks, and {source.name} has none the planner can scale",
                           f"drop {flags}, or plan a built-in decoder or an --hf-config causal LM")
    if setup.pp > source.n_layer:
        raise GpuwiseError(f"--pp {setup.pp} is more stages than {source.name}'s {source.n_layer} layers",
                           f"pass --pp {source.n_layer} or less")
    if setup.cp > 1:
        seq = source.tokens(setup)
        if source.decoder is None:
            raise GpuwiseError(f"--cp {setup.cp} splits a causal LM's sequence; {source.name} is not one",
                               "drop --cp, or plan a built-in GPT/Llama or an --hf-config causal LM")
        if seq % (2 * setup.cp):
            raise GpuwiseError(f"--cp {setup.cp} does not split --seq {seq} into 2 x {setup.cp} equal chunks "
                               "(load-balanced ring attention)", f"pass a --seq that is a multiple of {2 * setup.cp}")
    if setup.sp:
        seq = source.tokens(setup)
        if (seq // setup.cp) % setup.tp:  # each context-parallel rank's s / cp tokens, split --tp ways
            step = math.lcm(setup.tp * setup.cp, 2 * setup.cp if setup.cp > 1 else 1)
            near = max(step, round(seq / step) * step)
            raise GpuwiseError(f"--sequence-parallel splits --seq {seq}"
                               + (f" / --cp {setup.cp}" if setup.cp > 1 else "")
                               + f" over --tp {setup.tp}, which does not divide it",
                               f"pass --seq {near} (a multiple of {step}), or drop --sequence-parallel")
    if setup.tp > 1:
        dec = source.decoder
        if dec is None:
            raise GpuwiseError(f"--tp {setup.tp} splits attention heads; {source.name} is not a decoder language model",
                               "drop --tp, or plan a built-in GPT/Llama or an --hf-config causal LM")
        for what, n in (("attention heads", dec.heads), ("key/value heads", dec.kv_heads)):
            if n % setup.tp:
                ok = [t for t in range(1, n + 1) if n % t == 0 and dec.heads % t == 0 and dec.kv_heads % t == 0]
                raise GpuwiseError(f"--tp {setup.tp} does not divide {source.name}'s {n} {what}",
                                   f"pass --tp {max(t for t in ok if t <= setup.tp)} (it divides: "
                                   f"{', '.join(map(str, ok))})")


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
    seconds: float | None = None  # the exchanges' time on the plan's GPU (costmodel.all_to_all_time), if timed
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


def _routed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed experts modules (source.experts_of's: named ``experts`` or of an ``...Experts`` class), outermost."""
    found = [(name, m) for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] == "experts" or type(m).__name__.endswith("Experts")]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]


def moe_layers(model: nn.Module) -> int:
    """The MoE layers of ``model``: modules holding routed experts (JetMoE's two expert linears count once)."""
    return len({name.rpartition(".")[0] for name, _ in _routed_modules(model)})


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
    routed = _routed_modules(model)
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


def rank_step(built, setup: Setup):
    """``built`` (a source's Built, inside the fake mode) cut to what one GPU of ``setup`` runs."""
    if setup.ep > 1:
        ids = built.inputs[0] if built.inputs else None
        seq = ids.shape[1] // setup.cp if ids is not None and ids.dim() == 2 and not ids.is_floating_point() else None
        expert_parallel(built.model, setup, seq)
    if setup.tp > 1:
        shard_tensor_parallel(built.model, setup.tp)
        if setup.sp:
            sequence_parallel(built.model, setup.tp)
    if setup.pp > 1:
        built = pipeline_stage(built, setup.stage or 0, setup.pp)
    if setup.cp > 1:
        built = context_parallel(built, setup.cp)
    return built


def _linear(old: nn.Linear, in_features: int, out_features: int, split_bias: bool) -> nn.Linear:
    new = nn.Linear(in_features, out_features, bias=old.bias is not None, dtype=old.weight.dtype,
                    device=old.weight.device)
    if old.bias is not None and not split_bias:  # a row-parallel bias is added once, after the all-reduce: whole
        new.bias = nn.Parameter(torch.empty(old.out_features, dtype=old.bias.dtype, device=old.bias.device))
    new.weight.requires_grad_(old.weight.requires_grad)
    return new


def _ends(model: nn.Module) -> tuple[tuple[str, ...], str | None, str | None]:
    """Qualified names of the embedding(s), the final norm and the head of a decoder LM."""
    if type(model).__name__ in _ENDS:
        return _ENDS[type(model).__name__]
    names = {id(m): n for n, m in model.named_modules()}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = names.get(id(get_in())) if callable(get_in) else None
    head = names.get(id(get_out())) if callable(get_out) and get_out() is not None else None
    base = emb.rsplit(".", 1)[0] + "." if emb and "." in emb else ""
    norm = next((base + n for n in _FINAL_NORMS if base + n in dict(model.named_modules())), None)
    return ((emb,) if emb else ()), norm, head


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def shard_tensor_parallel(model: nn.Module, tp: int) -> None:
    """One rank's model of a ``tp``-way Megatron split, in place (see the module docstring)."""
    from gpuwise.planning.transforms import find_blocks

    blocks = find_blocks(model)
    split = 0
    for block in blocks or ():
        for name, mod in list(block.named_modules()):
            leaf = name.rpartition(".")[2]
            if isinstance(mod, nn.Linear) and leaf in COLUMN | ROW:
                n = mod.out_features if leaf in COLUMN else mod.in_features
                if n % tp:
                    raise GpuwiseError(f"--tp {tp} does not divide {name}'s {n} features",
                                       f"pass a --tp that divides {n}")
                _swap(block, name, _linear(mod, mod.in_features // (1 if leaf in COLUMN else tp),
                                           mod.out_features // (tp if leaf in COLUMN else 1), leaf in COLUMN))
                split += 1
            for attr in HEADS:
                if isinstance(getattr(mod, attr, None), int) and not isinstance(mod, nn.Linear):
                    setattr(mod, attr, getattr(mod, attr) // tp)
    for name, module in _routed_modules(model):  # the stacked experts: expert tensor parallelism
        split += shard_experts(module, name, tp)
    if not split:
        raise GpuwiseError(f"--tp {tp}: no q/k/v/o or MLP linear layers found in {type(model).__name__}'s blocks",
                           "drop --tp; tensor parallelism is planned for Llama- and GPT-style decoders")
    embs, _norm, head = _ends(model)
    tied = head is not None and embs and model.get_submodule(head).weight is model.get_submodule(embs[0]).weight
    rows = None
    if embs:
        old = model.get_submodule(embs[0])
        rows = math.ceil(old.num_embeddings / tp)
        new_emb = nn.Embedding(rows, old.embedding_dim, dtype=old.weight.dtype, device=old.weight.device)
        _swap(model, embs[0], new_emb)
    if head is not None:
        old = model.get_submodule(head)
        rows = math.ceil(old.out_features / tp)
        new_head = _linear(old, old.in_features, rows, True)
        if tied:
            new_head.weight = new_emb.weight
        _swap(model, head, new_head)
    config = getattr(model, "config", None)  # transformers' loss views the logits by config.vocab_size
    if rows is not None and config is not None and isinstance(getattr(config, "vocab_size", None), int):
        config.vocab_size = rows
    if rows is not None and isinstance(getattr(model, "vocab_size", None), int):  # or by its own (Mixtral's)
        model.vocab_size = rows


# The routed experts' stacked matrices (transformers 5): the first of each pair column-parallel (gate and up, fused
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


SUBLAYERS = frozenset({"attention", "feed_forward", "attn", "mlp", "self_attn"})  # what runs on the whole sequence


class _Gather(torch.autograd.Function):
    """All-gather along the sequence (dim 1); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: int) -> torch.Tensor:
        ctx.t = t
        return x.new_empty((x.shape[0], x.shape[1] * t, *x.shape[2:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty((grad.shape[0], grad.shape[1] // ctx.t, *grad.shape[2:])), None


class _Scatter(torch.autograd.Function):
    """Reduce-scatter along the sequence (dim 1); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: int) -> torch.Tensor:
        ctx.t = t
        return x.new_empty((x.shape[0], x.shape[1] // t, *x.shape[2:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty((grad.shape[0], grad.shape[1] * ctx.t, *grad.shape[2:])), None


def _first_tensor(args, kwargs, change):
    """``args`` and ``kwargs`` with the hidden states (the first positional, else ``hidden_states``) changed."""
    if args:
        return (change(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}


def sequence_parallel(model: nn.Module, tp: int) -> None:
    """The residual stream between the blocks' attention and MLP split ``tp`` ways along the sequence (module
    docstring), in place: the first block scatters its input, the last gathers its output for the head."""
    from gpuwise.planning.transforms import find_blocks

    blocks = find_blocks(model) or []
    for block in blocks:
        for name, sub in block.named_children():
            if name not in SUBLAYERS:
                continue

            def forward(*args, _inner=sub.forward, **kwargs):
                args, kwargs = _first_tensor(args, kwargs, lambda x: _Gather.apply(x, tp))
                out = _inner(*args, **kwargs)
                if isinstance(out, tuple):
                    return (_Scatter.apply(out[0], tp), *out[1:])
                return _Scatter.apply(out, tp)

            sub.forward = forward
    if not blocks:
        return
    first, last = blocks[0], blocks[-1]
    inner_first = first.forward

    def scatter_in(*args, **kwargs):
        args, kwargs = _first_tensor(args, kwargs, lambda x: _Scatter.apply(x, tp))
        return inner_first(*args, **kwargs)

    first.forward = scatter_in
    inner_last = last.forward

    def gather_out(*args, **kwargs):
        out = inner_last(*args, **kwargs)
        if isinstance(out, tuple):
            return (_Gather.apply(out[0], tp), *out[1:])
        return _Gather.apply(out, tp)

    last.forward = gather_out


class _StageEnd(Exception):
    """Raised with the last block's output where a non-final pipeline stage stops."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("end of the pipeline stage")
        self.x = x


class _Stop(nn.Module):
    """Stands where the final norm was: the stage sends its input on."""

    def forward(self, x, *args, **kwargs):
        raise _StageEnd(x)


class _Send(torch.autograd.Function):
    """The stage's output goes to the next stage (its tensor freed); in backward its gradient comes back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.meta = (x.shape, x.dtype, x.device)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> torch.Tensor:
        shape, dtype, device = ctx.meta
        return torch.empty(shape, dtype=dtype, device=device)  # the receive buffer


class _Recv(torch.autograd.Function):
    """The previous stage's activation arrives; its gradient is sent back (and freed) in backward."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=anchor.device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return torch.zeros((), device=_grad.device), None, None


class _Received(nn.Module):
    """Stands where an embedding was: gives the activation the previous stage sent (the first), or nothing (0)."""

    def __init__(self, dim: int, dtype: torch.dtype, first: bool) -> None:
        super().__init__()
        self.dim, self.dtype, self.first = dim, dtype, first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shape = (*idx.shape, self.dim)
        if not self.first:  # learned positions: the first stage added them already
            return torch.zeros((), dtype=self.dtype, device=idx.device)
        anchor = torch.zeros((), device=idx.device, requires_grad=True)
        return _Recv.apply(anchor, shape, self.dtype)


def pipeline_stage(built, stage: int, pp: int):
    """``built`` (already holding this stage's blocks) as pipeline stage ``stage`` of ``pp`` runs it."""
    model = built.model
    embs, norm, head = _ends(model)
    if not embs or norm is None or head is None:
        raise GpuwiseError(f"--pp {pp}: cannot tell the embedding, final norm and head of {type(model).__name__}",
                           "drop --pp; pipeline stages are planned for Llama- and GPT-style decoders")
    last = stage == pp - 1
    if stage > 0:  # the embedding lives on the first stage
        for i, name in enumerate(embs):
            old = model.get_submodule(name)
            _swap(model, name, _Received(old.embedding_dim, old.weight.dtype, first=i == 0))
    if last:
        return built
    _swap(model, norm, _Stop())  # the final norm, head and loss live on the last stage
    _swap(model, head, nn.Identity())
    run = built.run

    def run_stage(model, inputs, targets, kv_cache):
        try:
            run(model, inputs, targets, kv_cache)
        except _StageEnd as end:
            return _Send.apply(end.x)
        raise RuntimeError("the pipeline stage ran past its last block")

    return replace(built, run=run_stage)


def in_flight(tl, setup: Setup):
    """``tl`` (one micro-batch of stage ``setup.stage``) with the activations of the other micro-batches 1F1B keeps
    in flight during forward and backward: each as many bytes as one leaves saved at the end of its forward."""
    extra = in_flight_micro_batches(setup) - 1
    if extra == 0:
        return tl
    from gpuwise.planning.capture.tracker import CATEGORIES

    act = CATEGORIES.index("activations")
    running = np.array([ph != "optimizer" for ph, _ in tl.labels])
    base, slope = tl.base.copy(), tl.slope.copy()
    base[running, act] += extra * tl.base[tl.end_of_forward, act]
    slope[running, act] += extra * tl.slope[tl.end_of_forward, act]
    return replace(tl, base=base, slope=slope)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the run's GPUs split the work, as the plan reports it."""

    gpus: int
    dp: int  # data-parallel degree: gpus / (tp x pp x cp)
    tp: int
    pp: int
    cp: int
    nodes: int
    shard_gpus: int  # the GPUs the model states are sharded over (within a node under HSDP)
    stage: int | None  # the pipeline stage the plan's memory is of (the worst), None without --pp
    stage_layers: int | None  # its blocks
    in_flight: int  # micro-batches whose activations that stage holds at once (1F1B)
    bubble: float  # the 1F1B pipeline's idle fraction, (pp - 1) / (m + pp - 1)
    offload: str
    host_bytes: int  # host memory per GPU for the offloaded state
    host_bytes_per_node: int | None  # with --nodes: host_bytes x the GPUs of one node
    sharding: str = "ddp"  # how the model states are split over the shard_gpus (--sharding)
    ep: int = 1  # expert-parallel degree: each GPU holds experts / ep of every MoE layer's routed experts


def layout(setup: Setup, n_layer: int | None, host_bytes: int) -> Layout:
    per_node = setup.gpus // setup.nodes if setup.nodes > 1 else None
    return Layout(gpus=setup.gpus, dp=setup.dp, tp=setup.tp, pp=setup.pp, cp=setup.cp, nodes=setup.nodes,
                  shard_gpus=setup.shard_gpus, stage=setup.stage if setup.pp > 1 else None,
                  stage_layers=stage_layers(n_layer, setup) if setup.pp > 1 and n_layer else None,
                  in_flight=in_flight_micro_batches(setup), bubble=setup.pipeline_bubble,
                  offload=setup.offload, host_bytes=host_bytes, sharding=setup.sharding, ep=setup.ep,
                  host_bytes_per_node=None if per_node is None else host_bytes * per_node)


_aten = torch.ops.aten


class _RingAttention(torch.autograd.Function):
    """Causal SDPA of one rank's q, k, v chunk (B, heads, s / cp, hs) as ring attention computes it (module
    docstring): the steps' flash-attention calls and K/V buffers are what the tracker records."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> torch.Tensor:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
        half = k.shape[2] // 2
        for _ in range(cp - 1):
            kb, vb = torch.empty_like(k), torch.empty_like(v)  # the chunk received from the previous rank
            part, part_lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, kb[:, :, :half], vb[:, :, :half],
                                                                               0.0, False)[:2]
            out.add_(part)  # merged by their logsumexps (_SDPAMerger)
            lse = torch.logaddexp(lse, part_lse)
            del kb, vb, part, part_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)
        half = k.shape[2] // 2
        for _ in range(ctx.cp - 1):
            kb, vb = torch.empty_like(k), torch.empty_like(v)  # the K/V chunk going round again
            dkb, dvb = torch.zeros_like(k), torch.zeros_like(v)  # and its gradient, accumulated on the way
            dq_i, dk_i, dv_i = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, kb[:, :, :half], vb[:, :, :half], out, lse, 0.0, False)
            dq.add_(dq_i)
            dkb[:, :, :half].add_(dk_i)
            dvb[:, :, :half].add_(dv_i)
            del kb, vb, dkb, dvb, dq_i, dk_i, dv_i
        return dq, dk, dv, None


class _RingMode(torch.overrides.TorchFunctionMode):
    """Runs every causal SDPA of the model as ring attention over ``cp`` ranks."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        extra = {**dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:], strict=False)), **kwargs}
        if extra.get("attn_mask") is not None or not extra.get("is_causal") or extra.get("dropout_p"):
            raise GpuwiseError(f"--cp {self.cp}: ring attention is planned for causal attention without a mask or "
                               "dropout", "drop --cp")
        return _RingAttention.apply(q, k, v, self.cp)


def context_parallel(built, cp: int):
    """``built`` as one of ``cp`` context-parallel ranks runs it: s / cp tokens, ring attention in every block (its
    forward wrapped, so a checkpointed block's recomputation runs the ring again)."""
    from gpuwise.planning.transforms import find_blocks

    for block in find_blocks(built.model) or ():
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            with _RingMode(cp):
                return _inner(*args, **kwargs)

        block.forward = forward

    def chunk(t):
        return None if t is None else t[:, : t.shape[1] // cp].clone()

    return replace(built, inputs=tuple(chunk(t) for t in built.inputs), targets=chunk(built.targets))
