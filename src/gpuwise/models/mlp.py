"""A plain multilayer perceptron: Linear + GELU blocks on feature vectors, then a classifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.configs import MLPConfig


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.in_features, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = F.gelu(self.inp(x))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if targets is None else F.cross_entropy(logits, targets)
