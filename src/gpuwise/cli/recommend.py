"""``gpuwise recommend``."""

from __future__ import annotations

import os
import re
from typing import Annotated

import typer

from gpuwise.cli._app import JsonFlag, app, check_png
from gpuwise.errors import GpuwiseError

_UNITS = {"s": 1, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """ "36h", "3d", "90min", "2w" or plain seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(s|min|h|d|w)?\s*", text.lower())
    if not m:
        raise GpuwiseError(f"--deadline {text!r} is not a duration", "pass e.g. --deadline 36h, 3d or 90min")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _list(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()


@app.command()
def recommend(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A built-in model (gpuwise plan --list-models) or path/to/file.py:function.")] = None,
    hf_config: Annotated[str | None, typer.Option(help="A Hugging Face config.json (needs gpuwise[hf]).")] = None,
    task: Annotated[str | None, typer.Option(help="train or finetune-lora.")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch: samples per optimizer step over every GPU, kept "
                                                   "on every row [64].")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (language models).")] = None,
    image_size: Annotated[int | None, typer.Option(help="Pixels per side (image models).")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16-mixed, fp16-mixed or bf16 (pure) "
                                                       "[each GPU's default: bf16 autocast if it has bf16].")] = None,
    checkpointing: Annotated[str | None, typer.Option(help="none or full [whichever is faster and fits].")] = None,
    sharding: Annotated[str | None, typer.Option(help="ddp, zero1, zero2 or fsdp [ddp or fsdp, the faster that "
                                                      "fits].")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA rank for --task finetune-lora.")] = None,
    tokens: Annotated[float | None, typer.Option(help="The goal: tokens to train on, e.g. 1e9.")] = None,
    samples: Annotated[float | None, typer.Option(help="The goal in samples (images, sequences).")] = None,
    epochs: Annotated[float | None, typer.Option(help="The goal in epochs of --dataset-size samples.")] = None,
    dataset_size: Annotated[int | None, typer.Option(help="Samples in one epoch (with --epochs).")] = None,
    budget: Annotated[float | None, typer.Option(help="USD: for the job with --rent, for the GPUs with --buy.")] = None,
    buy: Annotated[bool, typer.Option("--buy/--rent", help="Cost by purchase price instead of rent.")] = False,
    deadline: Annotated[str | None, typer.Option(help="Longest time to the goal, e.g. 36h, 3d.")] = None,
    max_gpus: Annotated[int | None, typer.Option(help="The most GPUs to use.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Only these catalog GPUs, comma-separated.")] = None,
    segment: Annotated[str | None, typer.Option(help="Only consumer, workstation, datacenter or edge.")] = None,
    vendor: Annotated[str | None, typer.Option(help="Only these vendors, comma-separated.")] = None,
    ecosystem: Annotated[str | None, typer.Option(help="Only GPUs PyTorch runs on with this stack, e.g. cuda "
                                                       "(leaves out chips that need a port).")] = None,
    prices: Annotated[str | None, typer.Option(help="A CSV of your own quotes: gpu,rent_usd_per_hour,buy_usd"
                                                    "[,date]; they replace the catalog's.")] = None,
    sort: Annotated[str, typer.Option(help="time, cost or energy.")] = "time",
    plot: Annotated[str | None, typer.Option(help="Draw time to goal against cost, with the Pareto front, "
                                                  "to this PNG file.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Rank every catalog GPU and GPU count for your training run: speed, time to goal, cost, energy.

    Examples: gpuwise recommend --model gpt2 --tokens 1e9; gpuwise recommend --model llama3-8b --seq 8192
    --batch 512 --tokens 1e12 --max-gpus 64; gpuwise recommend --model llama2-7b --task finetune-lora
    --tokens 5e7 --segment consumer --buy --budget 3000
    """
    from gpuwise import render

    check_png(plot)
    if sort not in ("time", "cost", "energy"):
        raise GpuwiseError(f"--sort {sort!r} is not one of time, cost, energy", "pass --sort cost")
    if (epochs is None) != (dataset_size is None):
        raise GpuwiseError("--epochs and --dataset-size go together", "pass both, e.g. --epochs 3 "
                           "--dataset-size 50000")
    if epochs is not None:
        if samples is not None or tokens is not None:
            raise GpuwiseError("--epochs sets the goal, and so do --tokens and --samples", "give one goal")
        samples = epochs * dataset_size
    from gpuwise.hardware.calibration import cache_dir, load_calibrations
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning import Setup
    from gpuwise.planning.recommend import Constraints, Goal, read_prices
    from gpuwise.planning.recommend import recommend as rank
    from gpuwise.planning.source import resolve_source

    catalog = load_catalog()
    rent, bought = read_prices(prices, catalog) if prices else ({}, {})
    constraints = Constraints(
        mode="buy" if buy else "rent", budget_usd=budget,
        deadline_s=None if deadline is None else parse_duration(deadline), max_gpus=max_gpus,
        gpus=tuple(catalog.get(g).key for g in _list(gpu)), segments=_list(segment), vendors=_list(vendor),
        ecosystem=ecosystem, rent=rent, buy=bought)
    goal = Goal(tokens=tokens, samples=samples)
    given = {"task": task, "seq": seq, "image_size": image_size, "checkpointing": checkpointing,
             "sharding": sharding, "lora_rank": lora_rank, "precision": precision}
    setup = Setup.for_batch(batch=batch or 64, micro_batch=batch or 64,
                            **{k: v for k, v in given.items() if v is not None and k != "sharding"})
    result = rank(resolve_source(model, hf_config), setup, goal, constraints, precision=precision,
                  sharding=sharding, checkpointing_given=checkpointing is not None, sort=sort,  # type: ignore[arg-type]
                  catalog=catalog, calibrations=load_calibrations(cache_dir(os.environ)))
    render.emit(result, json=json_out)
    if plot is not None:
        from gpuwise.plot import plot_recommend

        plot_recommend(result, plot)
        if not json_out:
            print(f"time against cost drawn to {plot}")
