"""What a training run does, in the planner's vocabulary: ``TrainConfig`` (the loop's settings) and ``TrainOptions``
(what ``gpuwise train`` trains, where). Both frozen, validated on construction; ``None`` means "auto" or "not given".

Importing this module does not import torch (the CLI reads its defaults for ``--help``).

>>> TrainConfig(batch=32, micro_batch=4).to_setup(gpus=2, seq=128).grad_accum   # doctest: +SKIP
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from gpuwise.errors import GpuwiseError
from gpuwise.files import file_function
from gpuwise.precision import PRECISIONS, Precision

if TYPE_CHECKING:
    from gpuwise.hardware.device import Target
    from gpuwise.planning.setup import Checkpointing, Optimizer, Setup, Task

TrainSharding = Literal["ddp", "fsdp"]  # what train runs of the planner's ddp|zero1|zero2|fsdp
Example = Literal["text", "image"]
SEED_LIMIT = 1 << 32
TEXT_SEQ = 128  # --example text: characters per sequence when --seq is not given
HF_SEQ = 128  # --hf-config: tokens per sequence when --seq is not given (at most the config's positions)
IMAGE_SIZE = 32  # --example image: pixels per side when --image-size is not given


def plan_only(what: str, hint: str) -> GpuwiseError:
    """A flag ``gpuwise plan`` can print that ``gpuwise train`` does not run."""
    return GpuwiseError(f"plan only: {what}", hint)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    batch: int = 32  # global: samples per optimizer step over every process
    micro_batch: int | None = None  # per process per forward, the rest accumulated; None: auto (the plan's
    #                                  choice in gpuwise train, the whole share of the batch in a bare Trainer)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr x this
    warmup_steps: int | None = None  # None: a tenth of the steps, at least 20 (half a shorter run), at most 100
    weight_decay: float = 0.1  # on matrices only (gpuwise.optim.param_groups)
    grad_clip: float | None = 1.0
    precision: Precision | None = None  # None: the device's default (Target.precision)
    seed: int = 1337
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end (when a checkpoint folder is given)
    keep: int = 3
    eval_every: int = 0  # 0: evaluate at the end only (when there is held-out data)
    eval_batches: int = 4
    compile: bool = False  # torch.compile the model
    checkpointing: Checkpointing = "none"  # full: recompute every block in backward (activation checkpointing)
    sharding: TrainSharding = "ddp"  # under torchrun: replicate, or shard with FSDP2
    optimizer: Optimizer = "adamw"  # the trainer runs AdamW; the planner's other optimizers are plan only
    optimizer_in_backward: bool = False  # plan only
    loss: str = "standard"  # chunked or fused (gpuwise.models.loss): run for --example text, plan only otherwise
    sync_batchnorm: bool = False  # under torchrun on GPUs: BatchNorm statistics over every process's micro-batch

    def __post_init__(self) -> None:
        from gpuwise.planning.setup import Checkpointing, Loss, Optimizer, _choice, _positive

        if self.precision is not None:
            _choice("precision", self.precision, Precision)
        _choice("checkpointing", self.checkpointing, Checkpointing)
        _choice("optimizer", self.optimizer, Optimizer)
        _choice("loss", self.loss, Loss)
        if self.optimizer != "adamw":
            raise plan_only(f"--optimizer {self.optimizer} is planned by gpuwise plan; gpuwise train runs AdamW",
                            "drop --optimizer, or see the plan with gpuwise plan --optimizer " + self.optimizer)
        if self.optimizer_in_backward:
            raise plan_only("--optimizer-in-backward is planned by gpuwise plan; gpuwise train steps after backward",
                            "drop --optimizer-in-backward")
        if self.sharding in ("zero1", "zero2"):
            raise plan_only(f"--sharding {self.sharding} is planned by gpuwise plan, not run by gpuwise train",
                            "use --sharding fsdp under torchrun (it shards weights, gradients and optimizer state)")
        _choice("sharding", self.sharding, TrainSharding)
        _positive("steps", self.steps, 1 << 31)
        _positive("batch", self.batch, 1 << 24)
        _positive("micro_batch", self.micro_batch, 1 << 24)
        _positive("eval_batches", self.eval_batches, 1 << 20)
        _positive("log_every", self.log_every, 1 << 31)
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise GpuwiseError(f"--{name.replace('_', '-')} {getattr(self, name)} is negative",
                                   "pass 0 (off) or a number of steps")
        if self.micro_batch is not None and self.batch % self.micro_batch:
            raise GpuwiseError(f"--batch {self.batch} is not a multiple of the micro-batch {self.micro_batch}",
                               "pick a batch that the micro-batch divides")
        if not 0 <= self.seed < SEED_LIMIT:  # the batches' generators take seed x 1_000_003 + step: 64 bits
            raise GpuwiseError(f"--seed {self.seed} is outside 0..{SEED_LIMIT - 1}", "pass e.g. --seed 1337")
        if not 0 < self.lr < math.inf:  # nan fails both; inf would run to a nan loss at step 2
            raise GpuwiseError(f"--lr {self.lr} must be a positive number", "pass e.g. --lr 3e-4")

    @property
    def warmup(self) -> int:
        # a tenth of the run, at most 100 steps; but at least 20 (or half a shorter run): Adam's second moments
        # are young in the first steps, and 6 steps to the peak (--steps 60) sent the loss from 4.6 to 7
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, min(100, max(self.steps // 10, min(20, self.steps // 2))))

    def per_process(self, world_size: int) -> int:
        """This process's share of the global batch, checked to split over the processes and into micro-batches."""
        per_rank = self.batch // world_size
        if self.batch % world_size:
            raise GpuwiseError(f"--batch {self.batch} does not split over {world_size} processes",
                               f"pass a --batch that {world_size} divides, e.g. "
                               f"--batch {max(per_rank, 1) * world_size}")
        if per_rank % (self.micro_batch or per_rank):
            raise GpuwiseError(f"--batch {self.batch} over {world_size} processes is {per_rank} per process, which "
                               f"micro-batches of {self.micro_batch} do not divide",
                               "make the batch a multiple of processes x --micro-batch")
        return per_rank

    def for_device(self, target: Target) -> TrainConfig:
        """This config on ``target``: precision None becomes the device's default, and a precision that needs
        bf16 is refused on a GPU without it."""
        precision = self.precision or target.precision
        if PRECISIONS[precision].needs_bf16 and target.gpu and not target.bf16:
            raise GpuwiseError(f"this GPU has no bf16 for --precision {precision}", "use --precision fp16-mixed")
        if PRECISIONS[precision].float8 and not (target.gpu and target.row is not None
                                                 and target.row.fp8):
            raise GpuwiseError(f"--precision {precision} needs a GPU with fp8 tensor cores (Ada, Hopper or newer), "
                               f"not {target.model}", "use --precision bf16-mixed")
        return replace(self, precision=precision)

    def to_setup(self, *, gpus: int = 1, seq: int | None = None) -> Setup:
        """The planner's view of this run on ``gpus`` processes (the one train -> plan translation); the
        precision must be decided first (``for_device``)."""
        from gpuwise.planning.setup import Setup

        if self.precision is None:
            raise ValueError("to_setup needs a precision: call for_device first")
        return Setup.for_batch(batch=self.batch, micro_batch=self.micro_batch, gpus=gpus, seq=seq,
                               precision=self.precision, checkpointing=self.checkpointing,
                               sharding=self.sharding if gpus > 1 else "ddp", loss=self.loss)


