"""A causal language model's loss, three ways: what ``--loss standard|chunked|fused`` runs.

All three take the last hidden state ``(B, T, H)``, the output projection (the LM head) and the targets
``(B, T)``, and return the mean next-token cross-entropy over the targets that are not ``IGNORE_INDEX``. They
differ only in what they allocate, and that is what the planner records:

- ``standard``: the whole ``(B, T, V)`` logits, up-cast to fp32, then cross-entropy, as Hugging Face
  transformers computes it by default (``ForCausalLMLoss`` in transformers/loss/loss_utils.py:
  ``logits = logits.float()`` before ``nn.functional.cross_entropy``). Under autocast the up-cast is what
  autocast would do anyway (``cross_entropy`` is on CUDA's fp32 list); in pure bf16 it doubles the logits.
  The forward briefly holds the bf16 logits, their fp32 copy and the fp32 log-probabilities that
  ``log_softmax`` saves for backward; backward makes fp32 gradients of the same size.
- ``chunked``: torchtune's chunked cross-entropy (``CEWithChunkedOutputLoss`` and its successor
  ``LinearCrossEntropyLoss`` in torchtune/modules/loss/, both ``num_output_chunks: int = 8``): the hidden
  states are split into 8 chunks along the sequence (``tensor_split(8, dim=1)``) and each chunk is projected,
  up-cast and reduced with ``reduction="sum"`` before the next; the sum is divided by the number of targets.
  Here the chunks are taken from the flattened batch, B x T / 8 tokens each as torchtune's, so that every batch
  size runs the same ops (the planner pairs captures at two batch sizes op by op); torchtune's own, not
  contiguous when B > 1, are copied once more before their matmul (a bf16 chunk of hidden states, transient).
  Run eagerly, as torchtune's recipes do by default (``compile: False``), each chunk's ``log_softmax`` still
  saves its fp32 output for backward, so the fp32 log-probabilities of the whole sequence are alive at the end
  of the forward (the activations column does not shrink). What never exists at once is the rest: the bf16
  logits and the fp32 copy of the whole sequence in the forward, and the fp32 gradients of the whole sequence
  in the backward (one chunk at a time there), which is where the standard loss peaks for a large vocabulary.
- ``fused``: a fused linear + cross-entropy that never materialises the logits, as Liger-Kernel's
  ``LigerFusedLinearCrossEntropyFunction`` (liger_kernel/ops/fused_linear_cross_entropy.py) runs it: the
  gradient is computed in the forward, chunk by chunk; each chunk's logits are overwritten in place with their
  gradient (Liger's Triton kernel works on one row in registers), which is then multiplied into
  ``grad_input = zeros_like(input)`` and accumulated into ``grad_weight = zeros_like(weight)`` (fp32 for fp32
  master weights; none when the head is frozen, as under LoRA; and ``grad_bias`` for a head with a bias). Only
  those are saved for backward, which scales them by the incoming gradient in place. Liger's chunk is
  ``next_power_of_2(ceil(B*T / ceil(V / H)))`` rows of the flattened batch, so that one chunk of logits is about
  the size of the hidden states; here it is B x ``next_power_of_2(ceil(T / ceil(V / H)))`` rows, the same number
  of chunks at every batch size: the same chunks as Liger's when B is a power of two, else within 2x of its rows
  (one chunk of logits is alive at a time). Apple's Cut Cross-Entropy (Wijmans et al. 2024) saves less still
  (the fp32 log-sum-exp per token, recomputing blocks of logits in backward): not modelled.

For ``--hf-config`` the chunked and fused losses are computed outside the model, from the base model's last
hidden state and ``get_output_embeddings()``, as Liger and torchtune do; a model that scales or soft-caps its
logits (Cohere's ``logit_scale``, Gemma 2's ``final_logit_softcapping``) does that elementwise on each chunk
there, a transient this leaves out.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.errors import GpuwiseError

LossKind = Literal["standard", "chunked", "fused"]
LOSSES: tuple[str, ...] = ("standard", "chunked", "fused")
CHUNKS = 8  # torchtune: CEWithChunkedOutputLoss(num_output_chunks=8), LinearCrossEntropyLoss(num_output_chunks=8)
IGNORE_INDEX = -100  # PyTorch's and transformers' default


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over ``(B, T, V)`` logits, up-cast to fp32 first as transformers does."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunks: int = CHUNKS
                          ) -> torch.Tensor:
    """torchtune's chunked cross-entropy: project, up-cast and reduce one chunk of the sequence at a time."""
    total = 0.0
    pairs = zip(hidden.flatten(0, -2).tensor_split(chunks), targets.flatten().tensor_split(chunks), strict=True)
    for h, t in pairs:
        total = total + F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum()


@contextlib.contextmanager
def _kernel(device: torch.device) -> Iterator[None]:
    """What one fused kernel does on its rows, outside autocast (and gpuwise's CUDA emulation, a torch-function
    mode): its reductions run in fp32 registers, not on fp32 copies of the chunk."""
    with torch._C.DisableTorchFunction(), torch.autocast(device.type, enabled=False):
        yield


