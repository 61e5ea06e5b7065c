"""Changes applied to a model from outside, as the real training script would: LoRA adapters,
a 4-bit frozen base (QLoRA) and activation checkpointing of every block."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpuwise.errors import NotApplicable

# QLoRA (Dettmers et al. 2023, sec. 2): NF4 weights are 4 bits; blocks of 64 weights share one absmax,
# itself quantised to 8 bits with one fp32 constant per 256 absmax values ("double quantisation").
NF4_BLOCK = 64
NF4_SECOND_BLOCK = 256


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of repeated blocks: ``model.blocks``, else its longest ``nn.ModuleList``."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=len) if lists else None


def apply_checkpointing(blocks: nn.ModuleList, recompute_context: Callable[[], AbstractContextManager] | None = None
                        ) -> None:
    """Recompute every block in backward (non-reentrant ``torch.utils.checkpoint``); only each block's input is kept.

    ``recompute_context`` makes the context the recomputation runs in (the planner's autocast).
    """
    contexts = None if recompute_context is None else (lambda: (contextlib.nullcontext(), recompute_context()))
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if contexts is None:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        block.forward = forward


class LoRALinear(nn.Module):
    """y = base(x) + (x A^T) B^T * alpha/r with the base frozen (Hu et al. 2021); B starts at zero."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)
        self.scale = 2.0  # alpha = 2r, a common choice; it does not change memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


class _Dequantize4bit(torch.autograd.Function):
    """x @ W^T with W kept in 4 bits: W is dequantised into a temporary for the matmul, and again in
    backward, as bitsandbytes does; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, packed, shape, dtype):
        w = torch.empty(shape, dtype=dtype, device=x.device)  # the dequantised copy, freed after the matmul
        ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype = shape, dtype
        return F.linear(x.to(dtype), w)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        w = torch.empty(ctx.shape, dtype=ctx.dtype, device=packed.device)
        return grad.to(ctx.dtype) @ w, None, None, None


class Linear4bit(nn.Module):
    """A frozen ``nn.Linear`` stored as NF4 with double-quantised constants (bias, if any, kept as is)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        n = linear.weight.numel()
        self.shape = tuple(linear.weight.shape)
        self.dtype = dtype
        self.register_buffer("packed", torch.empty(n // 2 + n % 2, dtype=torch.uint8, device=linear.weight.device))
        n_abs = -(-n // NF4_BLOCK)
        self.register_buffer("absmax", torch.empty(n_abs, dtype=torch.uint8, device=linear.weight.device))
        self.register_buffer("absmax_scale", torch.empty(-(-n_abs // NF4_SECOND_BLOCK), dtype=torch.float32,
                                                         device=linear.weight.device))
        self.bias = linear.bias
        self.numel = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Dequantize4bit.apply(x, self.packed, self.shape, self.dtype)
        return y if self.bias is None else y + self.bias


def _adaptable(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``block`` LoRA can wrap: not those ``nn.MultiheadAttention`` reads
    the weight of directly (its out_proj)."""
    inside_mha = {f"{name}.{sub}" if name else sub for name, mod in block.named_modules()
                  if isinstance(mod, nn.MultiheadAttention) for sub, _ in mod.named_modules() if sub}
    return [(name, mod) for name, mod in block.named_modules()
            if isinstance(mod, nn.Linear) and name not in inside_mha]


def apply_lora(model: nn.Module, blocks: nn.ModuleList | None, *, rank: int, adapter_dtype: torch.dtype,
               quantize_base: bool, compute_dtype: torch.dtype) -> int:
    """Freeze ``model``, wrap every ``nn.Linear`` inside ``blocks`` with a LoRA adapter (QLoRA paper: all
    linear layers), optionally storing their frozen weights in 4 bits; returns the frozen base parameters.

    A model it cannot adapt raises ``NotApplicable(message, hint)``: a remedy is skipped, a user's
    ``--task finetune-lora`` becomes a one-line error (``workload.simulate``)."""
    if blocks is None:
        raise NotApplicable("--task finetune-lora: the model has no repeated blocks (an nn.ModuleList) to adapt",
                           "put the layers to fine-tune in an nn.ModuleList, or plan --task train")
    if not any(_adaptable(block) for block in blocks):
        raise NotApplicable("--task finetune-lora adapts the nn.Linear layers inside the blocks, and this model's "
                           "blocks have none", "plan --task train")
    model.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters())
    for block in blocks:
        targets = _adaptable(block)
        for name, lin in targets:
            parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
            if quantize_base:
                frozen -= lin.weight.numel()
                base: nn.Module = Linear4bit(lin, compute_dtype)
            else:
                base = lin
            setattr(parent, name.rpartition(".")[2],
                    LoRALinear(base, lin.in_features, lin.out_features, rank, adapter_dtype, lin.weight.device))
    return frozen
