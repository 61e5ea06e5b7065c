"""The training loop done right: one GradScaler for the whole run, clipping after unscaling, accumulation
that averages micro-batch losses and all-reduces once per step, warm-up + cosine LR, finite-loss checks,
evaluation every N steps, crash-safe checkpoints and an exact resume (batches are numbered, RNG states are
saved), DDP or FSDP2 under torchrun (``parallelize.py``), and an OOM that is explained and retried once at half
the micro-batch. Its parts live beside it: the step's clock (``meter.py``), Ctrl-C (``interrupt.py``), checkpoints
and RNG states (``checkpoint.py``), the losses (``loss.py``); what the plan said comes in a ``RunPlan``.

TF32 is a process-wide switch, so the Trainer leaves it alone: the run sets it around ``fit``
(``with precision.tf32_matmuls(spec.tf32)``, as ``run_training`` does).

>>> # result = Trainer(model, optimizer, data, TrainConfig(steps=100)).fit()
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpuwise.compat import warm_cpu_vml
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.device import Target
from gpuwise.planning.setup import largest_micro_batch
from gpuwise.precision import PRECISIONS
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import as_batches, batch_rows, rows, small_dataset_note, stream, to_device
from gpuwise.training.distributed import Ranks
from gpuwise.training.interrupt import Interrupted, StopFlag
from gpuwise.training.loss import LossFn, default_loss, non_finite_loss, scalar
from gpuwise.training.meter import Meter
from gpuwise.training.parallelize import batchnorm_note, gradient_sync, parallelize
from gpuwise.training.waiting import Watchdog
from gpuwise.units import human_bytes

if TYPE_CHECKING:
    from gpuwise.training.runplan import RunPlan

OutOfMemory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

CPU = Target(name="cpu", backend="cpu", index=None, model="cpu", row=None, bf16=False, memory_total_bytes=None)


@dataclass(frozen=True, kw_only=True)
class StepLog:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float  # tokens for language models, samples otherwise (see TrainResult.unit)
    mfu: float | None  # model FLOPs utilisation: planned FLOPs per step / time / peak of the device
    peak_memory_bytes: int | None
    data_wait: float  # fraction of the step spent waiting for the next batch
    skipped: bool  # fp16: the scaler found inf/NaN gradients and skipped the update
    eval_loss: float | None = None
    bottleneck: str | None = None  # the monitor's diagnosis of the recent steps (None without a monitor)
    elapsed_s: float | None = None  # wall seconds since the run's first step began (logging, eval, saves counted)
    items_done: int | None = None  # tokens (samples) every process consumed meanwhile: meter.wall_throughput


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    steps: int
    final_loss: float
    eval_loss: float | None
    logs: tuple[StepLog, ...]
    skipped_steps: int
    seconds: float
    resumed_from: int | None
    micro_batch: int
    grad_accum: int
    events: tuple[str, ...]  # what the trainer changed on its own (an OOM retry), in words


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where the loop runs and what it reports to, beside the model, optimizer, data and config; every field has
    a default (one CPU process, no checkpoints, no plan)."""

    device: Target = CPU  # hardware.device.resolve_device: the torch device, its default precision and catalog row
    ranks: Ranks = field(default_factory=Ranks)  # this process under torchrun
    checkpoint_dir: str | Path | None = None
    plan: RunPlan | None = None  # the planner's figures, decided before the run: MFU's FLOPs, the OOM notes
    on_log: Callable[[StepLog], None] | None = None
    on_event: Callable[[str], None] | None = None  # the trainer's own choices, in words (an OOM retry)
    monitor: Any = None  # a started gpuwise.Monitor: every step's timings go to it (monitor.sampler)
    on_resume: Callable[[int], None] | None = None  # hears the step a resumed run continues from
    run: dict[str, Any] | None = None  # the run's settings, kept in each checkpoint so --resume need not repeat them
    data_timeout: float | None = None  # seconds a batch may take to come before the run stops (None: no bound)


