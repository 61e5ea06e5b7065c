"""Weight decay goes to the matrices of linear and convolution layers only."""

from __future__ import annotations

import torch
from torch import nn

from gpuwise.optim import param_groups


def _names(model: nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_norms_biases_and_embeddings_are_not_decayed():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Conv1d(4, 4, 3))
    decay, keep = param_groups(model, 0.1)
    assert (decay["weight_decay"], keep["weight_decay"]) == (0.1, 0.0)
    assert _names(model, decay) == {"2.weight", "3.weight"}
    assert _names(model, keep) == {"0.weight", "1.weight", "1.bias", "2.bias", "3.bias"}


def test_tied_and_frozen_parameters():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied as in GPT-2: an embedding table, so not decayed, and listed once
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "head": head, "frozen": frozen})
    groups = param_groups(model, 0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0 and groups[0]["params"] == [emb.weight]
    opt = torch.optim.AdamW(groups, lr=1e-3)  # AdamW takes the groups as they are
    assert len(opt.param_groups) == 1
