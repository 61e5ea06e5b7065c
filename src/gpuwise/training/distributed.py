"""Data parallelism under torchrun: which process this is, and the process group (NCCL on GPUs, gloo on CPUs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # the processes on this machine, which share its cores

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Ranks:
        """torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (a plain ``python`` run is one process)."""
        return cls(rank=int(environ.get("RANK", 0)), world_size=int(environ.get("WORLD_SIZE", 1)),
                   local_rank=int(environ.get("LOCAL_RANK", 0)),
                   local_world_size=int(environ.get("LOCAL_WORLD_SIZE", 1)))

    @property
    def main(self) -> bool:
        return self.rank == 0


def start(ranks: Ranks, device: torch.device) -> None:
    if ranks.world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":  # before NCCL, pinned memory or a context touch GPU 0 from every process
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def agree_min(ranks: Ranks, value: int, device: torch.device) -> int:
    """The smallest of every process's ``value`` (each plans from its own free memory)."""
    if ranks.world_size == 1:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def stop(ranks: Ranks, *, clean: bool = True) -> None:
    """Leave the process group. After a run that finished (``clean``), wait for every process first: one that
    tears down while another still talks to it makes NCCL or gloo abort the other at exit."""
    if ranks.world_size > 1 and dist.is_initialized():
        if clean:
            if torch.cuda.is_available() and dist.get_backend() == "nccl":
                torch.cuda.synchronize()
            dist.barrier()
        dist.destroy_process_group()
