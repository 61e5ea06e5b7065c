"""Pieces the built-in models share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuwise.models.loss import lm_loss  # noqa: F401  (the standard loss, where it was)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # one (K, V) pair per block, each (B, n_kv_heads, S, hs)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str, *, causal: bool = True
                     ) -> torch.Tensor:
    """Causal attention over (B, heads, T, head_dim), k and v possibly with fewer heads (GQA): PyTorch's SDPA,
    gpuwise's block-sparse FlashAttention kernel (``impl="gpuwise"``), or the math path (``impl="eager"``, nanoGPT's
    non-flash branch: the (B, heads, T, S) scores and their softmax kept for backward). ``causal=False``: one new
    token's query over a KV cache that holds only earlier tokens (a decode step), where the causal mask hides
    nothing."""
    if impl == "gpuwise":
        from gpuwise.ops import attention

        return attention(q, k, v, causal=causal)
    if impl == "eager":
        if k.shape[1] != q.shape[1]:  # each K/V head serves heads / kv_heads query heads (Llama's repeat_kv)
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, T, S)
        if causal:
            t, s = q.shape[-2], k.shape[-2]
            keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
            att = att.masked_fill(~keep, float("-inf"))
        return F.softmax(att, dim=-1) @ v
    if impl != "sdpa":
        raise ValueError(f"attn_impl {impl!r} is not sdpa, gpuwise or eager")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def cached_kv(cache, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the K and V of tokens ``pos..pos+T`` into a preallocated cache (B, n_kv, S, hs) and return its first
    pos+T tokens, as gpt-fast's static KVCache does (``pos`` 0: a prefill; T = 1 after it: a decode step)."""
    t = k.shape[2]
    if pos and t != 1:
        raise ValueError(f"a step at position {pos} feeds one token, not {t}")
    cache[0][:, :, pos:pos + t].copy_(k)
    cache[1][:, :, pos:pos + t].copy_(v)
    return cache[0][:, :, :pos + t], cache[1][:, :, :pos + t]
