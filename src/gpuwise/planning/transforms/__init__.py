"""Changes applied to a model from outside, as the real training script would: LoRA adapters (on the layers
``--lora-targets`` names, with ``--lora-dropout``), a 4-bit frozen base (QLoRA) and activation checkpointing of
every block (whole, or torchtitan's op-level selective policy).

LoRA targets, as Hugging Face PEFT's ``LoraConfig(target_modules=...)`` reads them (peft/tuners/tuners_utils.py,
``check_target_module_exists`` and ``_maybe_include_all_linear_layers``):

- a name matches a layer whose qualified name is that name or ends with ``.name`` (``q_proj``, ``attention.wq``);
- ``all-linear``: every ``nn.Linear`` except the output head (PEFT leaves out ``get_output_embeddings()``);
- ``re:PATTERN``: a regular expression the whole qualified name must match (PEFT's ``target_modules`` string);
- a name with ``*``, ``?`` or ``[``: an fnmatch pattern on the qualified name (``blocks.*.attention.w[qv]``);
- the short names q, k, v, o, gate, up, down: the attention and MLP projections under the names the zoo and the
  common Hugging Face models give them (``SHORT_NAMES``).

QLoRA stores every ``nn.Linear`` but the output head in 4 bits, targeted or not (transformers' bitsandbytes
integration keeps ``get_output_embeddings()`` and tied weights out, ``get_keys_to_not_convert``). A Mixture of Experts'
fused 3-D expert parameters (transformers 5) are not ``nn.Linear``: bitsandbytes leaves them as loaded, 16-bit, and
PEFT's ``prepare_model_for_kbit_training`` casts them to fp32 with every other 16-bit parameter not in 4 bits, as the
capture builds them (``--qlora-recipe plain``: 16-bit); they stay frozen, and the plan says so
(quantize.experts_note, bitsandbytes#1849).
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gpuwise.compat import TorchDispatchMode
from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.transforms.quantize import FORMATS

# QLoRA's base (Dettmers et al. 2023, sec. 2) is stored as transforms/quantize.py's FORMATS["nf4"] lays NF4 out (4-bit
# weights, one 8-bit absmax per 64, one fp32 constant per 256 absmax): the one table, shared with --weights nf4.

# bitsandbytes before 0.43.2 (July 2024) kept each 4-bit layer's input for a weight gradient it never computes:
# ``MatMul4Bit.forward`` ended ``ctx.tensors = (A, B)``; bitsandbytes PR #1270 made it ``(None, B)`` ("the bug
# that caused a lot of memory issues with QLoRA", Dettmers). The plan follows the current library; tests set this
# to reproduce measurements taken before the fix (litgpt's config_hub table).
BNB_SAVES_INPUT = False

# Short LoRA target names: the leaf names each stands for in the zoo (llama.py: wq..w3, bert.py: query..attn_out)
# and in Hugging Face models (Llama/Mistral/Qwen: q_proj..down_proj, BERT: query/key/value, DistilBERT: q_lin..).
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj", "wq", "query", "q_lin", "to_q"),
    "k": ("k_proj", "wk", "key", "k_lin", "to_k"),
    "v": ("v_proj", "wv", "value", "v_lin", "to_v"),
    "o": ("o_proj", "wo", "out_proj", "attn_out", "out_lin"),
    "gate": ("gate_proj", "w1"),
    "up": ("up_proj", "w3"),
    "down": ("down_proj", "w2"),
}
ALL_LINEAR = "all-linear"
_GLOB = re.compile(r"[*?\[]")


class UnevenTargets(Exception):
    """The targets differ from block to block, so a capture of 2 and 3 blocks cannot stand for the stack."""


def check_targets(text: str) -> None:
    """``--lora-targets`` as written, before any model is seen: items, and a regular expression that compiles."""
    flag = f"--lora-targets {text!r}"
    if text.startswith("re:"):
        try:
            re.compile(text[3:])
        except re.error as exc:
            raise GpuwiseError(f"{flag} is not a regular expression ({exc})", "fix the pattern after re:") from exc
        if not text[3:]:
            raise GpuwiseError(f"{flag} has an empty pattern", "pass e.g. --lora-targets 're:.*\\.(q|v)_proj'")
        return
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise GpuwiseError(f"{flag} has an empty name", "pass names separated by commas, e.g. --lora-targets q,v")


def _target_items(text: str) -> list[tuple[str, Callable[[str, bool], bool]]]:
    """(item, match(qualified name, is the head)) for each item of ``--lora-targets``."""
    if text.startswith("re:"):
        pattern = re.compile(text[3:])
        return [(text, lambda name, head: pattern.fullmatch(name) is not None)]

    def suffix(item: str) -> Callable[[str, bool], bool]:
        return lambda name, head: name == item or name.endswith("." + item)

    out: list[tuple[str, Callable[[str, bool], bool]]] = []
    for item in (t.strip() for t in text.split(",")):
        if item == ALL_LINEAR:
            out.append((item, lambda name, head: not head))
        elif _GLOB.search(item):
            out.append((item, lambda name, head, item=item: fnmatch.fnmatchcase(name, item)))
        elif item in SHORT_NAMES:
            leaves, plain = SHORT_NAMES[item], suffix(item)
            out.append((item, lambda name, head, leaves=leaves, plain=plain:
                        name.rpartition(".")[2] in leaves or plain(name, head)))
        else:
            out.append((item, suffix(item)))
    return out


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of repeated blocks: ``model.blocks``, else its longest ``nn.ModuleList``."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=len) if lists else None


aten = torch.ops.aten


def _selective_save_list() -> frozenset:
    """The ops whose outputs torchtitan's selective policy keeps: ``_save_list`` in pytorch/torchtitan
    torchtitan/models/llama/parallelize_llama.py (Dec 2024, the revision behind docs/performance.md's Llama 3.1 8B
    figures): matmuls, flash and memory-efficient SDPA, reduce-scatter, and ``max`` (an fp8 scale's amax).

    Plus the CPU flash kernel: the planner runs on fake CPU tensors, where SDPA is
    ``_scaled_dot_product_flash_attention_for_cpu``, the stand-in for the GPU's flash kernel (tracker.py)."""
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default, aten.max.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return frozenset(ops)


def selective_policy(decided: Callable[[bool], None] | None = None) -> Callable:
    """torchtitan's op-level policy for one block's forward (``_apply_ac_to_transformer_block``, mode "selective",
    option "op"): save the outputs of the ops in ``_save_list`` "except every second mm" (the 2nd, 4th, ... mm of the
    block, counted apart in forward and in recomputation), recompute the rest. A fresh count per call, as torchtitan
    makes a fresh ``meta = defaultdict(int)`` per ``context_fn`` call. ``decided(saved)`` hears each decision.

    In a Llama block (no biases, so every linear layer is an ``mm``) the saved outputs are wq, wv, w1 and w2 (the 1st,
    3rd, 5th and 7th mm: wq, wk, wv, wo, w1, w3, w2) and attention's output and logsumexp.

    Under --precision fp8 the planner's linear layers call ``_scaled_mm`` (transforms/float8.py) where torchao's reach
    the policy as an ``aten.mm`` on its float8 tensor subclass: counted and kept as one."""
    save_list = _selective_save_list()
    matmuls = (aten.mm.default, aten._scaled_mm.default)
    counts: defaultdict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        mm = func in matmuls
        if mm:
            counts[mode] += 1
        save = (func in save_list or mm) and not (mm and counts[mode] % 2 == 0)
        if decided is not None and not ctx.is_recompute:
            decided(save)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _SavedOutputs(TorchDispatchMode):
    """Above selective checkpointing's caching mode in forward: hands ``on_saved`` the outputs the policy keeps (they
    are held by the checkpoint, not by autograd, so the planner's saved-tensor hook never sees them). The policy runs
    inside the op's call (before the op from torch 2.5, after it with ``op_output`` in later releases), so the
    decision is known when the op returns here."""

    def __init__(self, on_saved: Callable[[object], None]) -> None:
        super().__init__()
        self.on_saved = on_saved
        self.saved: bool | None = None

    def decided(self, saved: bool) -> None:
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.saved = None
        out = func(*args, **(kwargs or {}))
        if self.saved:
            self.on_saved(out)
        return out


@contextlib.contextmanager
def _entered(*contexts: AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def apply_checkpointing(blocks: nn.ModuleList, recompute_context: Callable[[], AbstractContextManager] | None = None,
                        *, selective: bool = False, on_saved: Callable[[object], None] | None = None,
                        allow_mutation: bool = False) -> None:
    """Recompute every block in backward (non-reentrant ``torch.utils.checkpoint``): only each block's input is
    kept, or with ``selective`` also the outputs torchtitan's op-level policy saves (``selective_policy``).

    ``recompute_context`` makes the context the recomputation runs in (the planner's autocast); ``on_saved`` is
    handed each output the selective policy keeps (the planner tags them as activations); ``allow_mutation`` lets a
    simulated step update in place what the policy cached (the planner's ring attention under --cp accumulates into
    buffers; a simulated step's values do not matter), where torch has the switch (``allow_cache_entry_mutation``).
    """
    mutation = ({"allow_cache_entry_mutation": True} if allow_mutation and "allow_cache_entry_mutation"
                in inspect.signature(create_selective_checkpoint_contexts).parameters else {})

    def contexts():
        recompute = recompute_context() if recompute_context is not None else contextlib.nullcontext()
        if not selective:
            return contextlib.nullcontext(), recompute
        saved = _SavedOutputs(on_saved) if on_saved is not None else None
        forward, cached = create_selective_checkpoint_contexts(selective_policy(saved and saved.decided), **mutation)
        return (_entered(forward, saved) if saved is not None else forward), _entered(recompute, cached)

    plain = recompute_context is None and not selective
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if plain:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        block.forward = forward


class LoRALinear(nn.Module):
    """y = base(x) + (dropout(x) A^T) B^T * alpha/r with the base frozen (Hu et al. 2021); B starts at zero.

    The dropout is PEFT's ``lora_dropout`` (peft/tuners/lora/layer.py): on the adapter's input only, so in
    training each adapted layer keeps its own mask and dropped copy of the input for the backward of A."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                 device: torch.device, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = 2.0  # alpha = 2r, a common choice; it does not change memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale


class _Dequantize4bit(torch.autograd.Function):
    """x @ W^T with W kept in 4 bits: W is dequantised into a temporary for the matmul, and again in
    backward, as bitsandbytes' ``MatMul4Bit`` does; only the packed weight is kept for backward (and the input
    too with ``save_input``, as bitsandbytes did before 0.43.2: ``BNB_SAVES_INPUT``)."""

    @staticmethod
    def forward(ctx, x, packed, shape, dtype, save_input=False):
        w = torch.empty(shape, dtype=dtype, device=x.device)  # the dequantised copy, freed after the matmul
        ctx.save_for_backward(packed, x) if save_input else ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype = shape, dtype
        return F.linear(x.to(dtype), w)

    @staticmethod
    def backward(ctx, grad):
        packed = ctx.saved_tensors[0]
        w = torch.empty(ctx.shape, dtype=ctx.dtype, device=packed.device)
        return grad.to(ctx.dtype) @ w, None, None, None, None


class Linear4bit(nn.Module):
    """A frozen ``nn.Linear`` stored as NF4 with double-quantised constants (bias, if any, kept as is)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        n = linear.weight.numel()
        self.shape = tuple(linear.weight.shape)
        self.dtype = dtype
        for name, buf_dtype, numel in FORMATS["nf4"].tensors:  # the packed weights, absmax, absmax_scale
            self.register_buffer("packed" if name == "weight" else name,
                                 torch.empty(numel(*self.shape), dtype=buf_dtype, device=linear.weight.device))
        self.bias = linear.bias
        self.numel = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bitsandbytes' Linear4bit.forward: the input cast to the compute dtype, the bias too, and the output cast
        # back to the input's dtype (with PEFT's fp32 up-cast, an fp32 residual stream stays fp32)
        dtype = x.dtype
        y = _Dequantize4bit.apply(x.to(self.dtype), self.packed, self.shape, self.dtype, BNB_SAVES_INPUT)
        if self.bias is not None:
            y = y + self.bias.to(self.dtype)
        return y.to(dtype)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``model`` LoRA can wrap, by qualified name: not those ``nn.MultiheadAttention``
    reads the weight of directly (its out_proj)."""
    inside_mha = {f"{name}.{sub}" if name else sub for name, mod in model.named_modules()
                  if isinstance(mod, nn.MultiheadAttention) for sub, _ in mod.named_modules() if sub}
    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name and name not in inside_mha]


def _head(model: nn.Module, outside: list[tuple[str, nn.Linear]]) -> str | None:
    """The output head: Hugging Face's ``get_output_embeddings()``, else the last linear layer outside the blocks
    (a decoder's LM head, a classifier)."""
    get = getattr(model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    if emb is not None:
        return next((name for name, mod in outside if mod is emb), None)
    return outside[-1][0] if outside else None


def _prefix(model: nn.Module, blocks: nn.ModuleList | None) -> str | None:
    return next((name for name, mod in model.named_modules() if mod is blocks), None) if blocks is not None else None


def select_targets(model: nn.Module, blocks: nn.ModuleList | None, targets: str | None, *,
                   depth: int | None = None) -> tuple[list[str], set[str], str | None]:
    """(every linear layer's qualified name, the LoRA targets among them, the output head) for ``--lora-targets``
    ``targets`` (None: every linear layer in the blocks). ``depth``: the blocks of the full model when ``blocks`` holds
    fewer (a scaled capture); targets that differ between the blocks of the full model raise UnevenTargets."""
    found = _linears(model)
    linears = [name for name, _ in found]
    prefix = _prefix(model, blocks)
    outside = [n for n in linears if not (prefix and n.startswith(prefix + "."))]
    head = _head(model, [(n, m) for n, m in found if n in outside])
    if targets is None:
        return linears, {n for n in linears if n not in outside}, head
    n_blocks = len(blocks) if blocks is not None else 0
    depth = max(depth or n_blocks, n_blocks)
    # the full model's names: block 0's layers repeated for every block, and the layers outside the blocks
    inner = [n[len(prefix) + 1:].partition(".")[2] for n in linears if prefix and n.startswith(f"{prefix}.0.")]
    full = outside + [f"{prefix}.{i}.{r}" for i in range(depth) for r in inner]
    items = _target_items(targets)
    chosen = {n for n in full if any(match(n, n == head) for _, match in items)}
    for item, match in items:
        if not any(match(n, n == head) for n in full):
            names = [f"{prefix}.N.{r}" for r in inner] + outside
            short = {r: k for r in inner for k, leaves in SHORT_NAMES.items() if r.rpartition(".")[2] in leaves}
            shown = ", ".join(f"{n} ({short[n.partition('.N.')[2]]})" if n.partition(".N.")[2] in short else n
                              for n in names)
            raise NotApplicable(f"--lora-targets {item!r} matches no linear layer of the model; its linear layers: "
                                f"{shown or 'none'}",
                                "name one (or its end, e.g. wq), a short name q,k,v,o,gate,up,down, all-linear, "
                                "a pattern such as '*.wq', or re:REGEX")
    for r in inner:
        hit = {i for i in range(depth) if f"{prefix}.{i}.{r}" in chosen}
        if hit and len(hit) < depth and n_blocks < depth:
            raise UnevenTargets(r)
    return linears, {n for n in linears if n in chosen}, head


def apply_lora(model: nn.Module, blocks: nn.ModuleList | None, *, rank: int, adapter_dtype: torch.dtype,
               quantize_base: bool, compute_dtype: torch.dtype, targets: str | None = None, dropout: float = 0.0,
               depth: int | None = None) -> int:
    """Freeze ``model`` and wrap the linear layers ``targets`` names (see the module docstring; None: every
    ``nn.Linear`` inside ``blocks``, the QLoRA paper's choice) with LoRA adapters; with ``quantize_base`` every
    linear layer but the output head is stored in 4 bits. Returns the frozen base parameters.

    A model it cannot adapt raises ``NotApplicable(message, hint)``: a remedy is skipped, a user's
    ``--task finetune-lora`` becomes a one-line error (``workload.simulate``). ``depth``: see ``select_targets``."""
    if targets is None and blocks is None:
        raise NotApplicable("--task finetune-lora: the model has no repeated blocks (an nn.ModuleList) to adapt",
                           "put the layers to fine-tune in an nn.ModuleList, or plan --task train")
    linears, chosen, head = select_targets(model, blocks, targets, depth=depth)
    if not chosen:
        raise NotApplicable("--task finetune-lora adapts the nn.Linear layers inside the blocks, and this model's "
                           "blocks have none", "plan --task train")
    model.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters())
    for name in linears:
        lin = model.get_submodule(name)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base: nn.Module = lin
        if quantize_base and name != head:
            frozen -= lin.weight.numel()
            base = Linear4bit(lin, compute_dtype)
        if name in chosen:
            base = LoRALinear(base, lin.in_features, lin.out_features, rank, adapter_dtype, lin.weight.device,
                              dropout)
        if base is not lin:
            setattr(parent, leaf, base)
    return frozen
