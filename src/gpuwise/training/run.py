"""``gpuwise train`` as a function: build the task, let the planner choose the settings, train, summarise.

>>> # summary = run_training(TrainOptions(steps=60)); print(summary.final_loss)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.training.config import TrainConfig
from gpuwise.training.distributed import Ranks, start, stop
from gpuwise.training.trainer import StepLog, Trainer


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    task: str = "text"  # text (character GPT) or image (small CNN); ignored with --model
    model: str | None = None  # file.py:function -> (model, inputs)
    data: str | None = None  # file.py:function -> Dataset (or (train, val))
    seq: int | None = None  # text: characters per sequence [128]
    image_size: int | None = None  # image: pixels per side [32]
    device: str | None = None  # default: the GPU if there is one
    auto: bool = True  # the planner picks precision and micro-batch
    fused: bool | None = None  # fused AdamW (default: on GPUs; foreach on CPUs)
    workers: int | None = None  # DataLoader workers for --data (default: 4 on GPUs, 0 on CPUs)
    checkpoint_dir: str | None = None
    resume: bool = False
    config: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields the user gave


@dataclass(frozen=True, kw_only=True)
class TrainSummary:
    task: str
    steps: int
    final_loss: float
    eval_loss: float | None
    seconds: float
    resumed_from: int | None
    skipped_steps: int  # fp16: updates the scaler skipped
    device: str
    processes: int
    sharding: str | None
    precision: str
    params: int
    micro_batch: int
    grad_accum: int
    batch: int
    unit: str  # what throughput counts: tokens or samples
    throughput: float | None  # median over the logged steps after the first
    mfu: float | None
    peak_memory_bytes: int | None
    compiled: bool
    optimizer: str
    auto: str | None  # what --auto chose and why
    events: tuple[str, ...]
    checkpoint_dir: str | None


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _task(opts: TrainOptions, batch: int, seed: int, cuda: bool):
    from gpuwise.training import tasks

    if opts.data and not opts.model:
        raise GpuwiseError("--data needs --model", "pass --model file.py:function for the data to train")
    if opts.model:
        if opts.seq is not None or opts.image_size is not None:
            raise GpuwiseError("--seq and --image-size do not apply to --model", "size the data in your functions")
        workers = opts.workers if opts.workers is not None else (4 if cuda else 0)
        return tasks.file_task(opts.model, opts.data, batch, seed, workers)
    if opts.task == "text":
        if opts.image_size is not None:
            raise GpuwiseError("--image-size applies to --task image", "drop --image-size, or pass --task image")
        return tasks.text_task(opts.seq or 128, seed)
    if opts.task == "image":
        if opts.seq is not None:
            raise GpuwiseError("--seq applies to --task text", "drop --seq, or use --image-size")
        return tasks.image_task(opts.image_size or 32, seed)
    raise GpuwiseError(f"--task {opts.task!r} is not text or image", "pass --task text or --task image")


def _peak_tflops(name: str, precision: str) -> float | None:
    if not name.startswith("cuda"):
        return None
    from gpuwise.hardware.catalog import load_catalog

    props = torch.cuda.get_device_properties(torch.device(name))
    match = load_catalog().match_device(props.name, props.total_memory)
    key = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(precision, precision)
    return match.peak_tflops.get(key) if match else None


def run_training(opts: TrainOptions, *, on_log: Callable[[StepLog], None] | None = None,
                 on_event: Callable[[str], None] | None = None,
                 environ: Mapping[str, str] | None = None) -> TrainSummary:
    """Train as ``gpuwise train`` does; ``on_event`` hears the choices made (auto settings, OOM retries)."""
    from gpuwise.hardware.device import device_for

    if opts.resume and not opts.checkpoint_dir:
        raise GpuwiseError("--resume needs a checkpoint folder", "pass --checkpoint-dir DIR")
    ranks = Ranks.from_environ(os.environ if environ is None else environ)  # set by torchrun
    name = device_for(opts.device or ("cuda" if torch.cuda.is_available() else "cpu")).name
    cuda = name.startswith("cuda")
    if ranks.world_size > 1 and cuda:
        name = f"cuda:{ranks.local_rank}"
    start(ranks, torch.device(name))
    try:
        summary = _run(opts, ranks, name, cuda, on_log, on_event)
    finally:
        stop(ranks)
    return summary


def _run(opts: TrainOptions, ranks: Ranks, name: str, cuda: bool, on_log, on_event) -> TrainSummary:
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.workload import simulate
    from gpuwise.training.distributed import agree_min

    say = (lambda text: on_event(text)) if on_event and ranks.main else (lambda text: None)
    config = TrainConfig(**opts.config)
    if config.sharding == "fsdp" and ranks.world_size == 1:
        say("--sharding fsdp with one process shards nothing: training unsharded (run it under torchrun)")
    task = _task(opts, config.batch, config.seed, cuda)
    auto_reason = None
    if opts.auto:
        import psutil

        from gpuwise.training.auto import choose

        free = torch.cuda.mem_get_info(torch.device(name))[0] if cuda else psutil.virtual_memory().available
        try:
            choice = choose(task.source, precision=opts.config.get("precision"), seq=task.seq,
                            per_rank=config.batch // ranks.world_size, free_bytes=free,
                            device_type=name.split(":")[0], bf16=cuda and torch.cuda.is_bf16_supported(),
                            checkpointing=config.checkpointing)
        except GpuwiseError as exc:
            auto_reason = f"the planner could not capture the model ({exc.message}): the whole batch at once"
        else:
            asked = opts.config.get("micro_batch")
            micro = asked or agree_min(ranks, choice.micro_batch, torch.device(name))  # one choice for all
            config = replace(config, precision=choice.precision, micro_batch=micro)
            auto_reason = choice.reason + (f" (--micro-batch {asked} as asked)" if asked else "")
        say(f"auto: {auto_reason}")
    elif "precision" not in opts.config:
        config = replace(config, precision="bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "fp32")
    if config.precision in ("bf16", "bf16-mixed") and cuda and not torch.cuda.is_bf16_supported():
        raise GpuwiseError(f"this GPU has no bf16 for --precision {config.precision}", "use --precision fp16-mixed")

    torch.manual_seed(config.seed)
    with torch.device(name):
        model = task.build()
    if config.precision == "bf16":
        model = model.to(torch.bfloat16)
    fused = cuda if opts.fused is None else opts.fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95), **({"fused": True} if fused else {"foreach": True}))
    micro = config.micro_batch or config.batch // ranks.world_size
    setup = Setup(micro_batch=micro, seq=task.seq, precision=config.precision,
                  grad_accum=config.batch // ranks.world_size // micro,
                  checkpointing="full" if config.checkpointing else "none")
    try:
        flops = simulate(task.source, setup, batch_model=False).flops_per_step  # per process, as the peak is
    except GpuwiseError:
        flops = None

    def predicted_peak(m: int) -> float:
        w = simulate(task.source, replace(setup, batch=m), batch_model=False)
        return float(w.timeline.live(m).sum(axis=1).max())

    trainer = Trainer(model, optimizer, task.data, config, device=name, loss_fn=task.loss_fn,
                      eval_data=task.eval_data, flops_per_step=flops, peak_tflops=_peak_tflops(name,
                      config.precision), predicted_peak=predicted_peak, checkpoint_dir=opts.checkpoint_dir,
                      on_log=on_log, on_event=on_event, ranks=ranks)
    result = trainer.fit(resume=opts.resume)
    later = [log for log in result.logs if log.step > (result.resumed_from or 0) + 1] or list(result.logs)
    peaks = [log.peak_memory_bytes for log in result.logs if log.peak_memory_bytes is not None]
    return TrainSummary(
        task=task.name, steps=result.steps, final_loss=result.final_loss, eval_loss=result.eval_loss,
        seconds=result.seconds, resumed_from=result.resumed_from, skipped_steps=result.skipped_steps, device=name,
        processes=ranks.world_size, sharding=config.sharding if ranks.world_size > 1 else None,
        precision=config.precision, params=sum(p.numel() for p in model.parameters()),
        micro_batch=result.micro_batch, grad_accum=result.grad_accum, batch=config.batch, unit=task.unit,
        throughput=_median([log.tokens_per_s for log in later]),
        mfu=_median([log.mfu for log in later if log.mfu is not None]),
        peak_memory_bytes=max(peaks) if peaks else None, compiled=config.compile,
        optimizer=f"AdamW ({'fused' if fused else 'foreach'})", auto=auto_reason, events=result.events,
        checkpoint_dir=opts.checkpoint_dir)
