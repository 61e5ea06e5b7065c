"""``gpuwise train``."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from gpuwise.cli._app import JsonFlag, app


@app.command()
def train(
    task: Annotated[str, typer.Option(help="text: a character GPT on Python's own docs; image: a small CNN on "
                                           "synthetic images (ignored with --model).")] = "text",
    model: Annotated[str | None, typer.Option(help="Your model: file.py:function, function(batch) returns "
                                                   "(model, inputs) as for gpuwise plan.")] = None,
    data: Annotated[str | None, typer.Option(help="Your data: file.py:function returning a Dataset of (input, "
                                                  "target) items, or (train, val) Datasets. Needs --model.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps [200].")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch (sequences or samples per step) [32].")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Per forward, per process (the rest is accumulated) "
                                                         "[--auto's choice].")] = None,
    seq: Annotated[int | None, typer.Option(help="--task text: characters per sequence [128].")] = None,
    image_size: Annotated[int | None, typer.Option(help="--task image: pixels per side [32].")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate [3e-3].")] = None,
    precision: Annotated[str | None, typer.Option(
        help="fp32, tf32, bf16-mixed, fp16-mixed or bf16 [bf16-mixed on GPUs that have it, fp16-mixed on those "
             "that do not, fp32 on CPUs].")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the weights and of the batches [1337].")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N [the GPU if any].")] = None,
    compile_model: Annotated[bool, typer.Option("--compile", help="torch.compile the model.")] = False,
    checkpointing: Annotated[bool, typer.Option("--checkpointing", help="Recompute each block in backward "
                                                                        "(activation checkpointing).")] = False,
    sharding: Annotated[str | None, typer.Option(help="Under torchrun: ddp (replicate) or fsdp (FSDP2, sharded "
                                                      "checkpoints) [ddp].")] = None,
    fused: Annotated[bool | None, typer.Option("--fused/--foreach", help="AdamW kernel [fused on GPUs].")] = None,
    workers: Annotated[int | None, typer.Option(help="DataLoader workers for --data [4 on GPUs, 0 on CPUs].")
                       ] = None,
    eval_every: Annotated[int | None, typer.Option(help="Evaluate on held-out data every N steps [at the end]."
                                                   )] = None,
    log_every: Annotated[int | None, typer.Option(help="Steps between log lines [10].")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option(help="Folder for checkpoints (safetensors, manifest).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Steps between checkpoints (and at the end).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest good checkpoint.")] = False,
    log: Annotated[str | None, typer.Option(
        "--log", "--log-file", help="Append one JSON object per log step to this file (under torchrun write "
        "--log-file: torchrun's own parser takes --log for its --log-dir).")] = None,
    auto: Annotated[bool, typer.Option("--auto/--no-auto", help="Let the planner pick the precision and the "
                                                                "micro-batch that fits the free memory.")] = True,
    json_out: JsonFlag = False,
) -> None:
    """Train with AMP, accumulation, clipping, checkpoints and exact resume; settings from the plan.

    With no arguments: a small character-level GPT on the English text that ships with Python (no download).
    Under torchrun: DDP (or --sharding fsdp) over NCCL on GPUs, gloo on CPUs.

    Examples: gpuwise train; gpuwise train --task image; gpuwise train --steps 500 --checkpoint-dir runs/char;
    gpuwise train --checkpoint-dir runs/char --resume --steps 1000; gpuwise train --model m.py:build --data
    m.py:dataset; torchrun --nproc_per_node 2 -m gpuwise train --sharding fsdp
    """
    import json as _json

    from gpuwise import render
    from gpuwise.training.config import TrainConfig
    from gpuwise.training.distributed import Ranks
    from gpuwise.training.run import TrainOptions, run_training

    given = {"steps": steps, "batch": batch, "micro_batch": micro_batch, "lr": lr, "precision": precision,
             "seed": seed, "checkpoint_every": checkpoint_every, "eval_every": eval_every, "log_every": log_every,
             "sharding": sharding, "compile": compile_model or None, "checkpointing": checkpointing or None}
    options = TrainOptions(task=task, model=model, data=data, seq=seq, image_size=image_size, device=device,
                           auto=auto, fused=fused, workers=workers, checkpoint_dir=checkpoint_dir, resume=resume,
                           config={k: v for k, v in given.items() if v is not None})
    from gpuwise.files import open_log

    sink = open_log(log) if log else None
    console = Console(stderr=True, highlight=False)
    progress = render.TrainProgress(console, live=sys.stderr.isatty() and not json_out,
                                    total=options.config.get("steps") or TrainConfig().steps)

    def on_log(entry) -> None:
        if sink:
            sink.write(_json.dumps(render.to_jsonable(entry)) + "\n")
            sink.flush()
        if not json_out:
            progress.log(entry)

    def on_event(text: str) -> None:
        if not json_out:
            progress.note(text)

    try:
        summary = run_training(options, on_log=on_log, on_event=on_event)
    finally:
        progress.stop()
        if sink:
            sink.close()
    if not Ranks.from_environ(os.environ).main:  # under torchrun, one process reports
        return
    render.emit(summary, json=json_out)
