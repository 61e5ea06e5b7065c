"""Which parameters get weight decay, decided once for the trainer and for the step the planner simulates.

Decay shrinks weights toward zero: right for the matrices of linear and convolution layers, wrong for
norm gains and biases (nanoGPT's ``configure_optimizers`` keeps them out by ``dim() < 2``) and for
embedding tables (Megatron-LM, torchtitan and HF's Trainer leave them out too: a rare token's row would
decay on every step and be learned on few).

>>> # torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-4)
"""

from __future__ import annotations

from typing import Any

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices, and the undecayed rest (norms, biases, embeddings); empty groups left
    out. Only parameters that require gradients; a parameter shared by two modules is counted once."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                  for p in m.parameters(recurse=False)}
    decay, keep, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embeddings else keep).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
