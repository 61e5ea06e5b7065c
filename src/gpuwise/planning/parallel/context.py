"""One rank of a context-parallel run (``--cp``), captured as it runs (not a formula after).

The model stays plain PyTorch; these functions cut it from outside after it is built (gpt-fast's ``apply_tp``),
inside the fake mode, so the capture records what one rank allocates and computes.

``--cp N`` (ring attention as torchtitan runs it: torch.distributed.tensor.experimental.context_parallel; Liu et
al. 2023): each rank holds s / N tokens (inputs, positions, every activation), and SDPA runs as the ring does:
N flash-attention steps against the K/V chunk received from the previous rank (a receive buffer each, K and V),
the first on its own chunk (causal), the others, load-balanced (head-tail sharding), on half a chunk each, the
partial outputs merged by their logsumexp; saved for backward: the local q, k, v, the output and the logsumexp;
backward passes the K/V chunks around again with their dK/dV accumulators. So attention FLOPs per rank are 1/N
of the whole causal attention. The model states shard over the data- and context-parallel ranks together
(torchtitan's ``dp_shard_cp`` mesh: context-parallel ranks hold the same parameters).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.planning.capture.blocks import find_blocks

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
    for block in find_blocks(built.model) or ():
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            with _RingMode(cp):
                return _inner(*args, **kwargs)

        block.forward = forward

    def chunk(t):
        return None if t is None else t[:, : t.shape[1] // cp].clone()

    return replace(built, inputs=tuple(chunk(t) for t in built.inputs), targets=chunk(built.targets))
