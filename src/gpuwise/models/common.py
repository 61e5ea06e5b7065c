"""Pieces the built-in models share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuwise.models.loss import lm_loss  # noqa: F401  (the standard loss, where it was)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # one (K, V) pair per block, each (B, n_kv_heads, S, hs)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention over (B, heads, T, head_dim), k and v possibly with fewer heads (GQA): PyTorch's SDPA,
    or gpuwise's block-sparse FlashAttention kernel (``impl="gpuwise"``)."""
    if impl == "gpuwise":
        from gpuwise.ops import attention

        return attention(q, k, v, causal=True)
    if impl != "sdpa":
        raise ValueError(f"attn_impl {impl!r} is not sdpa or gpuwise")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
