"""Pieces the built-in models share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # one (K, V) pair per block, each (B, n_kv_heads, S, hs)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a (B, T, V) logits tensor."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
