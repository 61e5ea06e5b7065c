"""What the user wants to run: one frozen dataclass holds every choice and its default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.precision import PRECISIONS, Precision, PrecisionSpec

Task = Literal["train", "finetune-lora", "infer"]
Optimizer = Literal["adamw", "sgd"]
Checkpointing = Literal["none", "full"]
Sharding = Literal["ddp", "zero1", "zero2", "fsdp"]
Attention = Literal["sdpa", "gpuwise"]

MAX_BATCH = 1 << 20
MAX_ACCUM = 1 << 16


def _choice(field: str, value: str, kind: object) -> None:
    allowed = get_args(kind)
    if value not in allowed:
        raise GpuwiseError(f"--{field.replace('_', '-')} {value!r} is not one of {', '.join(allowed)}",
                           f"pass --{field.replace('_', '-')} {allowed[0]}")


def _positive(field: str, value: int | None, limit: int) -> None:
    if value is not None and not 1 <= value <= limit:
        raise GpuwiseError(f"--{field.replace('_', '-')} {value} is outside 1..{limit}",
                           f"pass a whole number from 1 to {limit}")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training or inference step as the user would run it.

    >>> Setup(batch=8, precision="bf16-mixed").compute_dtype
    torch.bfloat16
    """

    task: Task = "train"
    batch: int = 1  # micro-batch per GPU
    seq: int | None = None  # tokens; None = the model's default
    image_size: int | None = None  # pixels per side; None = the model's default
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    checkpointing: Checkpointing = "none"
    grad_accum: int = 1
    gpus: int = 1
    sharding: Sharding = "ddp"
    lora_rank: int = 16  # used by finetune-lora
    qlora: bool = False  # finetune-lora with the frozen base stored in 4 bits (NF4 + double quantisation)
    attention: Attention = "sdpa"  # the built-in GPT and Llama models: SDPA or gpuwise.ops.attention

    def __post_init__(self) -> None:
        _choice("task", self.task, Task)
        _choice("precision", self.precision, Precision)
        _choice("optimizer", self.optimizer, Optimizer)
        _choice("checkpointing", self.checkpointing, Checkpointing)
        _choice("sharding", self.sharding, Sharding)
        _choice("attention", self.attention, Attention)
        _positive("batch", self.batch, MAX_BATCH)
        _positive("seq", self.seq, 1 << 24)
        _positive("image_size", self.image_size, 1 << 14)
        _positive("grad_accum", self.grad_accum, MAX_ACCUM)
        _positive("gpus", self.gpus, 1 << 16)
        _positive("lora_rank", self.lora_rank, 1 << 14)
        if self.qlora and self.task != "finetune-lora":
            raise GpuwiseError("--qlora quantises the frozen base of a LoRA fine-tune", "add --task finetune-lora")
        if self.task == "infer":
            for flag, bad in (("--grad-accum", self.grad_accum != 1),
                              ("--checkpointing full", self.checkpointing != "none"),
                              ("--sharding", self.sharding != "ddp"), ("--gpus", self.gpus != 1)):
                if bad:
                    raise GpuwiseError(f"{flag} has no meaning for --task infer",
                                       f"drop {flag.split()[0]}, or plan --task train")
        if self.sharding != "ddp" and self.gpus == 1:
            raise GpuwiseError(f"--sharding {self.sharding} shards over GPUs but --gpus is 1",
                               "add --gpus N with N > 1")

    @property
    def training(self) -> bool:
        return self.task != "infer"

    @property
    def spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def mixed(self) -> bool:
        """Autocast over fp32 weights."""
        return self.spec.autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.spec.compute_dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """Trainable weights: fp32 under autocast (they are the master copy), else the compute dtype."""
        return self.spec.weight_dtype

    def describe(self) -> str:
        parts = [self.task, f"batch {self.batch}"]
        if self.grad_accum > 1:
            parts.append(f"x {self.grad_accum} accumulation")
        parts.append(self.precision)
        if self.training:
            parts += [self.optimizer, f"checkpointing {self.checkpointing}"]
        if self.task == "finetune-lora":
            parts.append(f"{'QLoRA' if self.qlora else 'LoRA'} rank {self.lora_rank}")
        if self.gpus > 1:
            parts.append(f"{self.gpus} GPUs {self.sharding}")
        return " · ".join(p for p in parts if p)
