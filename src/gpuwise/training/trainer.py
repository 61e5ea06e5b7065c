"""The training loop done right: one GradScaler for the whole run, clipping after unscaling, accumulation
that averages micro-batch losses, warm-up + cosine LR, finite-loss checks, crash-safe checkpoints and an
exact resume (batches are numbered, RNG states are saved).

>>> # trainer = Trainer(model, optimizer, data, TrainConfig(steps=100)); result = trainer.fit()
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.distributed import Ranks


class Batches(Protocol):
    def batch(self, number: int, size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, kw_only=True)
class StepLog:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    mfu: float | None  # model FLOPs utilisation: planned FLOPs per step / time / peak of the device
    peak_memory_bytes: int | None
    skipped: bool  # fp16: the scaler found inf/NaN gradients and skipped the update


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    steps: int
    final_loss: float
    logs: tuple[StepLog, ...]
    skipped_steps: int
    seconds: float
    resumed_from: int | None


def cosine_with_warmup(config: TrainConfig) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine down to min_lr_ratio at the last step (nanoGPT's schedule)."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(config.steps - config.warmup_steps, 1)
        progress = min((step - config.warmup_steps) / span, 1.0)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def fingerprint(model: nn.Module, config: TrainConfig) -> str:
    """What a checkpoint must match to be resumed: parameter names and shapes, and the run's batch shape."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    h.update(f"batch={config.batch};precision={config.precision}".encode())
    return h.hexdigest()


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Batches, config: TrainConfig, *,
                 device: str = "cpu", flops_per_step: float | None = None, peak_tflops: float | None = None,
                 checkpoint_dir: str | Path | None = None, on_log: Callable[[StepLog], None] | None = None,
                 ranks: Ranks | None = None) -> None:
        self.ranks = ranks or Ranks()
        self.config_batch_split(config, self.ranks)
        self.module = model  # unwrapped: what checkpoints hold
        if self.ranks.world_size > 1:  # gradients averaged over processes; each takes a slice of the batch
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[torch.device(device).index]
                                            if torch.device(device).type == "cuda" else None)
        self.model, self.optimizer, self.data, self.config = model, optimizer, data, config
        self.device = torch.device(device)
        self.flops_per_step, self.peak_tflops = flops_per_step, peak_tflops
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.on_log = on_log
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(config))
        fp16 = config.precision == "fp16-mixed"
        # One scaler for the whole run: its scale adapts across steps (a new one per step never learns).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(config.precision)
        self.fingerprint = fingerprint(self.module, config)
        self.step = 0

    @staticmethod
    def config_batch_split(config: TrainConfig, ranks: Ranks) -> None:
        """The global batch must split evenly over the processes, and each share into micro-batches."""
        per_rank = config.batch // ranks.world_size
        if config.batch % ranks.world_size or per_rank % (config.micro_batch or per_rank):
            raise GpuwiseError(f"--batch {config.batch} does not split over {ranks.world_size} processes"
                               + (f" in micro-batches of {config.micro_batch}" if config.micro_batch else ""),
                               "make the batch a multiple of processes x micro-batch")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _save(self) -> None:
        if self.checkpoint_dir is None:
            return
        if self.ranks.main:  # one writer; every process holds the same weights and optimizer state under DDP
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict(), "rng": ckpt.rng_state(), "step": self.step}
            ckpt.save(self.checkpoint_dir, self.step, model_state=self.module.state_dict(), state=state,
                      fingerprint=self.fingerprint, keep=self.config.keep)
        if self.ranks.world_size > 1:
            torch.distributed.barrier()

    def _resume(self) -> int | None:
        if self.checkpoint_dir is None:
            raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
        found, skipped = ckpt.latest(self.checkpoint_dir)
        if found is None:
            reason = f" ({'; '.join(skipped)})" if skipped else ""
            raise GpuwiseError(f"no usable checkpoint in {self.checkpoint_dir}{reason}", "start without --resume")
        weights, state = ckpt.load(found, fingerprint=self.fingerprint)
        self.module.load_state_dict(weights)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])
        return self.step

    def fit(self, *, resume: bool = False) -> TrainResult:
        cfg = self.config
        resumed = self._resume() if resume else None
        per_rank = cfg.batch // self.ranks.world_size
        micro = cfg.micro_batch or per_rank
        accum = per_rank // micro
        logs: list[StepLog] = []
        skipped_steps = 0
        start = time.perf_counter()
        self.model.train()
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            loss_sum = torch.zeros((), device=self.device)
            tokens = 0
            inputs, targets = self.data.batch(self.step, cfg.batch)  # the step's global batch: this rank's slice
            first = self.ranks.rank * per_rank
            for m in range(accum):
                rows = slice(first + m * micro, first + (m + 1) * micro)
                x = inputs[rows].to(self.device, non_blocking=True)
                y = targets[rows].to(self.device, non_blocking=True)
                # DDP all-reduces on the last micro-batch only, not on every one
                sync = self.ranks.world_size == 1 or m == accum - 1
                with self._autocast(), contextlib.nullcontext() if sync else self.model.no_sync():
                    loss = self.model(x, y) / accum  # the mean over the whole batch, micro-batch by micro-batch
                    self.scaler.scale(loss).backward()
                loss_sum += loss.detach().float()
                tokens += y.numel()
            if self.ranks.world_size > 1:  # the loss of the global batch, as one process would see it
                torch.distributed.all_reduce(loss_sum)
                loss_sum /= self.ranks.world_size
            if not torch.isfinite(loss_sum):
                raise GpuwiseError(f"the loss is {loss_sum.item()} at step {self.step + 1}",
                                   "lower --lr, or use --precision bf16-mixed (fp16 overflows where bf16 does not)"
                                   + (f"; the fp16 scaler skipped {skipped_steps} steps before" if skipped_steps
                                      else ""))
            grad_norm = None
            if cfg.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = scale is not None and self.scaler.get_scale() < scale  # the scale drops when it skips
            skipped_steps += skipped
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                mfu = (self.flops_per_step / dt / (self.peak_tflops * 1e12)
                       if self.flops_per_step and self.peak_tflops else None)
                log = StepLog(step=self.step, loss=float(loss_sum), lr=lr, grad_norm=grad_norm,
                              tokens_per_s=tokens / dt, mfu=mfu,
                              peak_memory_bytes=int(torch.cuda.max_memory_allocated(self.device))
                              if self.device.type == "cuda" else None, skipped=skipped)
                logs.append(log)
                if self.on_log and self.ranks.main:
                    self.on_log(log)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                self._save()
        self._save()
        return TrainResult(steps=self.step, final_loss=logs[-1].loss if logs else math.nan, logs=tuple(logs),
                           skipped_steps=skipped_steps, seconds=time.perf_counter() - start, resumed_from=resumed)