def _cross_entropy_rows_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-row loss (fp32, already divided by the number of targets: ``scale`` is 1 / that number) of the
    ``(..., V)`` logits, which are overwritten in place with the gradient of the mean loss, as Liger's kernel does."""
    valid = (targets != IGNORE_INDEX).unsqueeze(-1)
    index = targets.clamp(min=0).unsqueeze(-1)
    picked = logits.gather(-1, index).float()
    top = logits.amax(-1, keepdim=True)
    logits.sub_(top).exp_()
    total = logits.sum(-1, keepdim=True, dtype=torch.float32)
    loss = (top.float() + total.log() - picked) * valid * scale
    logits.div_(total)  # softmax
    logits.scatter_add_(-1, index, torch.full_like(picked, -1.0, dtype=logits.dtype))  # minus the one-hot target
    logits.mul_(valid * scale)
    return loss.squeeze(-1)


class _GradientsFromForward(torch.autograd.Function):
    """The loss whose gradients were computed in the forward: backward only scales them by the incoming
    gradient, in place (Liger's ``element_mul_kernel``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, grad_hidden, grad_weight, grad_bias):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return rows.sum()

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.saved_tensors
        for g in grads:
            if g is not None:
                g.mul_(grad)
        return grads[0], grads[1], grads[2], None, None, None, None


def _accumulate_(grad_weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``grad_weight += a @ b`` with no temporary the size of the weight: Liger's ``torch.addmm(..., out=
    grad_weight)``, with ``out_dtype=torch.float32`` for bf16 operands and fp32 master weights (CUDA, sm80+); the
    CPU has no such kernel, so there the operands are up-cast first. Ops with ``out=`` are not autocast's."""
    with _kernel(grad_weight.device):
        if a.dtype == grad_weight.dtype and b.dtype == grad_weight.dtype:
            torch.addmm(grad_weight, a, b, out=grad_weight)
            return
        try:
            torch.addmm(grad_weight, a, b, out_dtype=grad_weight.dtype, out=grad_weight)
        except (RuntimeError, NotImplementedError):
            torch.addmm(grad_weight, a.to(grad_weight.dtype), b.to(grad_weight.dtype), out=grad_weight)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Liger's fused linear + cross-entropy: the mean loss of ``hidden @ weight.T (+ bias)`` against ``targets``
    without the whole logits, its gradients computed chunk by chunk in the forward."""
    b, t, h = hidden.shape
    rows = min(t, 1 << (math.ceil(t / math.ceil(weight.shape[0] / h)) - 1).bit_length())  # Liger's, per sequence
    chunks = math.ceil(t / rows)
    need_input = hidden.requires_grad and torch.is_grad_enabled()
    need_weight = need_input and weight.requires_grad
    with torch.no_grad():
        grad_hidden = torch.zeros_like(hidden, memory_format=torch.contiguous_format)
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_input and bias is not None and bias.requires_grad else None
        losses = torch.zeros(b * t, dtype=torch.float32, device=hidden.device)
        scale = 1.0 / (targets != IGNORE_INDEX).sum().clamp(min=1)
        parts = (hidden.flatten(0, 1).tensor_split(chunks), targets.flatten().tensor_split(chunks),
                 grad_hidden.flatten(0, 1).tensor_split(chunks), losses.tensor_split(chunks))
        for x, y, gx, loss in zip(*parts, strict=True):
            logits = x @ weight.t()  # the compute dtype under autocast
            if bias is not None:
                logits = logits + bias
            with _kernel(hidden.device):
                loss.copy_(_cross_entropy_rows_(logits, y, scale))
            if not need_input:
                continue
            gx.copy_(logits @ weight)
            if grad_weight is not None:
                _accumulate_(grad_weight, logits.t(), x.to(logits.dtype))
            if grad_bias is not None:
                torch.add(grad_bias, logits.sum(0), out=grad_bias)
            del logits
    if not need_input:
        return losses.sum()
    return _GradientsFromForward.apply(hidden, weight, bias, losses, grad_hidden, grad_weight, grad_bias)


def causal_lm_loss(kind: str, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a causal LM from its last hidden state and its LM head, ``kind`` one of ``LOSSES``."""
    if kind == "standard":
        return lm_loss(head(hidden), targets)
    if kind == "chunked":
        return chunked_cross_entropy(hidden, head, targets)
    if kind == "fused":
        if not isinstance(head, nn.Linear):
            raise GpuwiseError("--loss fused takes the LM head's weight, and the head is wrapped (a LoRA target)",
                               "leave the head out of --lora-targets, or pass --loss chunked")
        return fused_linear_cross_entropy(hidden, head.weight, targets, head.bias)
    raise ValueError(f"loss {kind!r} is not one of {', '.join(LOSSES)}")
