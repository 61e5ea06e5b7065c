"""Vision Transformer (Dosovitskiy et al. 2021) as timm's vit_*_patch16_224: a 16x16 patch convolution,
a class token, learned positions, pre-LayerNorm blocks with a 4h GELU MLP and a 1000-class head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.configs import ViTConfig


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(3, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if images.shape[-1] != self.cfg.image_size or images.shape[-2] != self.cfg.image_size:
            raise ValueError(f"images must be {self.cfg.image_size}x{self.cfg.image_size}, got {tuple(images.shape)}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])
        return logits if targets is None else F.cross_entropy(logits, targets)
