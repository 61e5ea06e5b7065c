"""The training loop done right: one GradScaler for the whole run, clipping after unscaling, accumulation
that averages micro-batch losses and all-reduces once per step, warm-up + cosine LR, finite-loss checks,
evaluation every N steps, crash-safe checkpoints and an exact resume (batches are numbered, RNG states are
saved), DDP or FSDP2 under torchrun (``parallelize.py``), and an OOM that is explained and retried once at half
the micro-batch.

TF32 is a process-wide switch, so the Trainer leaves it alone: the run sets it around ``fit``
(``with precision.tf32_matmuls(spec.tf32)``, as ``run_training`` does).

>>> # result = Trainer(model, optimizer, data, TrainConfig(steps=100)).fit()
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuwise.compat import warm_cpu_vml
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.device import Target, device_for
from gpuwise.planning.setup import largest_micro_batch
from gpuwise.precision import PRECISIONS
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import batch_rows, rows, stream, to_device
from gpuwise.training.distributed import Ranks
from gpuwise.training.parallelize import batchnorm_note, gradient_sync, parallelize
from gpuwise.units import human_bytes

OutOfMemory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
LIVE_WINDOW = 50  # steps the progress line's diagnosis looks back over

LossFn = Callable[[nn.Module, Any, Any], torch.Tensor]

CPU = Target(name="cpu", backend="cpu", index=None, model="cpu", row=None, bf16=False, memory_total_bytes=None)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after ``step``; ``saved`` is the checkpoint that holds it (None without a folder).
    ``forced``: a second Ctrl-C stopped it mid-step (nothing saved; under torchrun the processes are not in step)."""

    def __init__(self, step: int, saved: Path | None, forced: bool = False) -> None:
        super().__init__(step, saved)
        self.step, self.saved, self.forced = step, saved, forced


def rank_seed(seed: int, rank: int) -> int:
    """The seed of process ``rank``'s randomness (dropout) after the weights are made: one stream per process,
    so the ranks do not draw the same masks (rank 0 keeps ``seed``)."""
    return seed + 1_000_003 * rank if rank else seed


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
    flops_per_step: float | None = None  # the plan's FLOPs per process per step: MFU's numerator
    predicted_peak: Callable[[int], float] | None = None  # the plan's peak bytes at a micro-batch: OOM notes
    oom_advice: Callable[[int], str | None] | None = None  # the plan's breakdown and remedies at a micro-batch
    on_log: Callable[[StepLog], None] | None = None
    on_event: Callable[[str], None] | None = None  # the trainer's own choices, in words (an OOM retry)
    monitor: Any = None  # a started gpuwise.Monitor: every step's timings go to it (monitor.sampler)
    on_resume: Callable[[int], None] | None = None  # hears the step a resumed run continues from
    run: dict[str, Any] | None = None  # the run's settings, kept in each checkpoint so --resume need not repeat them


def mfu_peak_tflops(target: Target, precision: str) -> float | None:
    """MFU's denominator: the catalog's peak of ``target`` at ``precision``'s rate (GPUs only)."""
    return target.row.peak_tflops.get(PRECISIONS[precision].rate_key) if target.gpu and target.row else None


def cosine_with_warmup(config: TrainConfig) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine down to min_lr_ratio at the last step (nanoGPT's schedule)."""

    def factor(step: int) -> float:
        warmup = config.warmup
        if step < warmup:
            return (step + 1) / warmup
        span = max(config.steps - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def default_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """The model's output is the loss when there is no target (or when it is a scalar); with a target,
    cross-entropy for integer targets (logits last), mean squared error for float ones."""
    if isinstance(x, Mapping):  # Hugging Face style: input_ids, attention_mask, labels as keywords
        out = model(**x)
        y = x.get("labels") if y is None else y
    else:
        out = model(*x) if isinstance(x, tuple) else model(x)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, Mapping) or hasattr(out, "logits"):  # a dict or a ModelOutput without a loss: its logits
        logits = out.get("logits") if isinstance(out, Mapping) else out.logits
        if not isinstance(logits, torch.Tensor):
            keys = ", ".join(map(str, out)) if isinstance(out, Mapping) else type(out).__name__
            raise GpuwiseError(f"the model's forward returns {type(out).__name__} ({keys}) with no 'loss' or "
                               "'logits' tensor", "return the loss, or a dict with 'loss' or 'logits'")
        if y is None:
            raise GpuwiseError("the model returns logits but no loss, and the data has no targets",
                               "give the items a target or 'labels', or return the loss from forward")
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                           ignore_index=-100)  # -100: Hugging Face's "not a target"
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise GpuwiseError(f"the model's forward returns {type(out).__name__}, not a tensor",
                           "return the loss, the logits, or a dict with 'loss' or 'logits'")
    if y is None or out.dim() == 0:
        return out if out.dim() == 0 else out.float().square().mean()
    if y.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return nn.functional.mse_loss(out.float(), y.float())


