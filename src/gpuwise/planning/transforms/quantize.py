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

Mixture-of-Experts experts held as plain parameters (``fused_expert_weights``, experts.py): transformers 5 stacks
each MoE layer's routed experts into 3-D ``nn.Parameter`` stacks (``MixtralExperts.gate_up_proj``
``[E, 2 ffn, hidden]``, ``down_proj`` ``[E, hidden, ffn]``) run by ``torch._grouped_mm`` (integrations/moe.py), not
``nn.Linear``. What becomes of them depends on the library, so on the format (``EXPERT_FORMATS``):

- ``int4`` and ``fp8``: quantised, as vLLM's fused-MoE methods store stacked experts (``AWQMoEMethod`` /
  ``GPTQMarlinMoEMethod``: ``w13_qweight``, ``w13_qzeros``, ``w13_scales`` per expert in the linear layers' group-128
  layout; ``Fp8MoEMethod``: ``w13_weight`` float8 e4m3 and per-tensor fp32 scales): each expert's ``out x in``
  matrix takes the format's ``nbytes(out, in)`` (fp8: one scale for the fused gate/up matrix where vLLM keeps two,
  4 bytes an expert). Their kernels (``fused_marlin_moe``; ``fused_experts`` W8A8) read the packed weights in
  place: no 16-bit copy of an expert at any token count (unlike AutoAWQ's linear layers from 1024 tokens on). fp8
  quantises the tokens entering the experts to fp8 with one fp32 scale a token (``moe_kernel_quantize_input``),
  held while the experts run; the second matmul's quantised input is not modelled. Assumed: the routing,
  gathering and intermediate tensors stay as transformers' grouped forward makes them, in the compute dtype.
- ``nf4`` and ``int8`` (bitsandbytes): left in 16 bits. bitsandbytes' conversion under transformers 5 replaces
  ``nn.Linear`` only, so fused experts are skipped silently (bitsandbytes#1849, open; ``Experts4bit``, PR #1965, not
  merged). vLLM's ``experts_int8`` would store them in int8 with one fp32 scale a row (int8 x 16-bit matmuls), but
  ``--weights int8`` is bitsandbytes' LLM.int8 throughout, and so are its experts. For QLoRA (qlora.py) the
  same walker leaves them in the base's 16 bits, and PEFT's ``prepare_model_for_kbit_training`` then casts every
  16-bit parameter that is not ``Params4bit`` to fp32 (``--qlora-recipe plain`` keeps them 16-bit).
  ``experts_note`` is the line the plan prints when this happens.

>>> round(FORMATS["nf4"].bytes_per_weight(), 4)    # 4.127 bits (QLoRA §2)
0.5159
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.compat import _get_current_dispatch_mode_stack
from gpuwise.errors import NotApplicable
from gpuwise.planning.experts import fused_expert_weights

if TYPE_CHECKING:
    from gpuwise.planning.experts import Experts
    from gpuwise.planning.setup import Setup

NF4_BLOCK = 64  # bitsandbytes' default blocksize for 4-bit (FORMATS["nf4"] is also the QLoRA base: qlora.py)
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


EXPERT_FORMATS = frozenset({"int4", "fp8"})  # vLLM's fused-MoE kernels run stacked experts in these (docstring)


def _quantize_experts(owner: nn.Module, name: str, p: nn.Parameter, fmt: WeightFormat,
                      compute_dtype: torch.dtype) -> torch.Tensor:
    """``owner.name`` stored in ``fmt``, one ``out x in`` matrix an expert (transformers' ``is_transposed`` stacks
    hold ``[E, in, out]``). The forward reads a 16-bit stand-in, so the grouped matmul's FLOPs are counted without
    a 16-bit copy of the experts, as the fused kernels run: a plain attribute, not a buffer, so the plan does not
    count it as weights (one matrix repeated over the experts by a stride-0 view, as ``_grouped_mm`` wants each
    matrix laid out densely; a 2-D stack entirely stride 0)."""
    *lead, a, b = p.shape
    out_f, in_f = (b, a) if getattr(owner, "is_transposed", False) else (a, b)
    n = 1
    for d in lead:
        n *= d
    del owner._parameters[name]
    for buf, dtype, numel in fmt.tensors:
        owner.register_buffer(f"{name}_{buf}", torch.empty(n * numel(out_f, in_f), dtype=dtype, device=p.device))
    one = p.shape[-2:] if p.dim() > 2 else ()
    stand_in = torch.empty(one, dtype=compute_dtype, device=p.device).expand(p.shape)
    setattr(owner, name, stand_in)
    return stand_in


def _run_experts(module: nn.Module, stand_ins: list[torch.Tensor], input_dtype: torch.dtype | None) -> None:
    """The experts' forward as the fused kernels run it: the stand-ins' one matrix each counted as no memory (a
    recording dispatch mode, the planner's Tracker, is told to: ``tag`` then ``discount``), and with ``input_dtype``
    (fp8) the tokens quantised to it, one fp32 scale a token, held while the experts run."""
    inner = module.forward

    def forward(*args, **kwargs):
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "discount") and hasattr(mode, "tag"):
                mode.tag(stand_ins, "weights")
                mode.discount(stand_ins)
        x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        held = [] if x is None or input_dtype is None else [
            torch.empty(x.shape, dtype=input_dtype, device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)]
        out = inner(*args, **kwargs)
        del held
        return out

    module.forward = forward


def experts_note(setup: Setup, experts: Experts | None) -> str | None:
    """The line the plan prints when a bitsandbytes format (``--weights nf4|int8``, the ``--qlora`` base) leaves a
    Mixture of Experts' fused expert weights (``Experts.fused``) unquantised; None otherwise."""
    fused = experts.fused if experts is not None else 0
    qlora = setup.task == "finetune-lora" and setup.qlora
    if not fused or not (qlora or setup.weights in ("nf4", "int8")):
        return None
    what = "4-bit" if qlora or setup.weights == "nf4" else "int8 (LLM.int8)"
    half = setup.spec.compute
    kept = (f"they stay {half} (fp32 after PEFT's prepare_model_for_kbit_training; --qlora-recipe plain keeps them "
            f"{half})") if setup.peft_qlora else f"they stay {half}"
    return (f"{fused / 1e9:.1f} B expert weights are fused 3-D parameters, which bitsandbytes' {what} conversion "
            f"skips under transformers 5 (bitsandbytes#1849): {kept}")


def quantize_weights(blocks: nn.ModuleList | None, weights: str, compute_dtype: torch.dtype, *, model_name: str = ""
                     ) -> int:
    """Replace every ``nn.Linear`` inside ``blocks`` by its ``weights`` storage, and under ``EXPERT_FORMATS`` the
    fused expert weights too (module docstring); returns the weights quantised.

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
    if weights in EXPERT_FORMATS:
        owners: dict[int, tuple[nn.Module, list[torch.Tensor]]] = {}
        for owner, name, p in fused_expert_weights(blocks):
            owners.setdefault(id(owner), (owner, []))[1].append(_quantize_experts(owner, name, p, fmt, compute_dtype))
            count += p.numel()
        for owner, stand_ins in owners.values():
            _run_experts(owner, stand_ins, fmt.input_dtype)
    return count
