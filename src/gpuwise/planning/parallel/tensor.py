"""One rank of a tensor-parallel run (``--tp``), captured as it runs (not a formula after).

The model stays plain PyTorch; these functions cut it from outside after it is built (gpt-fast's ``apply_tp``),
inside the fake mode, so the capture records what one rank allocates and computes.

``--tp N`` (Megatron-LM, Shoeybi et al. 2019 sec. 3; torchtitan's ``parallelize_llama``): in every block the
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
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.planning.capture.blocks import find_blocks
from gpuwise.planning.experts import routed_modules
from gpuwise.planning.parallel.expert import shard_experts
from gpuwise.planning.parallel.layout import ends, swap

# The linear layers of a block, as each model spells them: the first of each pair column-parallel, the second
# row-parallel (zoo Llama: wq wk wv w1 w3 / wo w2; zoo GPT and its attention's packed q,k,v: c_attn c_fc / c_proj;
# Hugging Face decoders: q_proj k_proj v_proj gate_proj up_proj / o_proj down_proj; Hugging Face GPT-2: the same
# c_attn c_fc / c_proj as transformers' Conv1D, a linear layer whose weight is stored (in, out)).
COLUMN = frozenset({"wq", "wk", "wv", "w1", "w3", "c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj",
                    "up_proj"})
ROW = frozenset({"wo", "w2", "c_proj", "o_proj", "down_proj"})
HEADS = ("n_head", "n_kv_head", "num_heads", "num_key_value_heads")  # attributes a block's attention may size by
# widths of all of an attention's heads together (on a module that has one of HEADS): GPT-2's attention splits
# c_attn's output into q, k and v of split_size each
WIDTHS = ("split_size",)


def _linear(old: nn.Linear, in_features: int, out_features: int, split_bias: bool) -> nn.Linear:
    new = nn.Linear(in_features, out_features, bias=old.bias is not None, dtype=old.weight.dtype,
                    device=old.weight.device)
    if old.bias is not None and not split_bias:  # a row-parallel bias is added once, after the all-reduce: whole
        new.bias = nn.Parameter(torch.empty(old.out_features, dtype=old.bias.dtype, device=old.bias.device))
    new.weight.requires_grad_(old.weight.requires_grad)
    return new


def _is_conv1d(mod: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's c_attn, c_fc, c_proj): ``x @ weight + bias``, weight (nx, nf)."""
    return type(mod).__name__ == "Conv1D" and all(isinstance(getattr(mod, a, None), int) for a in ("nf", "nx"))


def _conv1d(old: nn.Module, nx: int, nf: int, split_bias: bool) -> nn.Module:
    """``old`` (a Conv1D) cut to ``nx`` inputs and ``nf`` outputs, as ``_linear`` cuts a linear layer: Megatron splits
    GPT-2's fused c_attn by heads, each rank's q, k and v columns together (nf = 3 x width / tp)."""
    new = type(old)(nf, nx)  # its own constructor; the parameters made again in old's dtype, device and grad
    w, b = old.weight, old.bias
    new.weight = nn.Parameter(torch.empty(nx, nf, dtype=w.dtype, device=w.device), requires_grad=w.requires_grad)
    new.bias = nn.Parameter(torch.empty(nf if split_bias else old.nf, dtype=b.dtype, device=b.device),
                            requires_grad=b.requires_grad)
    return new


