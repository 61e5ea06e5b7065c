"""ResNet-50 (He et al. 2016) laid out as torchvision's resnet50 (stride on the 3x3 convolution, "v1.5")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.models.configs import ResNetConfig


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages, inplanes = [], 64
        for i, n in enumerate(cfg.layers):
            planes = 64 * 2**i
            for j in range(n):
                stages.append(Bottleneck(inplanes, planes, stride=2 if (j == 0 and i > 0) else 1))
                inplanes = planes * Bottleneck.expansion
        self.blocks = nn.ModuleList(stages)
        self.fc = nn.Linear(inplanes, cfg.num_classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 3, stride=2, padding=1)
        for block in self.blocks:
            x = block(x)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits if targets is None else F.cross_entropy(logits, targets)
