"""``gpuwise train``: the flags of the shared vocabulary (``--batch``, ``--micro-batch``, ``--precision``,
``--checkpointing``, ``--gpus``, ``--sharding``, ``--task``, ``--lora-rank``, ``--qlora``, ``--optimizer``,
``--optimizer-in-backward``, ``--seq``, ``--image-size``, ``--device``), so a remedy ``gpuwise plan`` prints runs
here as printed (or is refused in one "plan only:" line)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from typing import Annotated

import typer

from gpuwise.cli._app import CompileFlag, DeviceOption, JsonFlag, app
from gpuwise.training import waiting
from gpuwise.training.config import HF_SEQ, IMAGE_SIZE, TEXT_SEQ, TrainConfig, TrainOptions


def _default(cls: type, name: str) -> str:
    """``[value]``: a field's default for --help, read from the dataclass that owns it."""
    return f"[{next(f.default for f in dataclasses.fields(cls) if f.name == name)}]"


@app.command()
def train(
    example: Annotated[str | None, typer.Option(
        help="The built-in example: text (a character GPT on Python's own docs) or image (a small CNN on synthetic "
             f"images); not with --model or --hf-config {_default(TrainOptions, 'example')}.")] = None,
    model: Annotated[str | None, typer.Option(help="Your model: file.py:function, function(batch) returns "
                                                   "(model, inputs) as for gpuwise plan.")] = None,
    hf_config: Annotated[str | None, typer.Option(
        help="A Hugging Face model: its config.json, a folder holding one, or a Hub id owner/name (read from the "
             "Hugging Face cache first); transformers builds it with random weights, as gpuwise plan --hf-config "
             "plans it. Without --data it learns one batch of random tokens by heart.")] = None,
    data: Annotated[str | None, typer.Option(help="Your data: file.py:function returning a Dataset of (input, "
                                                  "target) items, or (train, val) Datasets. Needs --model or "
                                                  "--hf-config.")] = None,
    steps: Annotated[int | None, typer.Option(help=f"Optimizer steps {_default(TrainConfig, 'steps')}.")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch: samples (or sequences) per optimizer step over "
                                                   f"every GPU {_default(TrainConfig, 'batch')}.")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per GPU per forward; the rest of --batch is "
                                                         "accumulated [--auto's choice].")] = None,
    seq: Annotated[int | None, typer.Option(help=f"--example text: characters per sequence [{TEXT_SEQ}]; "
                                                 f"--hf-config: tokens per sequence [{HF_SEQ}, at most the config's "
                                                 "positions].")] = None,
    image_size: Annotated[int | None, typer.Option(help=f"--example image: pixels per side [{IMAGE_SIZE}].")] = None,
    lr: Annotated[float | None, typer.Option(help=f"Peak learning rate {_default(TrainConfig, 'lr')}.")] = None,
    precision: Annotated[str | None, typer.Option(
        help="fp32, tf32, bf16-mixed, fp16-mixed, bf16, fp8 or fp8-bf16 (torchao float8, GPUs with fp8) "
             "[the device's: bf16-mixed on GPUs that have bf16, "
             "fp16-mixed on those that do not, fp32 on CPUs].")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the weights and of the batches "
                                                  f"{_default(TrainConfig, 'seed')}.")] = None,
    device: DeviceOption = None,
    compile_model: CompileFlag = False,
    checkpointing: Annotated[str | None, typer.Option(
        help="none; full: recompute each block in backward (activation checkpointing); selective: keep what "
             "torchtitan's op policy keeps (every other matmul's output, attention's) "
             f"{_default(TrainConfig, 'checkpointing')}.")] = None,
    n_gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs (processes): must be what torchrun started "
                                                              "[torchrun's count, else 1].")] = None,
    sharding: Annotated[str | None, typer.Option(help="Under torchrun: ddp (replicate) or fsdp (FSDP2, sharded "
                                                      "checkpoints); zero1/zero2 are plan only "
                                                      f"{_default(TrainConfig, 'sharding')}.")] = None,
    task: Annotated[str | None, typer.Option(help="train; finetune-lora and infer are plan only [train].")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw; the planner's others (sgd, adamw8bit, "
                                                       "paged-adamw8bit, adafactor, lion) are plan only [adamw].")
                         ] = None,
    optimizer_in_backward: Annotated[bool, typer.Option("--optimizer-in-backward", help="Plan only.")] = False,
    loss: Annotated[str | None, typer.Option(help="standard, chunked (torchtune's chunked cross-entropy) or fused "
                                                  "(a fused linear + cross-entropy, as Liger runs it): --example "
                                                  "text runs it; plan only for other models [standard].")
                    ] = None,
    lora_rank: Annotated[int | None, typer.Option(help="Plan only (finetune-lora).")] = None,
    qlora: Annotated[bool, typer.Option("--qlora", help="Plan only (finetune-lora).")] = False,
    lora_targets: Annotated[str | None, typer.Option(help="Plan only (finetune-lora).")] = None,
    lora_dropout: Annotated[float | None, typer.Option(help="Plan only (finetune-lora).")] = None,
    qlora_recipe: Annotated[str | None, typer.Option(help="Plan only (finetune-lora).")] = None,
    weights: Annotated[str | None, typer.Option(help="Plan only (--task infer or decode).")] = None,
    context: Annotated[int | None, typer.Option(help="Plan only (--task decode).")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Plan only (tensor parallelism).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Plan only (pipeline parallelism).")] = None,
    cp: Annotated[int | None, typer.Option("--cp", help="Plan only (context parallelism).")] = None,
    ep: Annotated[int | None, typer.Option("--ep", help="Plan only (expert parallelism).")] = None,
    moe_imbalance: Annotated[float | None, typer.Option("--moe-imbalance", help="Plan only (expert parallelism)."
                                                        )] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Plan only (HSDP).")] = None,
    offload: Annotated[str | None, typer.Option("--offload", help="Plan only (CPU offload).")] = None,
    fused: Annotated[bool | None, typer.Option("--fused/--foreach", help="AdamW kernel [fused on GPUs].")] = None,
    workers: Annotated[int | None, typer.Option(
        help="DataLoader workers for --data [doctor's advice: the cores each process gets, less one].")
                       ] = None,
    data_timeout: Annotated[float | None, typer.Option(
        envvar=waiting.ENV, metavar="SECONDS",
        help="Stop with an error when --data's function, or one batch of its Dataset, keeps the run waiting this "
             "long; either way a line says what the run waits for after 30 s [no bound].")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate on held-out data every N steps [at the end]."
                                                   )] = None,
    log_every: Annotated[int | None, typer.Option(help="Steps between log lines "
                                                       f"{_default(TrainConfig, 'log_every')}.")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option(help="Folder for checkpoints (safetensors, manifest).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Steps between checkpoints (and at the end).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest good checkpoint, with the "
                                         "settings it was written with (flags given again must agree).")] = False,
    sync_batchnorm: Annotated[bool, typer.Option("--sync-batchnorm", help="Under torchrun on GPUs: BatchNorm "
                                                 "statistics over every process's micro-batch.")] = False,
    log: Annotated[str | None, typer.Option(
        "--log", "--log-file", help="Append one JSON object per log step to this file (under torchrun write "
        "--log-file: torchrun's own parser takes --log for its --log-dir).")] = None,
    auto: Annotated[bool | None, typer.Option("--auto/--no-auto", help="Let the planner pick the micro-batch that "
                                              f"fits the free memory {_default(TrainOptions, 'auto')}.")] = None,
    monitor: Annotated[bool, typer.Option("--monitor/--no-monitor", help="Sample the run (GPU counters, host, "
                                          "the loop's timings) and name its bottleneck at the end [on].")] = True,
    fix_input: Annotated[bool, typer.Option("--fix-input", help="If the run waits on its data, re-run "
                                            "a few steps with the loader the diagnosis suggests and show both.")
                         ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Train with AMP, accumulation, clipping, checkpoints and exact resume; settings from the plan.

    With no arguments: a small character-level GPT on the English text that ships with Python (no download).
    Under torchrun: DDP (or --sharding fsdp) over NCCL on GPUs, gloo on CPUs. The flags a gpuwise plan remedy
    prints (--batch, --micro-batch, --precision, --checkpointing, --gpus, --sharding) run here as printed.

    Examples: gpuwise train; gpuwise train --example image; gpuwise train --steps 500 --checkpoint-dir runs/char;
    gpuwise train --checkpoint-dir runs/char --resume --steps 1000; gpuwise train --model m.py:build --data
    m.py:dataset; gpuwise train --hf-config Qwen/Qwen3-0.6B --seq 512 --data m.py:tokens;
    torchrun --nproc_per_node 2 -m gpuwise train --gpus 2 --sharding fsdp
    """
    import json as _json

    from gpuwise.errors import GpuwiseError
    from gpuwise.training.config import plan_only

    if hf_config is not None and example is not None:
        raise GpuwiseError(f"--example {example} and --hf-config both name a model", "pass one of them")
    for flag, value in (("--weights", weights), ("--context", context)):
        if value is not None:
            raise plan_only(f"{flag} {value} (inference) is planned by gpuwise plan; gpuwise train trains",
                            f"drop {flag}, or see the plan: gpuwise plan --task decode {flag} {value}")

    for flag, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--ep", ep), ("--moe-imbalance", moe_imbalance),
                        ("--nodes", nodes), ("--offload", offload)):
        if value is not None and value not in (1, "none"):  # the trainer runs DDP and FSDP2 over one group
            value = f"{value:g}" if isinstance(value, float) else value
            raise plan_only(f"{flag} {value} is planned by gpuwise plan; gpuwise train runs data parallelism only",
                            f"drop {flag}, or see the plan: gpuwise plan {flag} {value}")

    given = {"steps": steps, "batch": batch, "micro_batch": micro_batch, "lr": lr, "precision": precision,
             "seed": seed, "checkpoint_every": checkpoint_every, "eval_every": eval_every, "log_every": log_every,
             "sharding": sharding, "compile": compile_model or None, "checkpointing": checkpointing,
             "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward or None}
    given |= {"loss": loss, "sync_batchnorm": sync_batchnorm or None}
    config = TrainConfig(**{k: v for k, v in given.items() if v is not None})
    chosen = {"example": example, "auto": auto, "task": task}
    options = TrainOptions(model=model, hf_config=hf_config, data=data, seq=seq, image_size=image_size,
                           device=device, gpus=n_gpus, fused=fused, workers=workers, checkpoint_dir=checkpoint_dir,
                           resume=resume, lora_rank=lora_rank, qlora=qlora, lora_targets=lora_targets,
                           lora_dropout=lora_dropout, qlora_recipe=qlora_recipe, config=config, monitor=monitor,
                           data_timeout=data_timeout,
                           **{k: v for k, v in chosen.items() if v is not None})
    if fix_input and not monitor:
        raise GpuwiseError("--fix-input needs the monitor's diagnosis", "drop --no-monitor")
    if hf_config is not None:
        from gpuwise.planning.sources.hub import model_files

        model_files(None, hf_config)  # a missing file, or a Hub id neither cached nor reachable
    # The arguments are checked: now torch loads.
    from gpuwise import render
    from gpuwise.files import LogFile
    from gpuwise.training.distributed import Ranks
    from gpuwise.training.interrupt import Interrupted
    from gpuwise.training.run import resume_options, run_training

    typed = {k for k, v in {**given, "example": example, "model": model, "hf_config": hf_config, "data": data,
                            "seq": seq, "image_size": image_size, "workers": workers}.items() if v is not None}
    options, notes = resume_options(options, typed)
    config = options.config
    console = render.terminal(stderr=True)
    progress = render.TrainProgress(console, live=sys.stderr.isatty() and not json_out, total=config.steps)
    log_file = LogFile(log, warn=progress.note) if log else None

    def on_log(entry) -> None:
        if log_file:
            log_file.write(_json.dumps(render.to_jsonable(entry)))
        if not json_out:
            progress.log(entry)

    def on_resume(step: int) -> None:
        if log_file:
            log_file.resumed(step)  # appended, never rewritten: the log may be shared, or hold the user's notes

    def on_event(text: str) -> None:
        if not json_out:
            progress.note(text)

    for text in notes if Ranks.from_environ(os.environ).main else ():
        on_event(text)
    try:
        summary = run_training(options, on_log=on_log, on_event=on_event, on_resume=on_resume)
        ranks = Ranks.from_environ(os.environ)
        if fix_input and ranks.world_size > 1:
            if ranks.main:
                on_event("--fix-input runs one process: under torchrun it is skipped (run it without torchrun)")
        elif fix_input:
            from gpuwise.training.run import FIX_STEPS, suggested_loader
            from gpuwise.training.run import fix_input as rerun_input

            if "num_workers" in suggested_loader(summary.diagnosis):
                on_event(f"--fix-input: re-running {FIX_STEPS} steps with the loader the diagnosis suggests")
            summary = dataclasses.replace(summary, input_fix=rerun_input(options, summary, on_event=on_event))
    except Interrupted as stop:
        progress.stop()
        where = (f"saved {stop.saved.name}; continue with --resume" if stop.saved is not None else
                 "no checkpoint (pass --checkpoint-dir to keep a run)")
        why = "" if stop.signum == signal.SIGINT else f" ({stop.signal_name})"
        if Ranks.from_environ(os.environ).main:  # under torchrun every process stops; one says so
            console.print(f"stopped at step {stop.step}{why}; {where}", markup=False, soft_wrap=True)
        raise typer.Exit(128 + stop.signum) from None  # 130 for Ctrl-C, 143 SIGTERM, 129 SIGHUP: as a shell says
    finally:
        progress.stop()
        if log_file:
            log_file.close()
    if not Ranks.from_environ(os.environ).main:  # under torchrun, one process reports
        return
    render.emit(summary, json=json_out)
