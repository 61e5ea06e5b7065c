"""Weight-only quantised inference (``--weights``): the linear layers of the blocks stored as the serving libraries
store them, and the temporaries each matmul makes, applied to the model from outside like LoRA.

What stays 16-bit: the embeddings, the norms and the output head. bitsandbytes through transformers converts every
``nn.Linear`` but the head (``get_keys_to_not_convert``: the output embeddings and tied weights); AutoAWQ quantises
the linear layers of the decoder layers only. We quantise the linear layers inside the model's blocks.

The formats, one row each (``FORMATS``), with the tensors the library keeps for a weight of ``out x in``:

- ``int8``: bitsandbytes ``Linear8bitLt`` (LLM.int8, Dettmers et al. 2022): ``CB`` int8 ``out x in`` and ``SCB``, one
  fp32 absmax per output row. The matmul quantises its input row-wise to int8 (``int8_vectorwise_quant``) and
  multiplies in int8 into int32 (``int8_linear_matmul``): no 16-bit copy of the weight.
- ``nf4``: bitsandbytes ``Linear4bit`` NF4 with double quantisation (QLoRA, Dettmers et al. 2023, §2): two weights a
  byte, one absmax per 64 weights stored in 8 bits, one fp32 constant per 256 absmax. ``matmul_4bit`` runs the
  fused ``gemv_4bit`` kernel for a single token (``A.numel() == A.shape[-1]``), else dequantises the whole weight
  into a 16-bit temporary and multiplies.
- ``int4``: AutoAWQ ``WQLinear_GEMM`` (group 128): ``qweight`` int32 ``in x out/8`` (eight 4-bit weights each),
  ``qzeros`` int32 ``in/128 x out/8``, ``scales`` fp16 ``in/128 x out``. Its fused kernel runs below 1024 tokens a
  matmul; from 1024 on it dequantises into a 16-bit temporary (``FP16_MATMUL_HEURISTIC_CONDITION``). GPTQ's layout
  is the same size (plus an int32 ``g_idx`` of ``in``).
- ``fp8``: float8 e4m3 weights with one fp32 scale per tensor, as vLLM's fp8 checkpoints hold them; the matmul
  (W8A8, ``aten._scaled_mm``) quantises its input to fp8: no 16-bit copy of the weight.

>>> round(FORMATS["nf4"].bytes_per_weight(), 4)    # 4.127 bits (QLoRA §2)
0.5159
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.errors import NotApplicable

NF4_BLOCK = 64  # bitsandbytes' default blocksize for 4-bit (FORMATS["nf4"] is also the QLoRA base: transforms.py)
NF4_SECOND_BLOCK = 256  # double quantisation: absmax values per fp32 constant
AWQ_GROUP = 128  # AutoAWQ's default q_group_size
AWQ_DEQUANT_TOKENS = 1024  # AutoAWQ WQLinear_GEMM: at x.shape[0] * x.shape[1] >= 1024 it dequantises, then matmul


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """How one library stores a quantised ``out x in`` weight, and whether its matmul makes a 16-bit copy of it."""

    name: str
    library: str
    # (buffer name, dtype, element count for (out_features, in_features))
    tensors: tuple[tuple[str, torch.dtype, Callable[[int, int], int]], ...]
    dequantizes: Callable[[int], bool]  # for the tokens of one matmul: a 16-bit copy of the weight is made
    input_dtype: torch.dtype | None = None  # the matmul quantises its input to this (int8, fp8), else None

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes stored for one weight of ``out_features x in_features``."""
        return sum(fn(out_features, in_features) * dtype.itemsize for _, dtype, fn in self.tensors)

    def bytes_per_weight(self, out_features: int = 4096, in_features: int = 4096) -> float:
        """Stored bytes per weight, for a layer of this shape (a 7B model's attention projection by default)."""
        return self.nbytes(out_features, in_features) / (out_features * in_features)


