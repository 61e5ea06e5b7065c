"""Scenario g: an MLP of many small layers (8 x 256, batch 32: many short parallel regions, each ending in a barrier
of torch's OpenMP threads) trained with torch's default threads. The harness runs it on a host saturated by a CPU
hog on every core, once as it is and once with OMP_NUM_THREADS=1: threads that spin in barriers while the hog holds
the cores make every step wait for the slowest thread.

    python threads.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import Clock, Trainer, batches, diagnosis, emit, mlp

from gpuwise import Monitor

WIDTH, DEPTH, BATCH = 256, 8, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)  # the --seconds cap ends it: long enough for samples
    ap.add_argument("--seconds", type=float, default=8.0, help="stop after this long even if steps remain")
    args = ap.parse_args()
    trainer = Trainer(mlp(WIDTH, DEPTH))
    data = batches(4, BATCH, WIDTH)
    with Monitor(interval_s=0.5) as mon:
        clock = Clock()
        for i in range(args.steps):
            x, y = next(mon.loader([data[i % len(data)]]))
            trainer.step(x, y)
            mon.step(items=BATCH)
            if clock.seconds() > args.seconds and i >= 10:
                break
    steps = [e.seconds for e in mon.record().steps]
    emit(steps=len(steps), threads=torch.get_num_threads(), step_median_s=statistics.median(steps[2:] or steps),
         diagnosis=diagnosis(mon))


if __name__ == "__main__":
    main()
