"""BERT (Devlin et al. 2019) as Hugging Face's BertForSequenceClassification: post-LayerNorm encoder,
token + position + segment embeddings, a tanh pooler and a 2-class head. Attention runs through SDPA, or
``attn_impl="eager"``'s math path (scores, softmax, matmul) as NVIDIA DeepLearningExamples' BERT runs it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.common import causal_attention
from gpuwise.models.configs import BertConfig


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_impl = cfg.attn_impl
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.intermediate = nn.Linear(cfg.hidden, cfg.intermediate)
        self.output = nn.Linear(cfg.intermediate, cfg.hidden)
        self.out_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))  # (B, nh, T, hs)
        y = causal_attention(q, k, v, self.attn_impl, causal=False).transpose(1, 2).reshape(b, t, c)
        x = self.attn_norm(x + self.attn_out(y))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.embed_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.blocks = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_labels)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_positions:
            raise ValueError(f"sequence of {t} tokens is longer than BERT's {self.cfg.max_positions} positions")
        pos = torch.arange(t, device=idx.device)
        segments = self.token_type_embeddings(torch.zeros_like(idx))
        x = self.word_embeddings(idx) + self.position_embeddings(pos) + segments
        x = self.embed_norm(x)
        for block in self.blocks:
            x = block(x)
        logits = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return logits if targets is None else F.cross_entropy(logits, targets)
