"""What a training run does: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpuwise.errors import GpuwiseError
from gpuwise.planning.setup import Precision, _choice, _positive


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    batch: int = 32  # global: micro_batch x grad_accum (x GPUs)
    micro_batch: int | None = None  # None: the whole batch at once
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int | None = None  # None: a tenth of the steps, at most 100
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    precision: Precision = "fp32"
    seed: int = 1337
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end (when a checkpoint folder is given)
    keep: int = 3
    eval_every: int = 0  # 0: evaluate at the end only (when there is held-out data)
    eval_batches: int = 4
    compile: bool = False  # torch.compile the model
    checkpointing: bool = False  # recompute every block in backward (activation checkpointing)
    sharding: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate, or shard with FSDP2

    def __post_init__(self) -> None:
        _choice("precision", self.precision, Precision)
        _positive("steps", self.steps, 1 << 31)
        _positive("batch", self.batch, 1 << 24)
        _positive("micro_batch", self.micro_batch, 1 << 24)
        _positive("eval_batches", self.eval_batches, 1 << 20)
        _positive("log_every", self.log_every, 1 << 31)
        _choice("sharding", self.sharding, Literal["ddp", "fsdp"])
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise GpuwiseError(f"--{name.replace('_', '-')} {getattr(self, name)} is negative",
                                   "pass 0 (off) or a number of steps")
        if self.micro_batch is not None and self.batch % self.micro_batch:
            raise GpuwiseError(f"--batch {self.batch} is not a multiple of the micro-batch {self.micro_batch}",
                               "pick a batch that the micro-batch divides")
        if not self.lr > 0:
            raise GpuwiseError(f"--lr {self.lr} must be positive", "pass e.g. --lr 3e-4")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, min(100, self.steps // 10))

    @property
    def grad_accum(self) -> int:
        return self.batch // (self.micro_batch or self.batch)