def model_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """For models whose forward(inputs, targets) returns the loss (the built-in GPT, the image CNN)."""
    return model(x, y)


def _as_batches(data: Any, config: TrainConfig) -> Any:
    """Numbered batches as they are; a map-style Dataset read through the step sampler; a DataLoader refused."""
    from gpuwise.training.data import DatasetBatches

    if hasattr(data, "batch") or hasattr(data, "stream"):
        return data
    if isinstance(data, torch.utils.data.DataLoader):
        raise GpuwiseError("the Trainer takes the Dataset, not a DataLoader",
                           "pass loader.dataset: the Trainer numbers the batches so a resume reads the same ones")
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetBatches(data, seed=config.seed)
    raise GpuwiseError(f"the Trainer cannot read batches from {type(data).__name__}",
                       "pass a map-style Dataset of (input, target) items, or an object with batch(number, size)")


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: Any, config: TrainConfig, *,
                 loss_fn: LossFn = default_loss, eval_data: Any = None, runtime: Runtime | None = None) -> None:
        warm_cpu_vml()  # before any step: a busy CPU must not change the numbers (see its docstring)
        runtime = runtime or Runtime()
        config = config.for_device(runtime.device)  # precision None: the device's default
        self.ranks, self.runtime, self.config = runtime.ranks, runtime, config
        self.per_rank = config.per_process(self.ranks.world_size)
        self.micro_batch = config.micro_batch or self.per_rank
        self.device, self.timer = torch.device(runtime.device.name), device_for(runtime.device.name)
        self.peak_tflops = mfu_peak_tflops(runtime.device, config.precision)
        self.module = model  # unwrapped: what checkpoints hold
        sharded = config.sharding == "fsdp" and self.ranks.world_size > 1
        if not any(p.requires_grad for p in model.parameters()):
            raise GpuwiseError(f"{type(model).__name__} has no trainable parameters (it has "
                               f"{sum(1 for _ in model.parameters())} parameters, none with requires_grad)",
                               "return a model with parameters to train from --model's function")
        self.checkpointer = None if runtime.checkpoint_dir is None else ckpt.Checkpointer(
            runtime.checkpoint_dir, identity=ckpt.identity(model, config, self.ranks.world_size), ranks=self.ranks,
            sharded=sharded, keep=config.keep, run=runtime.run)
        if self.checkpointer is None and config.checkpoint_every:
            raise GpuwiseError("--checkpoint-every needs a folder", "pass --checkpoint-dir DIR")
        p = parallelize(model, optimizer, config, device=self.device, world_size=self.ranks.world_size)
        self.model, self.optimizer, self.sharded = p.model, p.optimizer, p.sharded
        self.autocast_dtype = p.autocast_dtype
        if self.ranks.world_size > 1:  # the weights are made and broadcast: now each process its own dropout
            torch.manual_seed(rank_seed(config.seed, self.ranks.rank))
        self.data, self.loss_fn = _as_batches(data, config), loss_fn
        self.eval_data = None if eval_data is None else _as_batches(eval_data, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cosine_with_warmup(config))
        # One scaler for the whole run: its scale adapts across steps (a new one per step never learns).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=PRECISIONS[config.precision].scaler)
        self.step = 0
        self.skipped_steps = 0  # fp16: updates the scaler skipped, over the whole run
        self.retried = False  # an OOM is retried once per run
        self.events: list[str] = []
        note = batchnorm_note(model, micro_batch=self.micro_batch, per_rank=self.per_rank,
                              world_size=self.ranks.world_size, synced=config.sync_batchnorm)
        if note:
            self._note(note)
        note = _small_dataset_note(self.data, config.batch)
        if note:
            self._note(note)
        self.monitor = runtime.monitor
        self.comm = None  # times DDP's all-reduce for the monitor (exposed communication)
        if self.monitor is not None and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            from gpuwise.monitor.comm import CommTimer

            self.comm = CommTimer(self.model, self.device)

    def _autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _note(self, text: str) -> None:
        self.events.append(text)
        if self.runtime.on_event and self.ranks.main:
            self.runtime.on_event(text)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _save(self) -> None:
        if self.checkpointer is not None:
            state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "rng": ckpt.rng_state(), "step": self.step, "skipped_steps": self.skipped_steps}
            if self.ranks.world_size > 1:  # each process's own random stream (dropout), for an exact resume
                state["rng_ranks"] = self._gather_rng()
            self.checkpointer.save(self.step, self.module, self.optimizer, state)

    def _gather_rng(self) -> dict[str, list[torch.Tensor]]:
        """Every process's torch generator states (CPU, and this GPU's), gathered as uint8 tensors."""
        mine = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(self.device)
        out = {}
        for key, state in mine.items():
            state = state.to(self.device)  # NCCL gathers GPU tensors
            parts = [torch.empty_like(state) for _ in range(self.ranks.world_size)]
            torch.distributed.all_gather(parts, state)
            out[key] = [t.cpu() for t in parts]
        return out

    def _resume(self) -> int:
        if self.checkpointer is None:
            raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
        state, skipped = self.checkpointer.resume(self.module, self.optimizer, steps=self.config.steps,
                                                  needs=("scheduler", "scaler", "rng", "step"))
        if skipped and self.runtime.on_event and self.ranks.main:
            self.runtime.on_event(f"skipped {len(skipped)} damaged checkpoint(s): {'; '.join(skipped)}")
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        streams = state.get("rng_ranks") or {}
        if self.ranks.world_size > 1 and len(streams.get("torch", ())) == self.ranks.world_size:
            torch.set_rng_state(streams["torch"][self.ranks.rank])
            if "cuda" in streams and self.device.type == "cuda":
                torch.cuda.set_rng_state(streams["cuda"][self.ranks.rank], self.device)
        elif self.ranks.world_size > 1:  # another number of processes: a fresh stream per process
            torch.manual_seed(rank_seed(self.config.seed + int(state["step"]), self.ranks.rank))
        self.step, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        return self.step

    # -- one step ------------------------------------------------------------------------------------------

    def _forward_backward(self, x: Any, y: Any, first_step: bool) -> torch.Tensor:
        """Every micro-batch's forward and backward; returns the batch's mean loss."""
        micro = self.micro_batch
        accum = batch_rows(x) // micro
        loss_sum = torch.zeros((), device=self.device)
        for m in range(accum):
            sl = slice(m * micro, (m + 1) * micro)
            xm, ym = to_device(rows(x, sl), self.device), to_device(rows(y, sl), self.device)
            sync = gradient_sync(self.model, sharded=self.sharded, world_size=self.ranks.world_size,
                                 sync=m == accum - 1)
            with self._autocast(), sync:
                try:
                    loss = self.loss_fn(self.model, xm, ym)
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
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise GpuwiseError(f"the loss is {type(loss).__name__}"
                                       f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}, "
                                       "not a scalar tensor", "return a scalar loss from the model or loss_fn")
                loss = loss / accum  # the mean over the whole batch, micro-batch by micro-batch
                timed = self.comm is not None and m == accum - 1  # the backward that all-reduces
                if timed:
                    self.comm.begin()
                self.scaler.scale(loss).backward()
                if timed:
                    self.comm.end()
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
        if self.runtime.predicted_peak is not None:
            parts.append(f"the plan predicted a peak of {human_bytes(self.runtime.predicted_peak(micro))}")
        if self.runtime.oom_advice is not None:
            try:
                advice = self.runtime.oom_advice(micro)
            except GpuwiseError:  # the planner could not capture this model: the allocator's figures stand alone
                advice = None
            if advice:
                parts.append(advice)
        return "; ".join(parts)

    def _check_finite(self, loss: torch.Tensor, x: Any = None, y: Any = None) -> None:
        if not torch.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            for what, part in (("inputs", x), ("targets", y)):  # the data first: no learning rate cures a NaN input
                bad = _non_finite(part)
                if bad:
                    raise GpuwiseError(f"the batch of step {self.step + 1} holds {bad} in its {what}, and the loss "
                                       f"is {loss.item()}", "clean the data (torch.nan_to_num, or drop those items)"
                                       " in the Dataset")
            raise GpuwiseError(f"the loss is {loss.item()} at step {self.step + 1}",
                               "lower --lr, or use --precision bf16-mixed (fp16 overflows where bf16 does not)"
                               + (f"; the fp16 scaler skipped {self.skipped_steps} steps before"
                                  if self.skipped_steps else ""))

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

    def _next(self, batches) -> tuple[Any, Any]:
        try:
            return next(batches)
        except GpuwiseError:
            raise
        except SystemExit as exc:
            raise GpuwiseError(f"the Dataset called sys.exit({exc.code}) reading the batch of step {self.step + 1}",
                               "raise an exception in __getitem__ instead of exiting") from None
        except Exception as exc:  # the user's Dataset or its collation
            raise GpuwiseError(f"reading the batch of step {self.step + 1} failed: {first_line(exc)}",
                               "check the Dataset: every item (input, target) with the same shapes") from exc

    # -- the monitor's timings -------------------------------------------------------------------------------

    def _mark(self) -> Any:
        """A point in the step: a CUDA event on the compute stream (no synchronisation), else the host clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def _report(self, dt: float, waited: float, waited_cpu: float, marks: list[Any]) -> None:
        """The step to the monitor, after the step's synchronisation (the CUDA events are complete then)."""
        comm, exposed = self.comm.take() if self.comm is not None else (None, None)
        self.monitor.step(seconds=dt, data_wait_s=waited, data_wait_cpu_s=waited_cpu,
                          compute_s=self._seconds(marks[0], marks[1]),
                          optimizer_s=self._seconds(marks[1], marks[2]), comm_s=comm, exposed_comm_s=exposed,
                          peak_memory_bytes=self.timer.peak_memory_bytes(), flops=self.runtime.flops_per_step)

    def _bottleneck(self) -> str | None:
        """The monitor's diagnosis of the last steps, for the progress line (None without one, or on failure:
        a diagnosis must never stop a run)."""
        if self.monitor is None:
            return None
        try:
            return self.monitor.diagnose(last_steps=LIVE_WINDOW).bottleneck
        except Exception:
            return None

    # -- the run -------------------------------------------------------------------------------------------

    def fit(self, *, resume: bool = False) -> TrainResult:
        """Train to ``config.steps`` (from the newest good checkpoint with ``resume``). A one-line error
        (bad data, a non-finite loss, an OOM that a retry did not cure) first saves the steps done so far."""
        if self.checkpointer is not None:
            self.checkpointer.lock()
        try:
            if not resume and self.checkpointer is not None:
                self.checkpointer.check_fresh()
            resumed = self._resume() if resume else None
            if resumed is not None and self.runtime.on_resume is not None and self.ranks.main:
                self.runtime.on_resume(resumed)
            self.saved = self.step
            with self._stop_on_interrupt():
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

    @contextlib.contextmanager
    def _stop_on_interrupt(self):
        """The first Ctrl-C lets the step in progress finish (a half-applied update is never saved); the second
        stops at once. Under torchrun (which passes Ctrl-C on to every process, each at its own point in a step)
        the processes agree on the step to stop after: the flag travels with the step's loss all-reduce."""
        self.interrupted = self.forced = self.stop_agreed = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.interrupted:
                self.forced = True  # mid-step: the state may be half updated, so nothing is saved
                raise KeyboardInterrupt
            self.interrupted = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _interrupted(self) -> Interrupted:
        """Save the steps trained since the last checkpoint, and say where the run stopped."""
        forced = getattr(self, "forced", False)
        if self.checkpointer is None:
            return Interrupted(self.step, None, forced)
        if self.step > self.saved and not forced:  # under torchrun every process is here, after the same step
            self._save()
            self.saved = self.step
        found, _ = ckpt.latest(self.checkpointer.folder)
        return Interrupted(self.step, found.path if found is not None else None, forced)

    def _loop(self, resumed: int | None) -> TrainResult:
        cfg, world = self.config, self.ranks.world_size
        logs: list[StepLog] = []
        start, first_step, eval_loss = time.perf_counter(), self.step, None
        self.model.train()
        batches = stream(self.data, self.step, cfg.steps, cfg.batch, self.ranks.rank, world,
                         pin=self.device.type == "cuda")
        while self.step < cfg.steps:
            if getattr(self, "stop_agreed" if world > 1 else "interrupted", False):
                raise KeyboardInterrupt
            t0, cpu0 = time.perf_counter(), time.process_time()
            self.timer.reset_peak_memory()
            x, y = self._next(batches)  # this process's share of the step's global batch
            waited, waited_cpu = time.perf_counter() - t0, time.process_time() - cpu0
            marks = [self._mark()] if self.monitor is not None else None
            loss = self._forward_backward_retrying(x, y, first_step=self.step == first_step)
            if marks is not None:
                marks.append(self._mark())
            if world > 1:  # the loss of the global batch, as one process would see it, and whether any process
                # heard Ctrl-C: then all of them stop after this step
                both = torch.stack([loss.float(), torch.tensor(float(getattr(self, "interrupted", False)),
                                                               device=loss.device)])
                torch.distributed.all_reduce(both)
                loss, self.stop_agreed = both[0] / world, bool(both[1] > 0)
            self._check_finite(loss, x, y)
            grad_norm, skipped = self._update()
            if marks is not None:
                marks.append(self._mark())
            self.skipped_steps += skipped
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            self.timer.synchronize()
            dt = time.perf_counter() - t0
            if marks is not None:
                self._report(dt, waited, waited_cpu, marks)
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or self.step == cfg.steps:
                self._save()  # before evaluating: a failing evaluation loses nothing
                self.saved = self.step
            evaluate = self.eval_data is not None and (
                (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps)
            step_eval = self._evaluate() if evaluate else None
            eval_loss = step_eval if step_eval is not None else eval_loss
            if self.step % cfg.log_every == 0 or self.step == cfg.steps or step_eval is not None:
                tokens = y.numel() if isinstance(y, torch.Tensor) and y.dim() > 1 else batch_rows(x)
                flops, peak = self.runtime.flops_per_step, self.peak_tflops
                logs.append(StepLog(step=self.step, loss=float(loss), lr=lr, grad_norm=grad_norm,
                                    tokens_per_s=tokens * world / dt, mfu=flops / dt / (peak * 1e12)
                                    if flops and peak else None, peak_memory_bytes=self.timer.peak_memory_bytes(),
                                    data_wait=waited / dt, skipped=skipped, eval_loss=step_eval,
                                    bottleneck=self._bottleneck()))
                if self.runtime.on_log and self.ranks.main:
                    self.runtime.on_log(logs[-1])
        return TrainResult(steps=self.step, final_loss=logs[-1].loss if logs else math.nan, eval_loss=eval_loss,
                           logs=tuple(logs), skipped_steps=self.skipped_steps,
                           seconds=time.perf_counter() - start, resumed_from=resumed, micro_batch=self.micro_batch,
                           grad_accum=self.per_rank // self.micro_batch, events=tuple(self.events))


def _small_dataset_note(data: Any, batch: int) -> str | None:
    """Said when a Dataset holds fewer items than the batch: every step then reads its items more than once
    (a one-item Dataset was read 8 times a step at --batch 8, silently)."""
    from gpuwise.training.data import DatasetBatches

    if not isinstance(data, DatasetBatches):
        return None
    n = len(data.dataset)
    if n == 0 or n >= batch:
        return None
    items = "1 item" if n == 1 else f"{n} items"
    return (f"the dataset holds {items}, fewer than the batch of {batch}: each step reads every item about "
            f"{batch / n:.3g} times (lower --batch, or give more data)")


def _non_finite(x: Any) -> str | None:
    """"NaN" or "Inf" where a floating tensor in ``x`` (a tensor, tuple or dict of them) holds one, else None."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            return None
        return "NaN" if torch.isnan(x).any() else "Inf" if torch.isinf(x).any() else None
    parts = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    return next((bad for bad in map(_non_finite, parts) if bad), None)
