"""QLoRA's frozen base (Dettmers et al. 2023): every ``nn.Linear`` but the output head stored in 4 bits, targeted by
LoRA or not (transformers' bitsandbytes integration keeps ``get_output_embeddings()`` and tied weights out,
``get_keys_to_not_convert``). A Mixture of Experts' fused 3-D expert parameters (transformers 5) are not
``nn.Linear``: bitsandbytes leaves them as loaded, 16-bit, and PEFT's ``prepare_model_for_kbit_training`` casts them
to fp32 with every other 16-bit parameter not in 4 bits, as the capture builds them (``--qlora-recipe plain``:
16-bit); they stay frozen, and the plan says so (quantize.experts_note, bitsandbytes#1849).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.planning.transforms.quantize import FORMATS

# QLoRA's base (Dettmers et al. 2023, sec. 2) is stored as transforms/quantize.py's FORMATS["nf4"] lays NF4 out (4-bit
# weights, one 8-bit absmax per 64, one fp32 constant per 256 absmax): the one table, shared with --weights nf4.

# bitsandbytes before 0.43.2 (July 2024) kept each 4-bit layer's input for a weight gradient it never computes:
# ``MatMul4Bit.forward`` ended ``ctx.tensors = (A, B)``; bitsandbytes PR #1270 made it ``(None, B)`` ("the bug
# that caused a lot of memory issues with QLoRA", Dettmers). The plan follows the current library; tests set this
# to reproduce measurements taken before the fix (litgpt's config_hub table).
BNB_SAVES_INPUT = False


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