def shard_tensor_parallel(model: nn.Module, tp: int) -> None:
    """One rank's model of a ``tp``-way Megatron split, in place (see the module docstring)."""
    blocks = find_blocks(model)
    split = 0
    for block in blocks or ():
        for name, mod in list(block.named_modules()):
            leaf = name.rpartition(".")[2]
            conv1d = _is_conv1d(mod)
            if (isinstance(mod, nn.Linear) or conv1d) and leaf in COLUMN | ROW:
                n_in, n_out = (mod.nx, mod.nf) if conv1d else (mod.in_features, mod.out_features)
                n = n_out if leaf in COLUMN else n_in
                if n % tp:
                    raise GpuwiseError(f"--tp {tp} does not divide {name}'s {n} features",
                                       f"pass a --tp that divides {n}")
                shape = (n_in // (1 if leaf in COLUMN else tp), n_out // (tp if leaf in COLUMN else 1), leaf in COLUMN)
                swap(block, name, _conv1d(mod, *shape) if conv1d else _linear(mod, *shape))
                split += 1
                continue
            heads = [attr for attr in HEADS if isinstance(getattr(mod, attr, None), int)]
            for attr in heads + ([a for a in WIDTHS if isinstance(getattr(mod, a, None), int)] if heads else []):
                setattr(mod, attr, getattr(mod, attr) // tp)
    for name, module in routed_modules(model):  # the stacked experts: expert tensor parallelism
        split += shard_experts(module, name, tp)
    if not split:
        raise GpuwiseError(f"--tp {tp}: no q/k/v/o or MLP linear layers found in {type(model).__name__}'s blocks",
                           "drop --tp; tensor parallelism is planned for Llama- and GPT-style decoders")
    embs, _norm, head = ends(model)
    tied = head is not None and embs and model.get_submodule(head).weight is model.get_submodule(embs[0]).weight
    rows = None
    if embs:
        old = model.get_submodule(embs[0])
        rows = math.ceil(old.num_embeddings / tp)
        new_emb = nn.Embedding(rows, old.embedding_dim, dtype=old.weight.dtype, device=old.weight.device)
        swap(model, embs[0], new_emb)
    if head is not None:
        old = model.get_submodule(head)
        rows = math.ceil(old.out_features / tp)
        new_head = _linear(old, old.in_features, rows, True)
        if tied:
            new_head.weight = new_emb.weight
        swap(model, head, new_head)
    config = getattr(model, "config", None)  # transformers' loss views the logits by config.vocab_size
    if rows is not None and config is not None and isinstance(getattr(config, "vocab_size", None), int):
        config.vocab_size = rows
    if rows is not None and isinstance(getattr(model, "vocab_size", None), int):  # or by its own (Mixtral's)
        model.vocab_size = rows


# The routed experts' stacked matrices (transformers 5): the first of each pair column-parallel (gate and up, fused

SUBLAYERS = frozenset({"attention", "feed_forward", "attn", "mlp", "self_attn"})  # what runs on the whole sequence


# The collectives, as one rank sees them: a new buffer of the other shape (what NCCL writes into), nothing computed.
# Custom ops, not autograd Functions around ``new_empty``: an op that reads its input is what keeps, in a
# ``--compile`` trace (transforms/compiled.py), the matmuls whose only reader is a collective (the row-parallel
# outputs in forward, the column-parallel input gradients in backward), which AOTAutograd would otherwise drop as
# dead code; and it stays one kernel there, unfused, as inductor leaves a collective.
def _resized(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n, *x.shape[2:]))


@torch.library.custom_op("gpuwise::sequence_all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, t: int) -> torch.Tensor:
    """All-gather along the sequence (dim 1)."""
    return _resized(x, x.shape[1] * t)


@_all_gather.register_fake
def _(x, t):
    return _resized(x, x.shape[1] * t)


@torch.library.custom_op("gpuwise::sequence_reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, t: int) -> torch.Tensor:
    """Reduce-scatter along the sequence (dim 1)."""
    return _resized(x, x.shape[1] // t)


@_reduce_scatter.register_fake
def _(x, t):
    return _resized(x, x.shape[1] // t)


def _keep_t(ctx, inputs, output) -> None:
    ctx.t = inputs[1]


# backward of an all-gather reduce-scatters the gradient, and the other way round
_all_gather.register_autograd(lambda ctx, grad: (_reduce_scatter(grad, ctx.t), None), setup_context=_keep_t)
_reduce_scatter.register_autograd(lambda ctx, grad: (_all_gather(grad, ctx.t), None), setup_context=_keep_t)


def _first_tensor(args, kwargs, change):
    """``args`` and ``kwargs`` with the hidden states (the first positional, else ``hidden_states``) changed."""
    if args:
        return (change(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}


def sequence_parallel(model: nn.Module, tp: int) -> None:
    """The residual stream between the blocks' attention and MLP split ``tp`` ways along the sequence (module
    docstring), in place: the stack's input is scattered before the first block and its output gathered after the
    last, for the head. Those two are hooks on the first and last block, not wrappers of their ``forward``: every
    block then runs the same forward on s / tp tokens, as torchtitan's do (the embedding's output is already
    sharded, the head's input gathered), so ``--compile``, which traces a block's forward once and shares the
    graph with every block of the same structure and inputs (transforms/compiled.py), gives the last block the
    graph of the others, not one without the gather (or the first block's, with a scatter)."""
    blocks = find_blocks(model) or []
    for block in blocks:
        for name, sub in block.named_children():
            if name not in SUBLAYERS:
                continue

            def forward(*args, _inner=sub.forward, **kwargs):
                args, kwargs = _first_tensor(args, kwargs, lambda x: _all_gather(x, tp))
                out = _inner(*args, **kwargs)
                if isinstance(out, tuple):
                    return (_reduce_scatter(out[0], tp), *out[1:])
                return _reduce_scatter(out, tp)

            sub.forward = forward
    if not blocks:
        return

    def scatter_in(_block, args, kwargs):
        return _first_tensor(args, kwargs, lambda x: _reduce_scatter(x, tp))

    def gather_out(_block, _args, out):
        if isinstance(out, tuple):
            return (_all_gather(out[0], tp), *out[1:])
        return _all_gather(out, tp)

    # registered now, before the planner's own block hooks (capture/step.py), so that those see the shards
    blocks[0].register_forward_pre_hook(scatter_in, with_kwargs=True)
    blocks[-1].register_forward_hook(gather_out)
