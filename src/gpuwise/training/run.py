"""``gpuwise train`` as a function: resolve the device, build the task, let the planner choose the micro-batch,
train, summarise.

>>> # summary = run_training(TrainOptions(config=TrainConfig(steps=60))); print(summary.final_loss)
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwise.errors import GpuwiseError
from gpuwise.training.config import IMAGE_SIZE, TEXT_SEQ, TrainConfig, TrainOptions, plan_only
from gpuwise.training.distributed import Ranks

if TYPE_CHECKING:
    from gpuwise.hardware.detect import LocalMachine
    from gpuwise.hardware.device import Target
    from gpuwise.monitor.verdict import Context, Diagnosis
    from gpuwise.training.runplan import RunPlan
    from gpuwise.training.trainer import StepLog

__all__ = ["InputFix", "TrainOptions", "TrainSummary", "fix_input", "prepare", "run_training"]


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
    throughput: float | None  # over the wall clock: the items of the steps after the first logged one, over the
    # time they took with everything between them (logging, evaluation, checkpoint saves); meter.wall_throughput
    mfu: float | None
    peak_memory_bytes: int | None
    compiled: bool
    optimizer: str
    auto: str | None  # what --auto chose and why
    events: tuple[str, ...]
    checkpoint_dir: str | None
    diagnosis: Diagnosis | None = None  # the monitor's: the bottleneck, its evidence and the fix
    step_s: float | None = None  # median wall time of a step after the first (the monitor's timings)
    data_wait: float | None = None  # median share of a step spent waiting for its batch, after the first
    input_fix: InputFix | None = None  # --fix-input: the loader change, measured before and after


@dataclass(frozen=True, kw_only=True)
class InputFix:
    """``--fix-input``: the loader settings the diagnosis suggested, run for ``steps`` steps, against the run."""

    changed: dict[str, tuple]  # setting -> (before, after), e.g. {"workers": (0, 3)}
    steps: int
    before_step_s: float | None
    after_step_s: float | None
    before_data_wait: float | None
    after_data_wait: float | None
    speedup: float | None  # before / after step time
    note: str | None = None  # why nothing was re-run, where nothing was


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


def _task(opts: TrainOptions, batch: int, seed: int, gpus_here: int, say=None):
    from gpuwise.training import tasks

    if opts.config.loss != "standard" and (opts.model or opts.hf_config is not None or opts.example != "text"):
        raise plan_only(f"--loss {opts.config.loss} runs in gpuwise train for --example text (the built-in GPT); "
                        "your model computes its own loss", "drop --loss, or see the plan with gpuwise plan")
    if opts.model or opts.hf_config is not None:
        from gpuwise.environment import suggested_workers, usable_cores

        workers = opts.workers if opts.workers is not None else suggested_workers(usable_cores(), gpus_here)
    if opts.hf_config is not None:
        if opts.image_size is not None:
            raise GpuwiseError("--image-size applies to --example image", "drop --image-size (an image model of "
                               "--hf-config takes the image size of its config)")
        return tasks.hf_task(opts.hf_config, opts.data, opts.seq, batch, seed, workers, say=say,
                             data_timeout=opts.data_timeout)
    if opts.model:
        if opts.seq is not None or opts.image_size is not None:
            raise GpuwiseError("--seq and --image-size do not apply to --model", "size the data in your functions")
        return tasks.file_task(opts.model, opts.data, batch, seed, workers, say=say, data_timeout=opts.data_timeout)
    if opts.example == "text":
        if opts.image_size is not None:
            raise GpuwiseError("--image-size applies to --example image",
                               "drop --image-size, or pass --example image")
        return tasks.text_task(opts.seq or TEXT_SEQ, seed, loss=opts.config.loss)
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
                 machine: LocalMachine | None = None, on_resume: Callable[[int], None] | None = None
                 ) -> TrainSummary:
    """Train as ``gpuwise train`` does; ``on_event`` hears the choices made (auto settings, OOM retries),
    ``on_resume`` the step a resumed run continues from. ``machine`` (default: this one, probed) is where
    ``--device`` is looked up."""
    import torch

    from gpuwise.hardware.device import local_machine
    from gpuwise.precision import PRECISIONS, tf32_matmuls
    from gpuwise.training.distributed import start, stop
    from gpuwise.training.interrupt import Interrupted

    environ = os.environ if environ is None else environ
    ranks = Ranks.from_environ(environ)  # set by torchrun
    prepared = prepare(opts, ranks, machine or local_machine(environ))
    start(ranks, torch.device(prepared.target.name))
    finished = False
    try:
        with tf32_matmuls(PRECISIONS[prepared.config.precision].tf32):  # a process setting: the run's, not the loop's
            summary = _run(opts, prepared, ranks, on_log, on_event, on_resume)
        finished = True
        return summary
    except Interrupted as stopped:  # Ctrl-C: every process stopped after the same step, and saved it together
        finished = not stopped.forced
        raise
    finally:
        stop(ranks, clean=finished)


def _run(opts: TrainOptions, prepared: Prepared, ranks: Ranks, on_log, on_event, on_resume=None) -> TrainSummary:
    import torch

    from gpuwise.optim import param_groups
    from gpuwise.precision import PRECISIONS
    from gpuwise.training.meter import wall_throughput
    from gpuwise.training.runplan import plan_run
    from gpuwise.training.trainer import Runtime, Trainer

    target, config = prepared.target, prepared.config
    name, world = target.name, ranks.world_size
    say = (lambda text: on_event(text)) if on_event and ranks.main else (lambda text: None)
    if config.sharding == "fsdp" and world == 1:
        say("--sharding fsdp with one process shards nothing: training unsharded (run it under torchrun)")
    task = _task(opts, config.batch, config.seed, ranks.local_world_size if target.gpu else 0, say=say)
    free = None
    if opts.auto:
        import psutil

        free = torch.cuda.mem_get_info(torch.device(name))[0] if target.gpu else psutil.virtual_memory().available
    plan = plan_run(task.source, config, target, ranks=ranks, seq=task.seq, free_bytes=free,
                    why=_precision_reason(opts, target))  # the one planner session of the run
    if plan.micro_batch is not None:
        config = replace(config, micro_batch=plan.micro_batch)
    if plan.auto is not None:
        say(f"auto: {plan.auto}")

    torch.manual_seed(config.seed)
    with torch.device(name):
        model = task.build()
    if not any(p.requires_grad for p in model.parameters()):
        raise GpuwiseError(f"{opts.model or task.name}: the model has no trainable parameters",
                           "return a model with parameters (requires_grad) from the --model function")
    spec = PRECISIONS[config.precision]
    if spec.weight_dtype != torch.float32:  # pure bf16: the weights themselves are 16-bit
        model = model.to(spec.weight_dtype)
    fused = target.gpu if opts.fused is None else opts.fused
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95),
                                  **({"fused": True} if fused else {"foreach": True}))
    monitor = None
    if opts.monitor:
        from gpuwise.monitor.sampler import Monitor

        monitor = Monitor(device=name, gpus=target.gpu)  # every rank: DDP's timing hook must be on all of them
    runtime = Runtime(device=target, ranks=ranks, checkpoint_dir=opts.checkpoint_dir, plan=plan, on_log=on_log,
                      on_event=on_event, monitor=monitor, on_resume=on_resume, run=saved_settings(opts, config),
                      data_timeout=opts.data_timeout)
    if config.compile:
        say("compiling the model (torch.compile): the first steps are slow; compiled kernels may round differently "
            "from eager ones, so a resume matches the run bit for bit in eager mode only")
    trainer = Trainer(model, optimizer, task.data, config, loss_fn=task.loss_fn, eval_data=task.eval_data,
                      runtime=runtime)
    if monitor is not None:
        monitor.start()
    try:
        result = trainer.fit(resume=opts.resume)
    finally:
        if monitor is not None:
            monitor.stop()
    diagnosis = step_s = data_wait = None
    if monitor is not None and ranks.main:
        diagnosis = monitor.diagnose(_context(task, target, config, world, plan, trainer.micro_batch,
                                              grad_accum=result.grad_accum))
        timed = monitor.record().steps[1:] or monitor.record().steps  # the first step warms up
        step_s = _median([e.seconds for e in timed])
        data_wait = _median([e.data_wait_s / e.seconds for e in timed if e.seconds > 0])
    later = [log for log in result.logs if log.step > (result.resumed_from or 0) + 1] or list(result.logs)
    peaks = [log.peak_memory_bytes for log in result.logs if log.peak_memory_bytes is not None]
    return TrainSummary(
        task=task.name, steps=result.steps, final_loss=result.final_loss, eval_loss=result.eval_loss,
        seconds=result.seconds, resumed_from=result.resumed_from, skipped_steps=result.skipped_steps, device=name,
        gpu=target.row.key if target.row is not None else None, processes=world,
        sharding=config.sharding if world > 1 else None, precision=config.precision,
        params=sum(p.numel() for p in model.parameters()), micro_batch=result.micro_batch,
        grad_accum=result.grad_accum, batch=config.batch, unit=task.unit,
        throughput=wall_throughput(result.logs) or _median([log.tokens_per_s for log in later]),
        mfu=_median([log.mfu for log in later if log.mfu is not None]),
        peak_memory_bytes=max(peaks) if peaks else None, compiled=config.compile,
        optimizer=f"AdamW ({'fused' if fused else 'foreach'})", auto=plan.auto, events=result.events,
        checkpoint_dir=opts.checkpoint_dir, diagnosis=diagnosis, step_s=step_s, data_wait=data_wait)


def oom_advice_for(source, setup, gpu: str, *, remedies: int = 3) -> str | None:
    """What the plan says of ``setup`` on the catalog GPU ``gpu`` at an OOM: its peak by category and the first
    ``remedies`` remedies in order, each as the flags to add (``RunPlan.oom_advice``)."""
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning.planner import Planner
    from gpuwise.training.runplan import planned

    return planned(Planner(source), setup, load_catalog().get(gpu)).oom_advice(setup.micro_batch, count=remedies)


FIX_STEPS = 20  # steps --fix-input re-runs with the suggested loader


def suggested_loader(diagnosis: Diagnosis | None) -> dict[str, object]:
    """The loader settings an input-bound diagnosis suggests ({} when it is not input-bound)."""
    if diagnosis is None:
        return {}
    finding = next((f for f in diagnosis.findings if f.bottleneck == "input-bound"), None)
    return dict(getattr(finding, "change", None) or {}) if finding is not None else {}


def fix_input(opts: TrainOptions, summary: TrainSummary, *, steps: int = FIX_STEPS, on_log=None, on_event=None,
              environ: Mapping[str, str] | None = None, machine: LocalMachine | None = None) -> InputFix:
    """Re-run ``steps`` steps of ``opts`` with the loader the run's diagnosis suggests, and measure both.
    Only ``--data`` loads through a DataLoader; the built-in examples make their batches in memory."""
    change = suggested_loader(summary.diagnosis)
    nothing = InputFix(changed={}, steps=0, before_step_s=summary.step_s, after_step_s=None,
                       before_data_wait=summary.data_wait, after_data_wait=None, speedup=None)
    if summary.diagnosis is None:
        return replace(nothing, note="the run was not monitored (--no-monitor): nothing to compare")
    finding = next((f for f in summary.diagnosis.findings if f.bottleneck == "input-bound"), None)
    wait = "" if summary.data_wait is None else f" (data wait {100 * summary.data_wait:.0f}% of a step)"
    if finding is None:
        return replace(nothing, note=f"the run is {summary.diagnosis.bottleneck}, not input-bound{wait}: "
                                     "no loader change to try")
    if "num_workers" not in change:
        return replace(nothing, note=f"the run is input-bound{wait}, but more workers would not help: "
                                     f"{finding.fix[0] if finding.fix else 'a faster dataset'}")
    if not opts.data:
        return replace(nothing, note="the built-in example makes its batches in memory, with no DataLoader to "
                                     "change: --fix-input applies to --data")
    before = int(finding.evidence.get("num_workers_now", opts.workers or 0))  # what the run had, default or given
    workers = int(change.get("num_workers", before))
    rerun = replace(opts, workers=workers, checkpoint_dir=None, resume=False, auto=False,
                    config=replace(opts.config, steps=min(steps, opts.config.steps), micro_batch=summary.micro_batch,
                                   precision=summary.precision, checkpoint_every=0, eval_every=0))
    with warnings.catch_warnings():
        # loading that waits (a disk, a sleep) is given more workers than cores on purpose (the diagnosis says why);
        # torch's generic "suggested max number of worker" warning would contradict it
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        after = run_training(rerun, on_log=on_log, on_event=on_event, environ=environ, machine=machine)
    return InputFix(changed={"workers": (before, workers)}, steps=after.steps, before_step_s=summary.step_s,
                    after_step_s=after.step_s, before_data_wait=summary.data_wait, after_data_wait=after.data_wait,
                    speedup=summary.step_s / after.step_s if summary.step_s and after.step_s else None)


def _context(task, target: Target, config, world: int, plan: RunPlan, micro: int, *,
             grad_accum: int | None = None) -> Context:
    """What the diagnosis knows of this run: the machine, how its data loads, the micro-batches a step already
    accumulates (``grad_accum``: a fix never proposes them again), and (on a catalog GPU) the run's plan: the
    roofline, the predicted step time and peak memory, the kernels a step launches, the remedies. After an OOM
    retry (``micro`` is not the plan's) they are the step's at the micro-batch it fell back to."""
    from dataclasses import replace as _replace

    import torch

    from gpuwise.environment import usable_cores
    from gpuwise.monitor.verdict import Context, Loader
    from gpuwise.training.meter import mfu_peak_tflops

    loader = getattr(task.data, "loader_settings", None)
    loader = loader(pin=target.backend == "cuda") if loader is not None else Loader(num_workers=0)
    ctx = Context(device=target.backend, usable_cores=usable_cores(), world_size=world, loader=loader,
                  memory_total_bytes=target.memory_total_bytes, grad_accum=grad_accum,
                  threads=torch.get_num_threads())
    row = target.row
    if not target.gpu or row is None or plan.gpu is None:  # off the catalog, or the model was not captured
        return ctx
    ran = plan.at(micro)  # the plan's own step, or the one an OOM retry fell back to
    return _replace(ctx, remedies=tuple(f"{r.name}: add {r.flags}" if r.flags else r.name for r in ran.remedies),
                    peak_tflops=mfu_peak_tflops(target, config.precision), bandwidth_gbps=row.memory_bandwidth_gbps,
                    planned_step_s=ran.step_s, planned_peak_bytes=plan.peak_bytes(micro),
                    planned_bytes_per_step=ran.bytes_per_step, kernels_per_step=ran.kernels_per_step)


# Settings a checkpoint keeps so ``--resume`` need not repeat them: those that change what is trained (a
# different value is a conflict) and those that only say how long and how often (the new value wins).
FIXED = ("example", "model", "hf_config", "data", "seq", "image_size", "batch", "lr", "seed", "precision",
         "sharding")
CARRIED = ("steps", "checkpoint_every", "log_every", "eval_every", "checkpointing", "compile", "loss", "workers",
           "warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio", "sync_batchnorm")
OPTION_FIELDS = ("example", "model", "hf_config", "data", "seq", "image_size", "workers")


PATH_FIELDS = ("model", "data", "hf_config")  # settings that name a file of the user's: kept absolute, with its hash


def _local_file(spec: object) -> Path | None:
    """The file a ``--model``/``--data`` (``file.py:function``) or ``--hf-config`` (a path) setting names, where it
    exists on this machine; None for a Hub id or a built-in name."""
    if not isinstance(spec, str) or not spec:
        return None
    head, sep, _ = spec.rpartition(":")
    path = Path(head if sep and head.endswith(".py") else spec)
    return path if path.is_file() else None


def _absolute(spec: object) -> object:
    """A setting with its file made absolute (``examples/x.py:build`` -> ``/home/me/examples/x.py:build``)."""
    path = _local_file(spec)
    if path is None:
        return spec
    head, sep, tail = str(spec).rpartition(":")
    return f"{path.resolve()}:{tail}" if sep and head.endswith(".py") else str(path.resolve())


def saved_settings(opts: TrainOptions, config: TrainConfig) -> dict[str, object]:
    """What a checkpoint of this run records of its settings (plain JSON values). A file of the user's (--model,
    --data, --hf-config) is kept by its absolute path, and its SHA-256 beside it (``files``): a resume from another
    folder finds the same file, and a changed one is refused."""
    settings = {name: getattr(opts if name in OPTION_FIELDS else config, name) for name in (*FIXED, *CARRIED)}
    from gpuwise.training.checkpoint import _sha256

    files = {}
    for name in PATH_FIELDS:
        settings[name] = _absolute(settings[name])
        path = _local_file(settings[name])
        if path is not None:
            files[str(path)] = _sha256(path)
    settings["files"] = files  # hashed as the checkpoint manifest hashes its own files
    builtin = None if opts.model or opts.hf_config is not None else opts.example  # the built-in examples' sizes
    settings["seq"] = opts.seq if opts.seq is not None else TEXT_SEQ if builtin == "text" else None
    settings["image_size"] = opts.image_size if opts.image_size is not None else IMAGE_SIZE \
        if builtin == "image" else None
    return settings


def _check_files(saved: dict, folder: object) -> None:
    """The user's files the checkpoint was trained with are still there and unchanged (by SHA-256)."""
    from gpuwise.training.checkpoint import _sha256
    for path, digest in (saved.get("files") or {}).items():
        p = Path(path)
        if not p.is_file():
            raise GpuwiseError(f"{path}, which the checkpoint in {folder} was trained with, is gone",
                               "put it back, or start afresh with another --checkpoint-dir")
        if _sha256(p) != digest:
            raise GpuwiseError(f"{path} changed since the checkpoint in {folder} was written: resuming would train "
                               "another model or data", "restore the file, or start afresh with another "
                               "--checkpoint-dir")


