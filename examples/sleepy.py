"""A model and a Dataset whose items each take 1 ms to read, as from a slow disk: gpuwise train --model
examples/sleepy.py:build --data examples/sleepy.py:dataset shows an input-bound run and its fix (README)."""

import os
import time

import torch
from torch import nn


def build(batch):
    return nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 10)), torch.randn(batch, 256)


SLEEP_S = float(os.environ.get("SLEEPY_MS", "1")) / 1e3  # the tests make it slower than a busy CPU's compute


class Slow(torch.utils.data.Dataset):
    """Each item takes 1 ms to read (SLEEPY_MS), as from a slow disk."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(SLEEP_S)
        return torch.full((256,), (i % 7) / 7.0), i % 10


def dataset():
    return Slow()
