"""Scenarios a, b, j: a Dataset that sleeps 5 ms an item (a slow disk), no workers, 8 items a batch (40 ms of waiting
a step) and a tiny model (about a millisecond of compute): the loop waits on its data ~95% of the time.

    python sleepy_loader.py              # a plain loop (a: run it under gpuwise watch, which cannot see the loop)
    python sleepy_loader.py --monitor    # the same loop timed with gpuwise.Monitor (b; j: under gpuwise watch)
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import Clock, Trainer, diagnosis, emit, mlp, monitored

SLEEP_S = 0.005  # a 5 ms read per item (issue 29)
BATCH = 8
WIDTH = 64


class Slow(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.slept_s = 0.0  # what the reads really took (a sleep overshoots on a loaded host)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        t = time.perf_counter()
        time.sleep(SLEEP_S)
        self.slept_s += time.perf_counter() - t
        return torch.full((WIDTH,), (i % 7) / 7.0), torch.zeros(WIDTH)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--monitor", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    trainer = Trainer(mlp(WIDTH, 2))
    data = Slow()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, num_workers=0)
    if not args.monitor:
        clock = Clock()
        for i, (x, y) in enumerate(loader):
            trainer.step(x, y)
            if i + 1 == args.steps:
                break
        emit(seconds=clock.seconds(), steps=args.steps, slept_share=data.slept_s / clock.seconds())
        return
    mon, wall = monitored(trainer, loader, args.steps, BATCH)
    emit(seconds=wall, steps=args.steps, slept_share=data.slept_s / wall, diagnosis=diagnosis(mon))


if __name__ == "__main__":
    main()
