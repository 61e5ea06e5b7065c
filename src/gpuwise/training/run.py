"""``gpuwise train`` as a function: resolve the device, build the task, let the planner choose the micro-batch,
train, summarise.

>>> # summary = run_training(TrainOptions(config=TrainConfig(steps=60))); print(summary.final_loss)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuwise.errors import GpuwiseError
from gpuwise.training.config import IMAGE_SIZE, TEXT_SEQ, TrainConfig, TrainOptions, plan_only
from gpuwise.training.distributed import Ranks

if TYPE_CHECKING:
    from gpuwise.hardware.detect import LocalMachine
    from gpuwise.hardware.device import Target
    from gpuwise.training.trainer import StepLog

__all__ = ["TrainOptions", "TrainSummary", "prepare", "run_training"]


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
    gpu: str | None  # the catalog row of the device (its key), whose peak the MFU divides by
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


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a run decided before touching the device: where it runs and the config it runs with."""

    target: Target  # this process's device, with its catalog row
    config: TrainConfig  # the precision decided (the given one, else the device's default)


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def prepare(opts: TrainOptions, ranks: Ranks, machine: LocalMachine) -> Prepared:
    """The device of this process (``--device``, else the default one; under torchrun the GPU of its local rank)
    and the config on it; ``--gpus`` checked against the processes torchrun started."""
    from gpuwise.hardware.device import resolve_device

    gpus = opts.gpus or ranks.world_size
    if gpus != ranks.world_size:
        if ranks.world_size == 1:
            raise plan_only(f"--gpus {gpus} needs {gpus} processes, and this is one",
                            f"torchrun --nproc_per_node {gpus} -m gpuwise train ...")
        raise GpuwiseError(f"--gpus {gpus}, but torchrun started {ranks.world_size} processes",
                           f"pass --gpus {ranks.world_size}, or torchrun --nproc_per_node {gpus}")
    target = resolve_device(opts.device, machine)
    if ranks.world_size > 1 and target.gpu:
        target = resolve_device(f"cuda:{ranks.local_rank}", machine)
    config = opts.config.for_device(target)
    config.per_process(ranks.world_size)
    return Prepared(target=target, config=config)


def _task(opts: TrainOptions, batch: int, seed: int, cuda: bool):
    from gpuwise.training import tasks

    if opts.data and not opts.model:
        raise GpuwiseError("--data needs --model", "pass --model file.py:function for the data to train")
    if opts.model:
        if opts.seq is not None or opts.image_size is not None:
            raise GpuwiseError("--seq and --image-size do not apply to --model", "size the data in your functions")
        workers = opts.workers if opts.workers is not None else (4 if cuda else 0)
        return tasks.file_task(opts.model, opts.data, batch, seed, workers)
    if opts.example == "text":
        if opts.image_size is not None:
            raise GpuwiseError("--image-size applies to --example image",
                               "drop --image-size, or pass --example image")
        return tasks.text_task(opts.seq or TEXT_SEQ, seed)
    if opts.seq is not None:
        raise GpuwiseError("--seq applies to --example text", "drop --seq, or use --image-size")
    return tasks.image_task(opts.image_size or IMAGE_SIZE, seed)


def _precision_reason(opts: TrainOptions, target: Target) -> str:
    if opts.config.precision is not None:
        return "as asked"
    if target.gpu:
        return "the GPU has bf16" if target.bf16 else "no bf16 on this GPU: fp16 with a scaler"
    return f"{target.backend} training runs in fp32"


def run_training(opts: TrainOptions, *, on_log: Callable[[StepLog], None] | None = None,
                 on_event: Callable[[str], None] | None = None, environ: Mapping[str, str] | None = None,
                 machine: LocalMachine | None = None) -> TrainSummary:
    """Train as ``gpuwise train`` does; ``on_event`` hears the choices made (auto settings, OOM retries).
    ``machine`` (default: this one, probed) is where ``--device`` is looked up."""
    import torch

    from gpuwise.hardware.device import local_machine
    from gpuwise.precision import PRECISIONS, tf32_matmuls
    from gpuwise.training.distributed import start, stop

    environ = os.environ if environ is None else environ
    ranks = Ranks.from_environ(environ)  # set by torchrun
    prepared = prepare(opts, ranks, machine or local_machine(environ))
    start(ranks, torch.device(prepared.target.name))
    try:
        with tf32_matmuls(PRECISIONS[prepared.config.precision].tf32):  # a process setting: the run's, not the loop's
            return _run(opts, prepared, ranks, on_log, on_event)
    finally:
        stop(ranks)


