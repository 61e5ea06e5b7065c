"""A user's own DDP loop (no ``gpuwise train``) under ``gpuwise.Monitor`` with ``mon.ddp(model)``, for
``test_user_ddp.py``:

    GPUWISE_WATCH_EVENTS=EVENTS torchrun --standalone --nproc_per_node 2 ddp_user_loop.py OUT.json STEPS [SLOW SLEEP]

The model is one Linear(4096, 4096): 16.8M parameters, 67 MB of gradients to all-reduce over gloo for a batch of 4
(a few MFLOPs), so the all-reduce dwarfs the work by construction. With SLOW and SLEEP, rank SLOW's batches take
SLEEP seconds each to load (a slow shard): the straggler by construction. Every rank appends its step events to
EVENTS (``Monitor``'s own); rank 0 writes OUT.json: its own diagnosis and steps, the loop's own backward time each
step and the same backward's time under ``no_sync`` (their difference is the reference for the exposed
communication), the exposed communication the monitor took for ``no_sync`` steps, and the largest difference
between DDP's gradients through the monitor's hook and a hand all-reduce of the ``no_sync`` gradients.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from gpuwise import Monitor


def batches(n: int, rank: int, sleep: float):
    """n batches of 4 (each rank its own data: the averaged gradient differs from each rank's own); ``sleep``
    seconds to load each."""
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(n):
        if sleep:
            time.sleep(sleep)
        yield torch.randn(4, 4096, generator=g)


def main(out: str, steps: int, slow: int | None, sleep: float) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4096, 4096))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    backward_s, local_s, no_sync_exposed = [], [], []
    with Monitor(interval_s=0.5, gpus=False) as mon:
        mon.ddp(model)
        for x in mon.loader(batches(steps, rank, sleep if rank == slow else 0.0)):
            loss = model(x).square().mean()
            t = time.perf_counter()
            loss.backward()
            backward_s.append(time.perf_counter() - t)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step(items=len(x))
        diagnosis = mon.diagnose()
        own_steps = mon.record().steps
        # the same backward without its all-reduce: no hook runs, the monitor takes nothing
        for x in batches(steps, rank, 0.0):
            with model.no_sync():  # the forward decides: under no_sync, its backward does not all-reduce
                loss = model(x).square().mean()
                t = time.perf_counter()
                loss.backward()
                local_s.append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
            no_sync_exposed.append(mon.step().exposed_comm_s)
        # the hook's gradients against a hand all-reduce of this rank's own gradients
        x = next(batches(1, rank, 0.0))
        with model.no_sync():
            model(x).square().mean().backward()
        own = [p.grad.clone() for p in model.parameters()]
        for g in own:
            dist.all_reduce(g)
            g /= world
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        grad_diff = max(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), own, strict=True))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"diagnosis": dataclasses.asdict(diagnosis), "backward_s": backward_s,
                       "local_backward_s": local_s, "grad_diff": grad_diff, "no_sync_exposed": no_sync_exposed,
                       "steps": [dataclasses.asdict(s) for s in own_steps]}, f, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[1]), int(args[2]) if len(args) > 2 else None, float(args[3]) if len(args) > 3 else 0.0)
