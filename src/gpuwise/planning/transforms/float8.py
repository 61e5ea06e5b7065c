"""``--precision fp8``: float8 training as torchao runs it, simulated on fake tensors.

torchao's ``convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear`` (pytorch/ao,
torchao/float8/float8_linear.py). With the default recipe (tensorwise dynamic scaling) its
``matmul_with_hp_or_float8_args`` autograd function:

- forward: saves the high-precision input and weight for backward (``ctx.save_for_backward(input_hp,
  weight_hp_t)``), casts both to float8 e4m3 with a scale from ``max(abs(x))`` and multiplies them with
  ``aten._scaled_mm`` into the high-precision output dtype;
- backward: casts the output gradient to e5m2 and the weight to e4m3 again for the input gradient, and the output
  gradient and the saved input again, in the transposed layouts, for the weight gradient.

So what backward keeps is what a bf16 linear keeps (its bf16 input: torchao casts the input to the autocast dtype
first, as autocast would); the fp8 copies are temporaries of each matmul. The weights stay as they are (fp32
masters under autocast, bf16 under FSDP2's mixed precision) and every other op (attention, norms, the loss) runs in
bf16: fp8 is a rate for the linear layers' GEMMs, not a storage type. Before torchao 0.8 (Jan 2025) the tensorwise
path saved the fp8 input and the fp8 weight instead (``manual_float8_matmul_with_args_in_float8``).

Modelled as torchao runs under ``torch.compile`` (its documented way, and torchtitan's): each cast is one reduction
for the amax and one kernel from high precision to fp8; eager torchao also materialises ``abs(x)`` and ``x * scale``
in high precision, briefly, for each cast. As torchtitan converts a model, the output head stays in bf16
(``filter_fqns=["output"]``) and so does a linear layer whose dimensions are not multiples of 16 (``_scaled_mm``
needs them).
"""

from __future__ import annotations

import torch
from torch import nn

from gpuwise.compat import scaled_mm

E4M3 = torch.float8_e4m3fn  # forward operands (torchao's e4m3_dtype)
E5M2 = torch.float8_e5m2  # gradients (e5m2_dtype: more range, less precision)
SCALED_MM_MULTIPLE = 16  # aten._scaled_mm needs both matrix dimensions to be multiples of 16


def _to_float8(x: torch.Tensor, dtype: torch.dtype, *, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(2-D ``x`` in fp8, laid out row- or column-major, and its fp32 scale): tensorwise dynamic scaling as inductor
    fuses torchao's ``hp_tensor_to_float8_dynamic``: one reduction for amax = max(abs(x)) (no abs(x) copy), and one
    kernel that reads ``x`` and writes fp8 in the layout ``_scaled_mm`` wants. The simulation casts without applying
    the scale and hands ``_scaled_mm`` the amax as it (a fake step's values do not matter; its bytes and FLOPs do)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    if column_major:
        return x.t().to(dtype, memory_format=torch.contiguous_format).t(), amax
    return x.to(dtype, memory_format=torch.contiguous_format), amax


class _Float8Matmul(torch.autograd.Function):
    """y = x @ w^T with both operands cast to fp8 for ``_scaled_mm``; saves x and w as given (high precision)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.out_dtype = out_dtype
        x8, sx = _to_float8(x.reshape(-1, x.shape[-1]), E4M3)
        w8, sw = _to_float8(w, E4M3)  # (out, in) row-major: its transpose is the column-major operand
        y = scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype, use_fast_accum=True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        # grad_input = g @ w: g in e5m2, w cast to e4m3 again, column-major
        g8, sg = _to_float8(g2, E5M2)
        w8, sw = _to_float8(w, E4M3, column_major=True)
        grad_x = scaled_mm(g8, w8, scale_a=sg, scale_b=sw, out_dtype=ctx.out_dtype, use_fast_accum=False)
        del g8, w8
        # grad_weight = g^T @ x: g^T row-major and x column-major, each cast again from high precision
        gt8, sgt = _to_float8(g2.t(), E5M2)
        xt8, sxt = _to_float8(x.reshape(-1, x.shape[-1]), E4M3, column_major=True)
        grad_w = scaled_mm(gt8, xt8, scale_a=sgt, scale_b=sxt, out_dtype=ctx.out_dtype, use_fast_accum=False)
        return grad_x.reshape(*grad.shape[:-1], x.shape[-1]), grad_w, None


class Float8Linear(nn.Module):
    """An ``nn.Linear`` whose matmul runs in fp8 (torchao's Float8Linear, default recipe); the bias is added in the
    output dtype. The input is cast to ``compute_dtype`` first, as torchao does under autocast."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Float8Matmul.apply(x.to(self.compute_dtype), self.weight, self.compute_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def float8_eligible(name: str, linear: nn.Linear, head: str | None) -> bool:
    """torchtitan's filter: not the output head, and both dimensions multiples of 16."""
    return (name != head and linear.in_features % SCALED_MM_MULTIPLE == 0
            and linear.out_features % SCALED_MM_MULTIPLE == 0)


def apply_float8(model: nn.Module, compute_dtype: torch.dtype, head: str | None) -> int:
    """Swap every eligible ``nn.Linear`` of ``model`` for a ``Float8Linear``; returns how many were swapped."""
    swapped = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and float8_eligible(name, mod, head):
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, Float8Linear(mod, compute_dtype))
            swapped += 1
    return swapped