FORMATS: dict[str, WeightFormat] = {
    "int8": WeightFormat(
        name="int8", library="bitsandbytes Linear8bitLt (LLM.int8)",
        tensors=(("CB", torch.int8, lambda o, i: o * i), ("SCB", torch.float32, lambda o, i: o)),
        dequantizes=lambda tokens: False, input_dtype=torch.int8),
    "nf4": WeightFormat(
        name="nf4", library="bitsandbytes Linear4bit NF4, double quantisation",
        tensors=(("weight", torch.uint8, lambda o, i: _ceil(o * i, 2)),
                 ("absmax", torch.uint8, lambda o, i: _ceil(o * i, NF4_BLOCK)),
                 ("absmax_scale", torch.float32, lambda o, i: _ceil(_ceil(o * i, NF4_BLOCK), NF4_SECOND_BLOCK))),
        dequantizes=lambda tokens: tokens > 1),
    "int4": WeightFormat(
        name="int4", library=f"AutoAWQ WQLinear_GEMM, group {AWQ_GROUP}",
        tensors=(("qweight", torch.int32, lambda o, i: i * _ceil(o, 8)),
                 ("qzeros", torch.int32, lambda o, i: _ceil(i, AWQ_GROUP) * _ceil(o, 8)),
                 ("scales", torch.float16, lambda o, i: _ceil(i, AWQ_GROUP) * o)),
        dequantizes=lambda tokens: tokens >= AWQ_DEQUANT_TOKENS),
    "fp8": WeightFormat(
        name="fp8", library="vLLM fp8 (e4m3 weights, per-tensor scale, W8A8)",
        tensors=(("weight", torch.float8_e4m3fn, lambda o, i: o * i), ("weight_scale", torch.float32, lambda o, i: 1)),
        dequantizes=lambda tokens: False, input_dtype=torch.float8_e4m3fn),
}


class QuantLinear(nn.Module):
    """A frozen ``nn.Linear`` stored in ``fmt``; the bias, if any, stays as it was."""

    def __init__(self, linear: nn.Linear, fmt: WeightFormat, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt, self.compute_dtype = fmt, compute_dtype
        self.out_features, self.in_features = linear.out_features, linear.in_features
        device = linear.weight.device
        for name, dtype, numel in fmt.tensors:
            self.register_buffer(name, torch.empty(numel(self.out_features, self.in_features), dtype=dtype,
                                                   device=device))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        tokens = x.numel() // max(x.shape[-1], 1)
        held = []  # temporaries alive until the output is made
        if self.fmt.dequantizes(tokens):  # the whole weight in 16 bits, freed after the matmul
            w = torch.empty((self.out_features, self.in_features), dtype=self.compute_dtype, device=x.device)
        else:  # a fused kernel reads the stored weight: the matmul's FLOPs without a 16-bit copy (a stride-0 view)
            if self.fmt.input_dtype is not None:  # the input quantised row-wise, its scales, an int32 (fp32) product
                held = [torch.empty(x.shape, dtype=self.fmt.input_dtype, device=x.device),
                        torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device),
                        torch.empty((*x.shape[:-1], self.out_features), dtype=torch.int32, device=x.device)]
            w = torch.empty((), dtype=self.compute_dtype, device=x.device).expand(self.out_features, self.in_features)
        y = F.linear(x, w)
        del held
        return y if self.bias is None else y + self.bias.to(self.compute_dtype)


def quantize_weights(blocks: nn.ModuleList | None, weights: str, compute_dtype: torch.dtype, *, model_name: str = ""
                     ) -> int:
    """Replace every ``nn.Linear`` inside ``blocks`` by its ``weights`` storage; returns the weights quantised.

    NotApplicable when the model has no blocks or no linear layers in them (a one-line error for the user)."""
    fmt = FORMATS[weights]
    if blocks is None:
        raise NotApplicable(f"--weights {weights} quantises the linear layers of the model's blocks, and "
                            f"{model_name or 'the model'} has no repeated blocks (an nn.ModuleList)", "drop --weights")
    # nn.MultiheadAttention reads its out_proj's weight directly: left as it is
    inside_mha = {f"{name}.{sub}" for name, mod in blocks.named_modules() if isinstance(mod, nn.MultiheadAttention)
                  for sub, _ in mod.named_modules() if sub}
    found = [(name, mod) for name, mod in blocks.named_modules()
             if isinstance(mod, nn.Linear) and name not in inside_mha]
    if not found:
        raise NotApplicable(f"--weights {weights} quantises the linear layers of the model's blocks, and "
                            f"{model_name or 'the model'}'s blocks have none", "drop --weights")
    count = 0
    for name, lin in found:
        parent_name, _, leaf = name.rpartition(".")
        parent = blocks.get_submodule(parent_name) if parent_name else blocks
        setattr(parent, leaf, QuantLinear(lin, fmt, compute_dtype))
        count += lin.weight.numel()
    return count