def not_a_folder(folder: Path) -> None:
    """--checkpoint-dir names a file: refused before the plan and the model, not after them."""
    if folder.exists() and not folder.is_dir():
        raise GpuwiseError(f"--checkpoint-dir {folder} is a file", "pass a folder (it is created if missing)")


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What ``gpuwise train`` trains and where; the loop's settings are ``config``."""

    example: Example = "text"  # the built-in example: text (character GPT) or image (small CNN); not with --model
    model: str | None = None  # file.py:function -> (model, inputs)
    hf_config: str | None = None  # a Hugging Face config.json, folder, checkpoint file or Hub id: transformers' model
    data: str | None = None  # file.py:function -> Dataset (or (train, val))
    seq: int | None = None  # --example text: characters per sequence (None: TEXT_SEQ); --hf-config: tokens (HF_SEQ)
    image_size: int | None = None  # --example image: pixels per side; None: IMAGE_SIZE
    device: str | None = None  # None: the default device (hardware.device.default_device)
    gpus: int | None = None  # None: whatever torchrun started; else it must equal torchrun's world size
    auto: bool = True  # the planner picks the micro-batch (and the precision is the device's default)
    fused: bool | None = None  # fused AdamW (None: on GPUs; foreach on CPUs)
    workers: int | None = None  # DataLoader workers for --data (None: environment.suggested_workers)
    checkpoint_dir: str | None = None
    resume: bool = False
    task: Task = "train"  # the planner's task: train only; finetune-lora and infer are plan only
    lora_rank: int | None = None  # plan only (finetune-lora)
    qlora: bool = False  # plan only (finetune-lora)
    lora_targets: str | None = None  # plan only (finetune-lora)
    lora_dropout: float | None = None  # plan only (finetune-lora)
    qlora_recipe: str | None = None  # plan only (finetune-lora)
    monitor: bool = True  # gpuwise.Monitor samples the run and the summary carries its diagnosis
    data_timeout: float | None = None  # seconds --data's function, or a batch, may keep the run waiting (None: ever)
    config: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        from gpuwise.planning.setup import Request, Task, _choice, _positive, lora_flags

        if self.example not in get_args(Example):
            raise GpuwiseError(f"--example {self.example!r} is not text or image",
                               "pass --example text or --example image")
        _choice("task", self.task, Task)
        if self.task != "train":
            raise plan_only(f"--task {self.task} is planned by gpuwise plan; gpuwise train runs full training",
                            "drop --task, or see the plan with gpuwise plan --task " + self.task)
        lora = lora_flags(Request(qlora=self.qlora, lora_rank=self.lora_rank, lora_targets=self.lora_targets,
                                  lora_dropout=self.lora_dropout, qlora_recipe=self.qlora_recipe))
        if lora:
            raise plan_only(f"{lora[0]} (LoRA fine-tuning) is planned by gpuwise plan, not run by gpuwise train",
                            f"drop {lora[0].split()[0]}")
        _positive("gpus", self.gpus, 1 << 16)
        _positive("seq", self.seq, 1 << 24)  # not "seq or TEXT_SEQ": --seq 0 is a mistake, not the default
        _positive("image_size", self.image_size, 1 << 14)
        if self.workers is not None and self.workers < 0:
            raise GpuwiseError(f"--workers {self.workers} is negative",
                               "pass 0 (load in the training process) or a number of worker processes")
        if self.data_timeout is not None and not 0 < self.data_timeout < math.inf:  # nan fails both
            raise GpuwiseError(f"--data-timeout {self.data_timeout:g} is not a positive number of seconds",
                               "pass e.g. --data-timeout 600, or leave it out to wait as long as it takes")
        if self.resume and not self.checkpoint_dir:
            raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
        if self.checkpoint_dir is not None:
            not_a_folder(Path(self.checkpoint_dir))
        if self.hf_config is not None and self.model:
            raise GpuwiseError("--model and --hf-config both name a model", "pass one of them")
        if self.hf_config is not None and self.example != "text":
            raise GpuwiseError(f"--example {self.example} and --hf-config both name a model", "pass one of them")
        if self.data and not (self.model or self.hf_config):
            raise GpuwiseError("--data needs --model or --hf-config",
                               "pass --model file.py:function (or --hf-config) for the model the data trains")
        for flag, spec in (("--model", self.model), ("--data", self.data)):
            if spec is not None:
                file_function(spec, flag)  # a missing file is refused before torch loads
