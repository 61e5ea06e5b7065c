"""Activation checkpointing, FSDP2, torch.compile and DDP, applied to a plain model from outside (torchtitan's
``parallelize.py``, gpt-fast's ``tp.py``): the model code knows nothing of them.

The order is torchtitan's: checkpointing wraps each block first; then either FSDP2 shards each block and the
root (and compiles in place), or torch.compile runs before DDP wraps the module (nanoGPT's order: the module's
forward is what gets compiled).

>>> # p = parallelize(model, optimizer, config, device=torch.device("cuda:0"), world_size=2)
"""

from __future__ import annotations

import contextlib
import inspect
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from gpuwise.compat import fsdp2
from gpuwise.errors import GpuwiseError
from gpuwise.precision import PRECISIONS, PrecisionSpec
from gpuwise.training.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Parallelized:
    model: nn.Module  # what the step calls: the module itself (sharded, compiled in place), compiled, or DDP
    optimizer: torch.optim.Optimizer  # rebuilt on the shards under FSDP2
    sharded: bool  # FSDP2: parameters, gradients and optimizer states split over the processes
    autocast_dtype: torch.dtype | None  # None under FSDP2 too: its mixed-precision policy casts the parameters


def apply_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Recompute every block in backward (``selective``: all but what torchtitan's op-level policy saves, as the
    planner simulates it); a model without a stack of blocks is refused."""
    from gpuwise.planning.capture.blocks import find_blocks
    from gpuwise.planning.transforms.checkpointing import apply_checkpointing as wrap_blocks

    blocks = find_blocks(model)
    if blocks is None:
        raise GpuwiseError(f"--checkpointing {mode} found no repeated blocks in {type(model).__name__}",
                           "pass --checkpointing none, or keep the blocks in an nn.ModuleList")
    wrap_blocks(blocks, selective=mode == "selective")


def apply_float8(model: nn.Module) -> None:
    """--precision fp8: torchao's float8 training (``convert_to_float8_training``, default recipe: tensorwise dynamic
    scaling) on every linear layer but the output head, those with dimensions that are multiples of 16, as
    torchtitan converts (the planner simulates the same: planning/transforms/float8.py)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise GpuwiseError("--precision fp8 trains with torchao's float8 linear layers, and torchao is not installed",
                           "pip install torchao, or use --precision bf16-mixed") from exc
    from gpuwise.planning.capture.blocks import find_blocks
    from gpuwise.planning.transforms.float8 import float8_eligible
    from gpuwise.planning.transforms.lora import select_targets

    head = select_targets(model, find_blocks(model), None)[2]
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear)
                               and float8_eligible(fqn, mod, head))


def apply_fsdp(model: nn.Module, optimizer: torch.optim.Optimizer, spec: PrecisionSpec, *, device_type: str,
               world_size: int) -> torch.optim.Optimizer:
    """FSDP2: each block, then the root, sharded over the processes (in place); returns the optimizer rebuilt on
    the shards, its parameter groups kept by parameter name."""
    from torch.distributed.device_mesh import init_device_mesh

    from gpuwise.planning.capture.blocks import find_blocks

    if spec.scaler:
        raise GpuwiseError(f"--sharding fsdp does not take {spec.name} here", "use --precision bf16-mixed")
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    fully_shard, policy = fsdp2()
    mesh = init_device_mesh(device_type, (world_size,))
    mp = policy(param_dtype=spec.autocast_dtype, reduce_dtype=torch.float32) if spec.autocast else policy()
    for block in find_blocks(model) or []:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    shards = dict(model.named_parameters())  # the same names, now DTensor shards
    takes = inspect.signature(type(optimizer)).parameters  # defaults may hold more than the constructor takes
    return type(optimizer)([{**{k: v for k, v in group.items() if k != "params"}, "params": [shards[n] for n in ns]}
                            for group, ns in zip(optimizer.param_groups, groups, strict=True)],
                           **{k: v for k, v in optimizer.defaults.items() if k in takes})


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Replicate over the processes; gradients are averaged by all-reduce in backward."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batchnorm_note(model: nn.Module, *, micro_batch: int, per_rank: int, world_size: int,
                   synced: bool) -> str | None:
    """What BatchNorm makes of this layout, in words, when its statistics are not the whole batch's (None when
    they are, or when the model has no BatchNorm)."""
    if not any(isinstance(m, BATCHNORMS) for m in model.modules()):
        return None
    over = micro_batch * world_size if synced else micro_batch
    if over == per_rank * world_size:
        return None
    how = ([f"micro-batches of {micro_batch}"] if micro_batch < per_rank else []) + (
        [f"{world_size} processes each on its own"] if world_size > 1 and not synced else [])
    fix = ("" if synced or world_size == 1 else "--sync-batchnorm (GPUs) shares them over the processes; ") + \
        ("a larger --micro-batch, or GroupNorm, gives the same step as one batch" if micro_batch < per_rank
         else "GroupNorm gives the same step as one batch")
    return (f"BatchNorm normalises over {over} samples, not the batch of {per_rank * world_size} "
            f"({' and '.join(how)}): {fix}")


def apply_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """BatchNorm layers that share their statistics over the processes (the same parameters, kept in place)."""
    if device.type != "cuda":
        raise GpuwiseError("--sync-batchnorm runs on GPUs only (torch's SyncBatchNorm has no CPU kernel)",
                           "drop --sync-batchnorm, or train on GPUs")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, *, device: torch.device,
                world_size: int) -> Parallelized:
    """``config``'s checkpointing, sharding and compile applied to ``model`` (its precision must be decided)."""
    spec = PRECISIONS[config.precision]
    if config.sync_batchnorm and world_size > 1:
        model = apply_sync_batchnorm(model, device)
    if spec.float8:  # before checkpointing and sharding wrap the model, as torchtitan's converters run first
        apply_float8(model)
    if config.checkpointing != "none":
        apply_checkpointing(model, config.checkpointing)
    if config.sharding == "fsdp" and world_size > 1:
        optimizer = apply_fsdp(model, optimizer, spec, device_type=device.type, world_size=world_size)
        if config.compile:
            model.compile()
        return Parallelized(model=model, optimizer=optimizer, sharded=True, autocast_dtype=None)
    if config.compile:
        model = torch.compile(model)
    if world_size > 1:
        model = apply_ddp(model, device)
    return Parallelized(model=model, optimizer=optimizer, sharded=False, autocast_dtype=spec.autocast_dtype)


def gradient_sync(model: nn.Module, *, sharded: bool, world_size: int, sync: bool) -> AbstractContextManager:
    """All-reduce gradients on the last micro-batch of a step only (DDP's no_sync, FSDP2's gradient-sync switch)."""
    if world_size == 1:
        return contextlib.nullcontext()
    if sharded:
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()
