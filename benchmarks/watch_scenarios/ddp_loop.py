"""Scenario f: a user's own DDP loop, two processes on gloo (torch.multiprocessing), each timed with gpuwise.Monitor
and ``mon.ddp(model)``: a Linear(4096, 4096) (16.8 M parameters, 67 MB of gradients to all-reduce a step) at batch 4
(a few MFLOPs): the all-reduce is most of every step, and backward has almost nothing to hide it behind.

    python ddp_loop.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import Clock, diagnosis, emit, report
from torch import nn

WIDTH, BATCH, WORLD = 4096, 4, 2


def worker(rank: int, port: int, steps: int) -> None:
    from gpuwise import Monitor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(rank)
        model = nn.parallel.DistributedDataParallel(nn.Linear(WIDTH, WIDTH))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        with Monitor(interval_s=0.5) as mon:
            mon.ddp(model)
            clock = Clock()
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                mon.step(items=BATCH)
            wall = clock.seconds()
        if rank == 0:
            events = mon.record().steps
            exposed = [e.exposed_comm_s for e in events if e.exposed_comm_s is not None]
            emit(steps=steps, wall_s=wall, world=WORLD, grad_mb=4 * WIDTH * (WIDTH + 1) / 1e6,
                 step_median_s=statistics.median(e.seconds for e in events),
                 exposed_comm_median_s=statistics.median(exposed) if exposed else None,
                 diagnosis=diagnosis(mon), report=report(mon))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(free_port(), args.steps), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