def _run(opts: TrainOptions, prepared: Prepared, ranks: Ranks, on_log, on_event) -> TrainSummary:
    import torch

    from gpuwise.optim import param_groups
    from gpuwise.planning.workload import simulate
    from gpuwise.precision import PRECISIONS
    from gpuwise.training.distributed import agree_min
    from gpuwise.training.trainer import Runtime, Trainer

    target, config = prepared.target, prepared.config
    name, world = target.name, ranks.world_size
    say = (lambda text: on_event(text)) if on_event and ranks.main else (lambda text: None)
    if config.sharding == "fsdp" and world == 1:
        say("--sharding fsdp with one process shards nothing: training unsharded (run it under torchrun)")
    task = _task(opts, config.batch, config.seed, target.gpu)
    auto_reason = None
    if opts.auto:
        import psutil

        from gpuwise.training.auto import choose

        free = torch.cuda.mem_get_info(torch.device(name))[0] if target.gpu else psutil.virtual_memory().available
        try:
            choice = choose(task.source, config.to_setup(gpus=world, seq=task.seq), free_bytes=free, gpu=target.gpu)
        except GpuwiseError as exc:
            auto_reason = f"the planner could not capture the model ({exc.message}): the whole batch at once"
        else:
            asked = config.micro_batch
            micro = asked or agree_min(ranks, choice.micro_batch, torch.device(name))  # one choice for all
            config = replace(config, micro_batch=micro)
            auto_reason = (f"{config.precision} ({_precision_reason(opts, target)}); {choice.reason}"
                           + (f" (--micro-batch {asked} as asked)" if asked else ""))
        say(f"auto: {auto_reason}")

    torch.manual_seed(config.seed)
    with torch.device(name):
        model = task.build()
    spec = PRECISIONS[config.precision]
    if spec.weight_dtype != torch.float32:  # pure bf16: the weights themselves are 16-bit
        model = model.to(spec.weight_dtype)
    fused = target.gpu if opts.fused is None else opts.fused
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95),
                                  **({"fused": True} if fused else {"foreach": True}))
    one = replace(config.to_setup(gpus=world, seq=task.seq), gpus=1, sharding="ddp")  # one process's step
    try:
        flops = simulate(task.source, one, batch_model=False).flops_per_step  # per process, as the peak is
    except GpuwiseError:
        flops = None

    def predicted_peak(m: int) -> float:
        w = simulate(task.source, replace(one, micro_batch=m, grad_accum=one.micro_batch * one.grad_accum // m),
                     batch_model=False)
        return float(w.timeline.live(m).sum(axis=1).max())

    runtime = Runtime(device=target, ranks=ranks, checkpoint_dir=opts.checkpoint_dir, flops_per_step=flops,
                      predicted_peak=predicted_peak, on_log=on_log, on_event=on_event)
    trainer = Trainer(model, optimizer, task.data, config, loss_fn=task.loss_fn, eval_data=task.eval_data,
                      runtime=runtime)
    result = trainer.fit(resume=opts.resume)
    later = [log for log in result.logs if log.step > (result.resumed_from or 0) + 1] or list(result.logs)
    peaks = [log.peak_memory_bytes for log in result.logs if log.peak_memory_bytes is not None]
    return TrainSummary(
        task=task.name, steps=result.steps, final_loss=result.final_loss, eval_loss=result.eval_loss,
        seconds=result.seconds, resumed_from=result.resumed_from, skipped_steps=result.skipped_steps, device=name,
        gpu=target.row.key if target.row is not None else None, processes=world,
        sharding=config.sharding if world > 1 else None, precision=config.precision,
        params=sum(p.numel() for p in model.parameters()), micro_batch=result.micro_batch,
        grad_accum=result.grad_accum, batch=config.batch, unit=task.unit,
        throughput=_median([log.tokens_per_s for log in later]),
        mfu=_median([log.mfu for log in later if log.mfu is not None]),
        peak_memory_bytes=max(peaks) if peaks else None, compiled=config.compile,
        optimizer=f"AdamW ({'fused' if fused else 'foreach'})", auto=auto_reason, events=result.events,
        checkpoint_dir=opts.checkpoint_dir)
