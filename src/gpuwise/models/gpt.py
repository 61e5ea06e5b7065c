"""GPT-2 (Radford et al. 2019), written as nanoGPT writes it: pre-LayerNorm blocks, a 4h GELU MLP,
learned positions and an LM head tied to the token embedding. Attention runs through SDPA, or through
gpuwise's own kernel with ``attn_impl="gpuwise"``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.common import KVCache, cached_kv, causal_attention
from gpuwise.models.configs import GPTConfig
from gpuwise.models.loss import causal_lm_loss


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_impl = cfg.attn_impl
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None, pos: int = 0
                ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # (B, T, 3C) as one linear, or one tensor-parallel rank's heads
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        if cache is not None:  # prefill: keep K and V for the tokens to come; decode: add one and read them all
            k, v = cached_kv(cache, k, v, pos)
        y = causal_attention(q, k, v, self.attn_impl, causal=pos == 0)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None, pos: int = 0
                ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        for module in self.modules():  # GPT-2's init (as nanoGPT writes it): N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():  # and the scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None, pos: int = 0
    ) -> torch.Tensor:
        """``pos``: tokens already in ``kv_cache`` (a decode step feeds the next one)."""
        t = idx.shape[1]
        if pos + t > self.cfg.block_size:
            raise ValueError(f"sequence of {pos + t} tokens is longer than GPT-2's {self.cfg.block_size} positions")
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + t, device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x, None if kv_cache is None else kv_cache[i], pos)
        h = self.ln_f(x)
        if targets is None:
            return self.lm_head(h)
        return causal_lm_loss(self.cfg.loss, h, self.lm_head, targets)

    def kv_cache_shape(self, batch: int, seq: int) -> tuple[int, int, int, int]:
        return (batch, self.cfg.n_head, seq, self.cfg.n_embd // self.cfg.n_head)
