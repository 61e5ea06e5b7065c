"""Scenario h: a tiny model (2 x Linear(16, 16)) at batch 4 on the CPU, timed with gpuwise.Monitor: each step is
a few microseconds of arithmetic under tens of microseconds of Python and dispatch, so the host's overhead is the
step. Then the same model at batch 256 (64x), timed the same way: the overhead is paid once a step, so samples/s
grows nearly with the batch.

    python tiny_model.py
"""

from __future__ import annotations

import argparse

from _common import Clock, Trainer, batches, diagnosis, emit, mlp

from gpuwise import Monitor

WIDTH = 16
SMALL, LARGE = 4, 256


def run(trainer: Trainer, batch: int, steps: int) -> tuple[float, dict]:
    data = batches(4, batch, WIDTH)
    with Monitor(interval_s=0.25) as mon:
        clock = Clock()
        for i in range(steps):
            x, y = next(mon.loader([data[i % len(data)]]))
            trainer.step(x, y)
            mon.step(items=batch)
        wall = clock.seconds()
    return batch * steps / wall, diagnosis(mon)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args()
    # torch's default intra-op threads, as a user runs it: the tiny ops never engage them
    trainer = Trainer(mlp(WIDTH, 2))
    small_rate, small = run(trainer, SMALL, args.steps)
    large_rate, large = run(trainer, LARGE, args.steps)
    emit(steps=args.steps, small_batch=SMALL, large_batch=LARGE, small_samples_per_s=small_rate,
         large_samples_per_s=large_rate, gain=large_rate / small_rate, diagnosis=small, large_diagnosis=large)


if __name__ == "__main__":
    main()
