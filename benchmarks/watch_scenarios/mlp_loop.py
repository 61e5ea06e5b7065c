"""Scenarios c, d, i, k, l: an MLP (3 x 512, batch 128: ~20-40 ms a step on two cores) trained on pre-made batches
through ``gpuwise.Monitor``, with one cause added by construction:

    python mlp_loop.py --threads 0                       # i: nothing added, torch's default threads (healthy)
    python mlp_loop.py --stall-every 10                  # c: every 10th step also sleeps 250-400 ms
    python mlp_loop.py --slow-step 50                    # k: step 50 alone sleeps 300 ms (one slow step)
    python mlp_loop.py --leak-mib 8                      # d: each step keeps 8 MiB more (a list that grows)
    python mlp_loop.py --leak-mib 8 --plateau 15         # l: the same for 15 steps, then a ring of 15 (flat)

It prints the diagnosis, ``Monitor.report()``, and what was true: samples over wall-clock seconds, the stall steps,
the process RSS growth per step (psutil, at the start and the end of the loop).
"""

from __future__ import annotations

import argparse
import random
import time

import psutil
import torch
from _common import Clock, Trainer, batches, diagnosis, emit, mlp, report

from gpuwise import Monitor

WIDTH, BATCH = 512, 128
STALL_S = (0.25, 0.40)  # issue 29: every 10th step 250-400 ms
SLOW_STEP_S = 0.30
MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stall-every", type=int, default=0)
    ap.add_argument("--slow-step", type=int, default=0)
    ap.add_argument("--leak-mib", type=float, default=0.0)
    ap.add_argument("--plateau", type=int, default=0, help="keep only the last N leaked tensors (a full cache)")
    ap.add_argument("--interval", type=float, default=0.25, help="the Monitor's sampling interval (s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's threads (0: its default); one keeps the base step steady on a shared host")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    trainer = Trainer(mlp(WIDTH))
    data = batches(8, BATCH, WIDTH)
    for x, y in data[:2]:  # the first steps' one-off costs, outside the judged loop
        trainer.step(x, y)
    kept: list[torch.Tensor] = []
    stalls: list[int] = []
    proc = psutil.Process()
    with Monitor(interval_s=args.interval) as mon:
        rss0, clock = proc.memory_info().rss, Clock()
        for i in range(1, args.steps + 1):
            x, y = next(mon.loader([data[i % len(data)]]))
            trainer.step(x, y)
            if args.leak_mib:
                kept.append(torch.ones(int(args.leak_mib * MiB) // 4))  # written: resident, not just reserved
                if args.plateau and len(kept) > args.plateau:
                    kept.pop(0)
            if args.stall_every and i % args.stall_every == 0:
                time.sleep(rng.uniform(*STALL_S))
                stalls.append(i)
            if args.slow_step == i:
                time.sleep(SLOW_STEP_S)
                stalls.append(i)
            mon.step(items=BATCH)
        wall, rss1 = clock.seconds(), proc.memory_info().rss
    steps = [e.seconds for e in mon.record().steps]
    emit(steps=args.steps, wall_s=wall, items=BATCH * args.steps, samples_per_s=BATCH * args.steps / wall,
         stall_steps=stalls, stall_share=sum(steps[i - 1] for i in stalls) / wall if stalls else 0.0,
         step_median_s=sorted(steps)[len(steps) // 2], rss_mib_per_step=(rss1 - rss0) / MiB / args.steps,
         leak_mib_per_step=args.leak_mib, threads=torch.get_num_threads(),
         load_1m=psutil.getloadavg()[0], diagnosis=diagnosis(mon), report=report(mon))


if __name__ == "__main__":
    main()
