"""MobileNetV2 (Sandler et al. 2018) laid out as torchvision's mobilenet_v2: the small vision model edge chips run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.configs import MobileNetConfig

# (expansion t, output channels c, repeats n, first stride s): Table 2 of the paper
_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
             (6, 320, 1, 1))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = _conv_bn(cin, hidden, 1, 1) if expand != 1 else None
        self.depthwise = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.project = _conv_bn(hidden, cout, 1, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x if self.expand is None else F.relu6(self.expand(x))
        y = self.project(F.relu6(self.depthwise(y)))
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    def __init__(self, cfg: MobileNetConfig) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 32, 3, 2)
        blocks, cin = [], 32
        for t, c, n, s in _SETTINGS:
            for i in range(n):
                blocks.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        self.blocks = nn.ModuleList(blocks)
        self.head = _conv_bn(cin, 1280, 1, 1)
        self.classifier = nn.Linear(1280, cfg.num_classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = F.relu6(self.stem(images))
        for block in self.blocks:
            x = block(x)
        x = F.relu6(self.head(x))
        logits = self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits if targets is None else F.cross_entropy(logits, targets)
