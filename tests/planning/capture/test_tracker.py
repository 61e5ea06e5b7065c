"""Activation memory against Korthikanti et al. 2022 (arXiv:2205.05198, sec. 4.1):
one GPT layer in 16 bits with explicit attention keeps s*b*h*(34 + 5*a*s/h) bytes for backward;
with flash attention (SDPA) the 5*a*s/h term goes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Built

S, B, H, A = 512, 2, 1024, 16  # sequence, micro-batch, hidden, heads
P = 0.1  # dropout everywhere the paper has it


class PaperLayer(nn.Module):
    """The layer as the paper counts it: LN, QKV, explicit softmax attention with dropout, out-proj + dropout,
    LN, 4h GELU MLP + dropout."""

    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (z.view(b, s, A, h // A).transpose(1, 2).contiguous() for z in self.qkv(self.ln1(x)).split(h, 2))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = F.dropout(torch.softmax(q @ k.transpose(-2, -1) / (h // A) ** 0.5, dim=-1), P)
            y = att @ v
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), P)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), P)


class Stack(nn.Module):
    def __init__(self, n_layer: int, sdpa: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PaperLayer(sdpa) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class StackSource:
    sdpa: bool
    name: str = "paper-layer"
    n_layer: int | None = None

    def check(self, setup: Setup) -> None:
        pass

    def tokens(self, setup: Setup) -> int:
        return S

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        model = Stack(n_layer or 1, self.sdpa)
        x = torch.randn(batch, S, H, requires_grad=True)
        return Built(model=model, inputs=(x,), targets=None,
                     run=lambda m, inputs, targets, kv: m(*inputs).float().square().mean())


def _activations_per_layer(sdpa: bool) -> float:
    setup = Setup(precision="bf16", optimizer="sgd")  # pure 16-bit, as the paper counts
    act = CATEGORIES.index("activations")
    per = []
    for n in (1, 2):
        c = capture(StackSource(sdpa=sdpa), setup, batch=B, n_layer=n)
        per.append(c.live[c.end_of_forward, act])
    return float(per[1] - per[0])  # one more layer, everything else equal


@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit-attention", "sdpa"])
def test_activations_per_layer_match_korthikanti(sdpa):
    sbh = S * B * H
    expected = sbh * 34 + (0 if sdpa else 5 * A * S * S * B)
    got = _activations_per_layer(sdpa)
    print(f"\nper layer: {got / sbh:.2f} sbh measured, {expected / sbh:.2f} sbh (Korthikanti), "
          f"ratio {got / expected:.3f}")
    assert got == pytest.approx(expected, rel=0.05), f"{got / sbh:.2f} sbh vs {expected / sbh:.2f} sbh"


def test_ops_carry_their_kernel_family_and_gemm_shape():
    """The kernel-time model reads each op's family and the (b, m, n, k) its kernel runs: a linear layer's forward
    is (tokens, in) x (in, out), its two backward GEMMs the transposes; a convolution is its implicit GEMM (N x output
    pixels, output channels, input channels x kernel size); a batched matmul keeps its batch; SDPA is one fused
    attention kernel over (batch x heads) score matrices."""
    from gpuwise.compat import FakeTensorMode
    from gpuwise.planning.capture.tracker import FAMILIES, Tracker

    with FakeTensorMode():
        lin = nn.Linear(64, 96)
        conv = nn.Conv2d(3, 16, kernel_size=3, padding=1)
        x = torch.randn(8, 64, requires_grad=True)
        img = torch.randn(2, 3, 10, 10)
        q = torch.randn(2, 4, 32, 16)
        with Tracker() as tr:
            lin(x).sum().backward()
            conv(img)
            torch.bmm(torch.randn(5, 7, 11), torch.randn(5, 11, 13))
            F.scaled_dot_product_attention(q, q, q)
            torch.softmax(torch.randn(4, 4), dim=-1)
    rows = tr.op_rows()
    got = {(FAMILIES[f], tuple(int(v) for v in d)) for f, d in zip(rows.family, rows.dims, strict=True)
           if FAMILIES[f] in ("matmul", "bmm", "conv", "attention")}
    assert ("matmul", (1, 8, 96, 64)) in got  # x @ W^T
    assert ("matmul", (1, 8, 64, 96)) in got  # grad_x = grad_y @ W
    assert ("matmul", (1, 96, 64, 8)) in got  # grad_W = grad_y^T @ x
    assert ("conv", (1, 2 * 10 * 10, 16, 3 * 9)) in got
    assert ("bmm", (5, 7, 13, 11)) in got
    assert ("attention", (8, 32, 32, 16)) in got
    families = {FAMILIES[f] for f in rows.family}
    assert {"softmax", "reduction", "elementwise"} <= families