def _flag(name: str, value: object) -> str:
    return f"--{name.replace('_', '-')} {value}"


def resume_options(opts: TrainOptions, given: set[str]) -> tuple[TrainOptions, list[str]]:
    """``opts`` with the settings of the run in ``--checkpoint-dir`` wherever ``given`` (the flags typed) does not
    name them; a typed flag that changes what is trained is refused, naming both values. Returns the notes of
    what was taken from the checkpoint."""
    from gpuwise.training.checkpoint import saved_run

    saved = saved_run(opts.checkpoint_dir) if opts.resume and opts.checkpoint_dir else None
    if not saved:
        return opts, []
    mine = saved_settings(opts, opts.config)
    for name in FIXED:
        if name in given and name in saved and saved[name] is not None and mine[name] != saved[name]:
            raise GpuwiseError(f"{_flag(name, mine[name])} here, {saved[name]} in the checkpoint "
                               f"({opts.checkpoint_dir})", f"drop {_flag(name, '').strip()} to resume with the "
                               "checkpoint's value, or start afresh with another --checkpoint-dir")
    taken = {name: saved[name] for name in (*FIXED, *CARRIED)
             if name in saved and name not in given and saved[name] != mine[name]}
    if ("model" in taken or "hf_config" in taken) and "example" not in taken:  # the example flag does not apply
        taken.pop("example", None)
    _check_files(saved, opts.checkpoint_dir)
    option_part = {k: v for k, v in taken.items() if k in OPTION_FIELDS}
    config_part = {k: v for k, v in taken.items() if k not in OPTION_FIELDS}
    try:
        config = replace(opts.config, **config_part)
        resumed = replace(opts, config=config, **option_part)
    except (TypeError, GpuwiseError) as exc:
        raise GpuwiseError(f"the settings in {opts.checkpoint_dir} do not apply here ({exc})",
                           "pass the run's flags again with --resume") from None
    notes = [f"resuming with the checkpoint's {', '.join(_flag(k, v) for k, v in taken.items())}"] if taken else []
    return resumed, notes
