"""Scenario e: a Dataset that burns CPU for each item (a Python loop, as decoding or augmenting does), no workers,
16 items a batch, a small model. The harness runs it with a CPU hog on every core (a busy host): the loop waits on
a loader that needs cores, and more workers than the usable cores cannot help.

    python cpu_loader.py
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import Trainer, diagnosis, emit, mlp, monitored

from gpuwise.environment import usable_cores

BATCH, WIDTH = 16, 64
SPIN = 20_000  # Python-loop iterations an item: ~1.5 ms of one idle core


class Burn(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.cpu_s = 0.0  # CPU seconds the items took (this process: no workers)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        t = time.process_time()
        acc = 0
        for k in range(SPIN):
            acc += k * k % 7
        self.cpu_s += time.process_time() - t
        return torch.full((WIDTH,), (acc + i) % 7 / 7.0), torch.zeros(WIDTH)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the loader is the cause here; scenario g is the threads'
    trainer = Trainer(mlp(WIDTH, 2))
    data = Burn()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, num_workers=0)
    mon, wall = monitored(trainer, loader, args.steps, BATCH)
    emit(steps=args.steps, wall_s=wall, item_cpu_ms=1e3 * data.cpu_s / (BATCH * args.steps),
         loader_cpu_share=data.cpu_s / wall, usable_cores=usable_cores(), diagnosis=diagnosis(mon))


if __name__ == "__main__":
    main()
