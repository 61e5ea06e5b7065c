"""Llama 2 / Llama 3 (Touvron et al. 2023; Meta 2024) as Meta's reference code writes them: RMSNorm,
rotary positions, grouped-query attention (n_kv_heads < n_heads), a SwiGLU MLP, no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.common import KVCache, cached_kv, causal_attention
from gpuwise.models.configs import LlamaConfig
from gpuwise.models.loss import causal_lm_loss


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # normalise in fp32, as Meta's code does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout. x: (B, nh, T, hs); cos, sin: (T, hs/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.attn_impl = cfg.attn_impl
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, pos: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.wv(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cached_kv(cache, k, v, pos)
        y = causal_attention(q, k, v, self.attn_impl, causal=pos == 0)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, pos: int = 0) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # Llama 3.2 1B and 3B
            self.output.weight = self.tok_embeddings.weight

    def rope(self, t: int, device: torch.device, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.cfg.dim // self.cfg.n_head
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(start, start + t, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
        return angles.cos(), angles.sin()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None, pos: int = 0
    ) -> torch.Tensor:
        """``pos``: tokens already in ``kv_cache`` (a decode step feeds the next one)."""
        x = self.tok_embeddings(idx)
        cos, sin = self.rope(idx.shape[1], idx.device, pos)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if kv_cache is None else kv_cache[i], pos)
        h = self.norm(x)
        if targets is None:
            return self.output(h)
        return causal_lm_loss(self.cfg.loss, h, self.output, targets)

    def kv_cache_shape(self, batch: int, seq: int) -> tuple[int, int, int, int]:
        return (batch, self.cfg.n_kv_head, seq, self.cfg.dim // self.cfg.n_head)