def cosine_with_warmup(config: TrainConfig) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine down to min_lr_ratio at the last step (nanoGPT's schedule).

    A resumed run follows the schedule of its own ``config``, from the step it resumes at: with a larger
    ``steps`` every step's LR is the one an uninterrupted run with that ``steps`` computes at that step (its
    warm-up included, which a default warm-up of a tenth of the run lengthens), not the old schedule's."""

    def factor(step: int) -> float:
        warmup = config.warmup
        if step < warmup:
            return (step + 1) / warmup
        span = max(config.steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Any, config: TrainConfig, *,
                 loss_fn: LossFn = default_loss, eval_data: Any = None, runtime: Runtime | None = None) -> None:
        warm_cpu_vml()  # before any step: a busy CPU must not change the numbers (see its docstring)
        runtime = runtime or Runtime()
        config = config.for_device(runtime.device)  # precision None: the device's default
        self.ranks, self.runtime, self.config, self.plan = runtime.ranks, runtime, config, runtime.plan
        self.per_rank = config.per_process(self.ranks.world_size)
        self.micro_batch = config.micro_batch or self.per_rank
        self.device = torch.device(runtime.device.name)
        self.module = model  # unwrapped: what checkpoints hold
        sharded = config.sharding == "fsdp" and self.ranks.world_size > 1
        if not any(p.requires_grad for p in model.parameters()):
            raise GpuwiseError(f"{type(model).__name__} has no trainable parameters (it has "
                               f"{sum(1 for _ in model.parameters())} parameters, none with requires_grad)",
                               "return a model with parameters to train from --model's function")
        untrained = _not_in_optimizer(model, optimizer)  # before parallelize: FSDP2 rebuilds it by parameter name
        self.checkpointer = None if runtime.checkpoint_dir is None else ckpt.Checkpointer(
            runtime.checkpoint_dir, identity=ckpt.identity(model, config, self.ranks.world_size), ranks=self.ranks,
            sharded=sharded, keep=config.keep, run=runtime.run)
        if self.checkpointer is None and config.checkpoint_every:
            raise GpuwiseError("--checkpoint-every needs a folder", "pass --checkpoint-dir DIR")
        p = parallelize(model, optimizer, config, device=self.device, world_size=self.ranks.world_size)
        self.model, self.optimizer, self.sharded = p.model, p.optimizer, p.sharded
        self.autocast_dtype = p.autocast_dtype
        if self.ranks.world_size > 1:  # the weights are made and broadcast: now each process its own dropout
            torch.manual_seed(ckpt.rank_seed(config.seed, self.ranks.rank))
        self.data, self.loss_fn = as_batches(data, config.seed), loss_fn
        self.eval_data = None if eval_data is None else as_batches(eval_data, config.seed)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cosine_with_warmup(config))
        # One scaler for the whole run: its scale adapts across steps (a new one per step never learns).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=PRECISIONS[config.precision].scaler)
        self.step = self.saved = 0
        self.skipped_steps = 0  # fp16: updates the scaler skipped, over the whole run
        self.retried = False  # an OOM is retried once per run
        self.events: list[str] = []
        self.stop = StopFlag()
        for note in (untrained, batchnorm_note(model, micro_batch=self.micro_batch, per_rank=self.per_rank,
                                    world_size=self.ranks.world_size, synced=config.sync_batchnorm),
                     small_dataset_note(self.data, config.batch)):
            if note:
                self._note(note)
        self.monitor = runtime.monitor
        self.meter = Meter(runtime.device, config.precision, monitor=self.monitor, model=self.model,
                           flops_per_step=None if self.plan is None else self.plan.flops_per_step,
                           processes=self.ranks.world_size)

    def _autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _note(self, text: str) -> None:
        self.events.append(text)
        if self.runtime.on_event and self.ranks.main:
            self.runtime.on_event(text)

    # -- the run -------------------------------------------------------------------------------------------

    def fit(self, *, resume: bool = False) -> TrainResult:
        """Train to ``config.steps`` (from the newest good checkpoint with ``resume``). A one-line error
        (bad data, a non-finite loss, an OOM that a retry did not cure) first saves the steps done so far.

        A resume with another ``steps`` (a longer run) takes this config's schedule from the first step it trains:
        each step's LR is what an uninterrupted run with this ``steps`` gives that step (``cosine_with_warmup``)."""
        if self.checkpointer is not None:
            self.checkpointer.lock()
        try:
            if not resume and self.checkpointer is not None:
                self.checkpointer.check_fresh()
            resumed = self._resume() if resume else None
            if resumed is not None and self.runtime.on_resume is not None and self.ranks.main:
                self.runtime.on_resume(resumed)
            self.saved = self.step
            say = self.runtime.on_event if self.ranks.main else None
            with self.stop.installed(), Watchdog(say, self.runtime.data_timeout) as self.watchdog:
                try:
                    return self._loop(resumed)
                except ckpt.CheckpointNotWritten:
                    raise  # saving again would fail again; the checkpoints before it are intact
                except GpuwiseError:
                    if self.step > self.saved and self.ranks.world_size == 1:  # keep what was trained
                        self._save()
                        self.events.append(f"saved step {self.step} before stopping")
                    raise
                except KeyboardInterrupt:
                    raise self._interrupted() from None
        finally:
            if self.checkpointer is not None:
                self.checkpointer.unlock()

    def _loop(self, resumed: int | None) -> TrainResult:
        cfg, world, meter = self.config, self.ranks.world_size, self.meter
        logs: list[StepLog] = []
        start, first_step, eval_loss = time.perf_counter(), self.step, None
        self._first_step = first_step
        self.model.train()
        batches = stream(self.data, self.step, cfg.steps, cfg.batch, self.ranks.rank, world,
                         pin=self.device.type == "cuda")
        while self.step < cfg.steps:
            if self.stop.requested(world):
                raise KeyboardInterrupt
            meter.begin()
            x, y = self._next(batches)  # this process's share of the step's global batch
            meter.fetched()
            loss = self._forward_backward_retrying(x, y, first_step=self.step == first_step)
            meter.mark()
            if world > 1:  # the global batch's loss; whether any process heard Ctrl-C travels with it
                loss = self.stop.mean_loss(loss, world)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise non_finite_loss(loss, x, y, step=self.step + 1, skipped_steps=self.skipped_steps)
            lr = float(self.optimizer.param_groups[0]["lr"])  # the LR this update steps with
            grad_norm, skipped = self._update()
            meter.mark()
            self.skipped_steps += skipped
            self.scheduler.step()
            self.step += 1
            tokens = y.numel() if isinstance(y, torch.Tensor) and y.dim() > 1 else batch_rows(x)  # this process's
            meter.end(items=tokens, micro_batches=max(1, batch_rows(x) // self.micro_batch))
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or self.step == cfg.steps:
                self._save()  # before evaluating: a failing evaluation loses nothing
                self.saved = self.step
            evaluate = self.eval_data is not None and (
                (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps)
            step_eval = self._evaluate() if evaluate else None
            eval_loss = step_eval if step_eval is not None else eval_loss
            if self.step % cfg.log_every == 0 or self.step == cfg.steps or step_eval is not None:
                logs.append(StepLog(step=self.step, loss=float(loss), lr=lr, grad_norm=grad_norm, skipped=skipped,
                                    eval_loss=step_eval, **meter.figures(tokens * world)))
                if self.runtime.on_log and self.ranks.main:
                    self.runtime.on_log(logs[-1])
        return TrainResult(steps=self.step, final_loss=logs[-1].loss if logs else math.nan, eval_loss=eval_loss,
                           logs=tuple(logs), skipped_steps=self.skipped_steps,
                           seconds=time.perf_counter() - start, resumed_from=resumed, micro_batch=self.micro_batch,
                           grad_accum=self.per_rank // self.micro_batch, events=tuple(self.events))

    # -- one step ------------------------------------------------------------------------------------------

    def _forward_backward(self, x: Any, y: Any, first_step: bool) -> torch.Tensor:
        """Every micro-batch's forward and backward; returns the batch's mean loss."""
        micro, comm = self.micro_batch, self.meter.comm
        accum = batch_rows(x) // micro
        loss_sum = torch.zeros((), device=self.device)
        for m in range(accum):
            sl = slice(m * micro, (m + 1) * micro)
            xm, ym = to_device(rows(x, sl), self.device), to_device(rows(y, sl), self.device)
            sync = gradient_sync(self.model, sharded=self.sharded, world_size=self.ranks.world_size,
                                 sync=m == accum - 1)
            with self._autocast(), sync:
                try:
                    loss = scalar(self.loss_fn(self.model, xm, ym))
                except (OutOfMemory, GpuwiseError):
                    raise
                except SystemExit as exc:  # the user's forward called sys.exit: not a reason to vanish silently
                    raise GpuwiseError(f"the model's forward called sys.exit({exc.code}) at step {self.step + 1}",
                                       "raise an exception in the model instead of exiting") from None
                except Exception as exc:
                    if not first_step:
                        raise
                    raise GpuwiseError(f"the data does not fit the model: {first_line(exc)}",
                                       "check that --data's items are what the model's forward takes") from exc
                if not loss.requires_grad:  # backward would fail in PyTorch's words (exit 3)
                    from gpuwise.planning.sources.file import detached_loss

                    raise detached_loss(f"step {self.step + 1}", f"{type(self.module).__name__}'s")
                loss = loss / accum  # the mean over the whole batch, micro-batch by micro-batch
                timed = comm is not None and m == accum - 1  # the backward that all-reduces
                if timed:
                    comm.begin()
                self.scaler.scale(loss).backward()
                if timed:
                    comm.end()
            loss_sum += loss.detach().float()
        return loss_sum

    def _forward_backward_retrying(self, x: Any, y: Any, first_step: bool) -> torch.Tensor:
        """``_forward_backward``; an OOM is explained and, the first time in a run (one process only), retried at
        half the micro-batch after freeing what the failed attempt held."""
        while True:
            try:
                return self._forward_backward(x, y, first_step)
            except OutOfMemory as exc:
                why = self._explain_oom(self.micro_batch)
                if self.monitor is not None:
                    self.monitor.oom(self.step + 1, why)
                smaller = largest_micro_batch(self.per_rank, self.micro_batch // 2)
                if self.retried or smaller == 0 or self.ranks.world_size > 1:
                    hint = ("under torchrun the processes cannot retry alone: lower --micro-batch"
                            if self.ranks.world_size > 1 and not self.retried else
                            "gpuwise plan shows what fits; lower --micro-batch or add --checkpointing full")
                    raise GpuwiseError(why + (" (after one retry at half the micro-batch)" if self.retried else ""),
                                       hint) from exc
                self.optimizer.zero_grad(set_to_none=True)  # the failed attempt's partial gradients
                self._note(f"{why}: retrying step {self.step + 1} with micro-batch {smaller} x "
                           f"{self.per_rank // smaller}")
                self.micro_batch, self.retried = smaller, True
            gc.collect()  # outside the except block: the exception's frames no longer hold the tensors
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _explain_oom(self, micro: int) -> str:
        parts = [f"out of memory at micro-batch {micro}"]
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            parts.append(f"allocated {human_bytes(stats.get('allocated_bytes.all.current', 0))}, peak "
                         f"{human_bytes(stats.get('allocated_bytes.all.peak', 0))}, reserved "
                         f"{human_bytes(stats.get('reserved_bytes.all.current', 0))} of {human_bytes(total)}")
        if self.plan is not None:
            parts += self.plan.oom_note(micro)
        return "; ".join(parts)

    def _update(self) -> tuple[float | None, bool]:
        """Unscale, clip, step (the scaler skips a step with inf/NaN gradients): the gradient norm if clipped, and
        whether the update was skipped."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        grad_norm = None
        try:
            if self.config.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
                grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.scaler.step(self.optimizer)
        except OutOfMemory as exc:
            why = self._explain_oom(self.micro_batch).replace("out of memory at micro-batch",
                                                              "out of memory in the optimizer step, micro-batch")
            if self.monitor is not None:
                self.monitor.oom(self.step + 1, why)
            raise GpuwiseError(why,
                "the weights, gradients and optimizer states alone do not fit: gpuwise plan shows the "
                "remedies (bf16, sharding, LoRA)") from exc
        self.scaler.update()
        skipped = scale is not None and self.scaler.get_scale() < scale  # the scale drops when it skips
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _next(self, batches) -> tuple[Any, Any]:
        step, first = self.step + 1, self.step == self._first_step

        def what() -> str:
            return f"the {'first ' if first else ''}batch (step {step}) from {_source_name(self.data)}"

        try:
            with self.watchdog.waiting(what, _stuck_hint(self.data)):
                return next(batches)
        except GpuwiseError:
            raise
        except SystemExit as exc:
            raise GpuwiseError(f"the Dataset called sys.exit({exc.code}) reading the batch of step {self.step + 1}",
                               "raise an exception in __getitem__ instead of exiting") from None
        except Exception as exc:  # the user's Dataset or its collation
            raise GpuwiseError(f"reading the batch of step {self.step + 1} failed: {first_line(exc)}",
                               "check the Dataset: every item (input, target) with the same shapes") from exc

    def _evaluate(self) -> float:
        """The mean loss over ``eval_batches`` held-out batches, without gradients."""
        try:
            return self._evaluate_batches()
        except (GpuwiseError, OutOfMemory):
            raise
        except Exception as exc:
            raise GpuwiseError(f"the held-out data does not fit the model: {first_line(exc)}",
                               "check that the validation Dataset's items are like the training ones") from exc

    def _evaluate_batches(self) -> float:
        cfg, micro = self.config, self.micro_batch
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for x, y in stream(self.eval_data, 0, cfg.eval_batches, cfg.batch, self.ranks.rank,
                               self.ranks.world_size):
                n = batch_rows(x)
                for m in range(0, n, micro):
                    xm, ym = to_device(rows(x, slice(m, m + micro)), self.device), \
                        to_device(rows(y, slice(m, m + micro)), self.device)
                    with self._autocast():
                        total += self.loss_fn(self.model, xm, ym).float() * (min(micro, n - m) / n)
        if self.ranks.world_size > 1:
            torch.distributed.all_reduce(total)
            total /= self.ranks.world_size
        self.model.train()
        return float(total) / cfg.eval_batches

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _save(self) -> None:
        if self.checkpointer is not None:
            state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "rng": ckpt.rng_state(), "step": self.step, "skipped_steps": self.skipped_steps}
            if self.ranks.world_size > 1:  # each process's own random stream (dropout), for an exact resume
                state["rng_ranks"] = ckpt.gather_rng(self.device, self.ranks.world_size)
            self.checkpointer.save(self.step, self.module, self.optimizer, state)

    def _resume(self) -> int:
        if self.checkpointer is None:
            raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
        state, skipped = self.checkpointer.resume(self.module, self.optimizer, steps=self.config.steps,
                                                  needs=("scheduler", "scaler", "rng", "step"))
        if skipped and self.runtime.on_event and self.ranks.main:
            self.runtime.on_event(f"skipped {len(skipped)} damaged checkpoint(s): {'; '.join(skipped)}")
        self.scheduler.load_state_dict(state["scheduler"])  # base LRs, and the step it is at
        step = int(state["step"])
        # The optimizer's state brought the LR the old schedule gave the next step: with another --steps the
        # schedule is another (cosine_with_warmup), and the next step must already follow this run's.
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * factor(step)
        self.scheduler.last_epoch = step
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        if self.ranks.world_size > 1:  # another number of processes: a fresh stream per process
            ckpt.set_rank_rng(state.get("rng_ranks") or {}, rank=self.ranks.rank, world_size=self.ranks.world_size,
                              device=self.device, seed=self.config.seed + int(state["step"]))
        self.step, self.skipped_steps = step, int(state.get("skipped_steps", 0))
        return self.step

    def _interrupted(self) -> Interrupted:
        """Save the steps trained since the last checkpoint, and say where the run stopped."""
        forced, signum = self.stop.forced, self.stop.signum
        if self.checkpointer is None:
            return Interrupted(self.step, None, forced, signum)
        if self.step > self.saved and not forced:  # under torchrun every process is here, after the same step
            self._save()
            self.saved = self.step
        found, _ = ckpt.latest(self.checkpointer.folder)
        return Interrupted(self.step, found.path if found is not None else None, forced, signum)


def _not_in_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Refuse an optimizer over none of ``model``'s trainable parameters (built over another model's, or a copy's:
    every step would update nothing, silently); a note naming those it leaves out when it holds only some (they get
    gradients and no update; frozen ones, requires_grad False, are left out rightly)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if id(p) not in held]
    if not missing:
        return None
    cls = type(model).__name__
    if len(missing) == len(trainable):
        raise GpuwiseError(f"the optimizer holds none of {cls}'s {len(trainable)} trainable parameters (it was "
                           "built over another model's, or a copy's): no step would change a weight",
                           "build the optimizer over this model's parameters: torch.optim.AdamW(model.parameters())")
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (f"the optimizer holds {len(trainable) - len(missing)} of {cls}'s {len(trainable)} trainable parameters: "
            f"{shown} get gradients but are never updated (build the optimizer over model.parameters(), or set "
            "requires_grad=False on those meant to stay frozen)")


def _stuck_hint(data: Any) -> str:
    """Where a batch that does not come is stuck."""
    hint = "look at the Dataset's __getitem__: a network read, a lock, an endless loop"
    return hint + (" (or its DataLoader workers: --workers 0 reads in the training process instead)"
                   if getattr(data, "workers", 0) else "")


def _source_name(data: Any) -> str:
    """How a line names the data a batch comes from: a Dataset by its class."""
    dataset = getattr(data, "dataset", None)
    return f"the Dataset {type(dataset).__name__}" if dataset is not None else type(data).__name__
