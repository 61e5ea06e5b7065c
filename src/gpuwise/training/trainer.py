"""The training loop done right: one GradScaler for the whole run, clipping after unscaling, accumulation
that averages micro-batch losses and all-reduces once per step, warm-up + cosine LR, finite-loss checks,
evaluation every N steps, crash-safe checkpoints and an exact resume (batches are numbered, RNG states are
saved), DDP or FSDP2 under torchrun, and an OOM that is explained and retried once at half the micro-batch.

>>> # trainer = Trainer(model, optimizer, data, TrainConfig(steps=100)); result = trainer.fit()
"""

from __future__ import annotations

import contextlib
import gc
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpuwise.compat import fsdp2
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import batch_rows, rows, stream, to_device
from gpuwise.training.distributed import Ranks
from gpuwise.units import human_bytes

OutOfMemory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

LossFn = Callable[[nn.Module, Any, Any], torch.Tensor]


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


def identity(model: nn.Module, config: TrainConfig, world_size: int = 1) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: parameter names, shapes and dtypes, and the run's batch,
    precision, learning rate, seed and layout (sharded or whole). The micro-batch and the number of
    processes may change (the steps are the same); so may ``steps``, which stretches the schedule."""
    return {"model": {name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                      for name, p in model.state_dict().items()},
            "batch": config.batch, "precision": config.precision, "lr": config.lr, "seed": config.seed,
            "sharding": "fsdp" if config.sharding == "fsdp" and world_size > 1 else "none"}


def default_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """The model's output is the loss when there is no target (or when it is a scalar); with a target,
    cross-entropy for integer targets (logits last), mean squared error for float ones."""
    out = model(*x) if isinstance(x, tuple) else model(x)
    if hasattr(out, "loss") and isinstance(out.loss, torch.Tensor):
        return out.loss
    if isinstance(out, (tuple, list)):
        out = out[0]
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
                 device: str = "cpu", loss_fn: LossFn = default_loss, eval_data: Any = None,
                 flops_per_step: float | None = None, peak_tflops: float | None = None,
                 predicted_peak: Callable[[int], float] | None = None,
                 checkpoint_dir: str | Path | None = None, on_log: Callable[[StepLog], None] | None = None,
                 on_event: Callable[[str], None] | None = None, ranks: Ranks | None = None) -> None:
        self.ranks = ranks or Ranks()
        self.config_batch_split(config, self.ranks)
        self.device = torch.device(device)
        self.module = model  # unwrapped: what checkpoints hold
        self.identity = identity(model, config, self.ranks.world_size)
        self.fingerprint = ckpt.fingerprint_of(self.identity)
        if config.checkpointing:
            from gpuwise.planning.transforms import apply_checkpointing, find_blocks

            blocks = find_blocks(model)
            if blocks is None:
                raise GpuwiseError(f"--checkpointing found no repeated blocks in {type(model).__name__}",
                                   "drop --checkpointing, or keep the blocks in an nn.ModuleList")
            apply_checkpointing(blocks)
        self.fsdp = config.sharding == "fsdp" and self.ranks.world_size > 1
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(config.precision)
        if self.fsdp:
            model, optimizer = self._shard(model, optimizer, config)
        elif config.compile:
            model = torch.compile(model)  # before DDP, as nanoGPT does: the module's forward is compiled
        if self.ranks.world_size > 1 and not self.fsdp:  # gradients averaged over processes
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                            else None)
        self.model, self.optimizer, self.data, self.config = model, optimizer, _as_batches(data, config), config
        self.loss_fn, self.eval_data = loss_fn, None if eval_data is None else _as_batches(eval_data, config)
        self.flops_per_step, self.peak_tflops, self.predicted_peak = flops_per_step, peak_tflops, predicted_peak
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        if self.checkpoint_dir is None and config.checkpoint_every:
            raise GpuwiseError("--checkpoint-every needs a folder", "pass --checkpoint-dir DIR")
        if self.checkpoint_dir is not None:
            ckpt.check_writable(self.checkpoint_dir)
        self.on_log, self.on_event = on_log, on_event
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(config))
        fp16 = config.precision == "fp16-mixed"
        # One scaler for the whole run: its scale adapts across steps (a new one per step never learns).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)
        if config.precision in ("tf32", "fp32") and self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.precision == "tf32"
        self.step = 0
        self.skipped_steps = 0  # fp16: updates the scaler skipped, over the whole run
        self.micro_batch = config.micro_batch or config.batch // self.ranks.world_size
        self.events: list[str] = []

    @staticmethod
    def config_batch_split(config: TrainConfig, ranks: Ranks) -> None:
        """The global batch must split evenly over the processes, and each share into micro-batches."""
        per_rank = config.batch // ranks.world_size
        if config.batch % ranks.world_size or per_rank % (config.micro_batch or per_rank):
            raise GpuwiseError(f"--batch {config.batch} does not split over {ranks.world_size} processes"
                               + (f" in micro-batches of {config.micro_batch}" if config.micro_batch else ""),
                               "make the batch a multiple of processes x micro-batch")

    def _shard(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig):
        """FSDP2: each block, then the root, sharded over the processes; the optimizer rebuilt on the shards."""
        from torch.distributed.device_mesh import init_device_mesh

        from gpuwise.planning.transforms import find_blocks

        if config.precision == "fp16-mixed":
            raise GpuwiseError("--sharding fsdp does not take fp16-mixed here", "use --precision bf16-mixed")
        if len(optimizer.param_groups) != 1:
            raise GpuwiseError("--sharding fsdp rebuilds the optimizer on the shards: it needs one param group",
                               "pass an optimizer over model.parameters()")
        fully_shard, policy = fsdp2()
        mesh = init_device_mesh(self.device.type, (self.ranks.world_size,))
        mp = policy(param_dtype=self.autocast_dtype, reduce_dtype=torch.float32) if self.autocast_dtype \
            else policy()
        self.autocast_dtype = None  # the policy casts the parameters; no autocast on top
        for block in find_blocks(model) or []:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if config.compile:
            model.compile()
        import inspect

        takes = inspect.signature(type(optimizer)).parameters  # defaults may hold more than the constructor takes
        return model, type(optimizer)(model.parameters(), **{k: v for k, v in optimizer.defaults.items()
                                                            if k in takes})

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _barrier(self) -> None:
        if self.ranks.world_size > 1:
            torch.distributed.barrier()

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "rng": ckpt.rng_state(), "step": self.step, "skipped_steps": self.skipped_steps}

    def _save(self) -> None:
        if self.checkpoint_dir is None:
            return
        cfg = self.config
        if self.fsdp:
            self._save_sharded()
        elif self.ranks.main:  # one writer: under DDP every process holds the same weights and optimizer state
            ckpt.save(self.checkpoint_dir, self.step, model_state=self.module.state_dict(),
                      state={**self._state(), "optimizer": self.optimizer.state_dict()},
                      fingerprint=self.fingerprint, keep=cfg.keep, identity=self.identity)
        self._barrier()

    def _save_sharded(self) -> None:
        """Every process writes its shards with torch.distributed.checkpoint into one hidden folder; rank 0
        adds the state and the manifest and renames it into place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        folder = self.checkpoint_dir
        tmp = folder / f".{ckpt.PREFIX}{self.step:09d}.sharded"
        if self.ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
        self._barrier()
        if self.ranks.main:
            torch.save(self._state(), tmp / "state.pt")
            ckpt.commit(folder, self.step, tmp, fingerprint=self.fingerprint, keep=self.config.keep,
                        extra={"format": "dcp", "identity": self.identity})

    def _resume(self) -> int | None:
        if self.checkpoint_dir is None:
            raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
        found, skipped = ckpt.latest(self.checkpoint_dir)
        if found is None:
            reason = f" ({'; '.join(skipped)})" if skipped else ""
            raise GpuwiseError(f"no usable checkpoint in {self.checkpoint_dir}{reason}", "start without --resume")
        if skipped and self.on_event and self.ranks.main:
            self.on_event(f"skipped {len(skipped)} damaged checkpoint(s): {'; '.join(skipped)}")
        ckpt.check_identity(found, self.identity)
        if found.step >= self.config.steps:
            raise GpuwiseError(f"{found.path.name} is at step {found.step} already, --steps is {self.config.steps}",
                               f"pass --steps above {found.step} to train on")
        if ckpt.is_sharded(found) != self.fsdp:
            raise GpuwiseError(f"{found.path.name} is {'sharded' if ckpt.is_sharded(found) else 'whole'}, this run "
                               f"is {'sharded' if self.fsdp else 'not'}",
                               "resume with the same --sharding and torchrun")
        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            shards = {"model": model_state, "optimizer": optim_state}
            try:
                dcp.load(shards, checkpoint_id=str(found.path / "dcp"))
            except BaseException as exc:  # CheckpointException derives from BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise GpuwiseError(f"{found.path.name}: the sharded weights do not load "
                                   f"({type(exc).__name__})", "resume with the processes that wrote it") from None
            set_state_dict(self.model, self.optimizer, model_state_dict=shards["model"],
                           optim_state_dict=shards["optimizer"])
            state = ckpt.load_state(found)
        else:
            weights, state = ckpt.load(found)
            self.module.load_state_dict(weights)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        return self.step

    # -- steps ---------------------------------------------------------------------------------------------

    def _sync_context(self, sync: bool):
        """All-reduce gradients on the last micro-batch only, not on every one."""
        if self.ranks.world_size == 1 or sync:
            if self.fsdp:
                self.model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.fsdp:
            self.model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _forward_backward(self, x: Any, y: Any, micro: int, first_step: bool) -> tuple[torch.Tensor, int]:
        """Every micro-batch's forward and backward; returns the batch's mean loss and its token count."""
        n = batch_rows(x)
        accum = n // micro
        loss_sum = torch.zeros((), device=self.device)
        for m in range(accum):
            sl = slice(m * micro, (m + 1) * micro)
            xm, ym = to_device(rows(x, sl), self.device), to_device(rows(y, sl), self.device)
            with self._autocast(), self._sync_context(m == accum - 1):
                try:
                    loss = self.loss_fn(self.model, xm, ym)
                except OutOfMemory:
                    raise
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
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach().float()
        tokens = (y.numel() if isinstance(y, torch.Tensor) and y.dim() > 1 else n)
        return loss_sum, tokens

    def _explain_oom(self, exc: BaseException, micro: int) -> str:
        parts = [f"out of memory at micro-batch {micro}"]
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            parts.append(f"allocated {human_bytes(stats.get('allocated_bytes.all.current', 0))}, peak "
                         f"{human_bytes(stats.get('allocated_bytes.all.peak', 0))}, reserved "
                         f"{human_bytes(stats.get('reserved_bytes.all.current', 0))} of {human_bytes(total)}")
        if self.predicted_peak is not None:
            parts.append(f"the plan predicted a peak of {human_bytes(self.predicted_peak(micro))}")
        return "; ".join(parts)

    def _after_oom(self, exc: BaseException, retried: bool, per_rank: int) -> None:
        """Explain the OOM; the first time, free what the failed step held and halve the micro-batch."""
        why = self._explain_oom(exc, self.micro_batch)
        smaller = next((m for m in range(self.micro_batch // 2, 0, -1) if per_rank % m == 0), 0)
        if retried or smaller == 0 or self.ranks.world_size > 1:
            hint = ("under torchrun the processes cannot retry alone: lower --micro-batch"
                    if self.ranks.world_size > 1 and not retried else
                    "gpuwise plan shows what fits; lower --micro-batch or add --checkpointing")
            raise GpuwiseError(why + (" (after one retry at half the micro-batch)" if retried else ""),
                               hint) from exc
        self.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
        event = f"{why}: retrying step {self.step + 1} with micro-batch {smaller} x {per_rank // smaller}"
        self.events.append(event)
        if self.on_event and self.ranks.main:
            self.on_event(event)
        self.micro_batch = smaller

    def _update(self) -> float | None:
        """Unscale, clip, step (the scaler skips a step with inf/NaN gradients); the gradient norm if clipped."""
        grad_norm = None
        if self.config.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm

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
        cfg = self.config
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for x, y in stream(self.eval_data, 0, cfg.eval_batches, cfg.batch, self.ranks.rank,
                               self.ranks.world_size):
                micro = self.micro_batch
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

    def fit(self, *, resume: bool = False) -> TrainResult:
        """Train to ``config.steps`` (from the newest good checkpoint with ``resume``). A one-line error
        (bad data, a non-finite loss, an OOM that a retry did not cure) first saves the steps done so far."""
        existing = ckpt.steps_in(self.checkpoint_dir) if not resume and self.checkpoint_dir is not None else []
        if existing:
            raise GpuwiseError(f"{self.checkpoint_dir} holds checkpoints of a run already (newest {existing[-1].name})",
                               "pass --resume to continue it, or another --checkpoint-dir")
        resumed = self._resume() if resume else None
        self.saved = self.step
        try:
            return self._loop(resumed)
        except GpuwiseError:
            if self.step > self.saved and self.ranks.world_size == 1:  # keep what was trained
                self._save()
                self.events.append(f"saved step {self.step} before stopping")
            raise

    def _next(self, batches) -> tuple[Any, Any]:
        try:
            return next(batches)
        except GpuwiseError:
            raise
        except Exception as exc:  # the user's Dataset or its collation
            raise GpuwiseError(f"reading the batch of step {self.step + 1} failed: {first_line(exc)}",
                               "check the Dataset: every item (input, target) with the same shapes") from exc

    def _loop(self, resumed: int | None) -> TrainResult:
        cfg = self.config
        per_rank = cfg.batch // self.ranks.world_size
        logs: list[StepLog] = []
        retried = False
        start = time.perf_counter()
        first_step = self.step
        self.model.train()
        batches = stream(self.data, self.step, cfg.steps, cfg.batch, self.ranks.rank, self.ranks.world_size,
                         pin=self.device.type == "cuda")
        eval_loss = None
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            x, y = self._next(batches)  # this process's share of the step's global batch
            waited = time.perf_counter() - t0
            again = False
            while True:
                if again:  # outside the except block: the exception's frames no longer hold the tensors
                    gc.collect()
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                try:
                    loss_sum, tokens = self._forward_backward(x, y, self.micro_batch, self.step == first_step)
                    break
                except OutOfMemory as exc:
                    self._after_oom(exc, retried, per_rank)
                    retried = again = True
            if self.ranks.world_size > 1:  # the loss of the global batch, as one process would see it
                torch.distributed.all_reduce(loss_sum)
                loss_sum /= self.ranks.world_size
            if not torch.isfinite(loss_sum):
                self.optimizer.zero_grad(set_to_none=True)
                raise GpuwiseError(f"the loss is {loss_sum.item()} at step {self.step + 1}",
                                   "lower --lr, or use --precision bf16-mixed (fp16 overflows where bf16 does not)"
                                   + (f"; the fp16 scaler skipped {self.skipped_steps} steps before"
                                      if self.skipped_steps else ""))
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            try:
                grad_norm = self._update()
            except OutOfMemory as exc:
                raise GpuwiseError(self._explain_oom(exc, self.micro_batch).replace(
                    "out of memory at micro-batch", "out of memory in the optimizer step, micro-batch"),
                    "the weights, gradients and optimizer states alone do not fit: gpuwise plan shows the "
                    "remedies (bf16, sharding, LoRA)") from exc
            skipped = scale is not None and self.scaler.get_scale() < scale  # the scale drops when it skips
            self.skipped_steps += skipped
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or self.step == cfg.steps:
                self._save()  # before evaluating: a failing evaluation loses nothing
                self.saved = self.step
            evaluate = self.eval_data is not None and (
                (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps)
            step_eval = self._evaluate() if evaluate else None
            eval_loss = step_eval if step_eval is not None else eval_loss
            if self.step % cfg.log_every == 0 or self.step == cfg.steps or step_eval is not None:
                mfu = (self.flops_per_step / dt / (self.peak_tflops * 1e12)
                       if self.flops_per_step and self.peak_tflops else None)
                log = StepLog(step=self.step, loss=float(loss_sum), lr=lr, grad_norm=grad_norm,
                              tokens_per_s=tokens * self.ranks.world_size / dt, mfu=mfu,
                              peak_memory_bytes=int(torch.cuda.max_memory_allocated(self.device))
                              if self.device.type == "cuda" else None, data_wait=waited / dt, skipped=skipped,
                              eval_loss=step_eval)
                logs.append(log)
                if self.on_log and self.ranks.main:
                    self.on_log(log)
        return TrainResult(steps=self.step, final_loss=logs[-1].loss if logs else math.nan, eval_loss=eval_loss,
                           logs=tuple(logs), skipped_steps=self.skipped_steps,
                           seconds=time.perf_counter() - start, resumed_from=resumed, micro_batch=self.micro_batch,
                           grad_accum=per_rank // self.micro_batch, events=tuple(self.events))
