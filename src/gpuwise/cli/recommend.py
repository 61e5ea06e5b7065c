"""``gpuwise recommend``."""

from __future__ import annotations

import math
import os
import re
from typing import Annotated

import typer

from gpuwise.cli._app import (
    AttentionOption,
    CompileFlag,
    CpOption,
    EpOption,
    FormatOption,
    JsonFlag,
    LoraDropoutOption,
    LoraRankOption,
    LoraTargetsOption,
    LossOption,
    NodesOption,
    OffloadOption,
    OptimizerInBackwardFlag,
    OptimizerOption,
    PpOption,
    QloraFlag,
    QloraRecipeOption,
    WeightsOption,
    app,
    check_plot,
    comma_list,
    gpu_keys,
    gpu_names,
    output_format,
)
from gpuwise.errors import GpuwiseError
from gpuwise.recommend.request import Run, Traffic

_UNITS = {"s": 1, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """ "36h", "3d", "90min", "2w" or plain seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(s|min|h|d|w)?\s*", text.lower())
    if not m:
        raise GpuwiseError(f"--deadline {text!r} is not a duration", "pass e.g. --deadline 36h, 3d or 90min")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@app.command()
def recommend(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A built-in model (gpuwise plan --list-models) or path/to/file.py:function.")] = None,
    hf_config: Annotated[str | None, typer.Option(help=(
        "A Hugging Face config.json, a checkpoint folder (its safetensors read for the stored dtypes), a .gguf file, "
        "or a Hub id owner/name[@revision] (from the local cache, else downloaded) (needs gpuwise[hf]).")
    )] = None,
    task: Annotated[str | None, typer.Option(help="train, finetune-lora, or infer (= --serve).")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Rank for serving: decode speed, first-token time, "
                                                        "replicas for the users.")] = False,
    prompt_tokens: Annotated[int | None, typer.Option(
        help=f"Serving: tokens in each request [{Traffic.prompt_tokens}].")] = None,
    output_tokens: Annotated[int | None, typer.Option(
        help=f"Serving: tokens generated for each request [{Traffic.output_tokens}].")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Serving: users at once (images per batch for other "
                                                         f"models: see --batch) [{Traffic.concurrency}].")] = None,
    tokens_per_s: Annotated[float | None, typer.Option(help="Serving: output tokens (or samples) per second to "
                                                            "sustain over all replicas, instead of --concurrency.")
                            ] = None,
    request_rate: Annotated[float | None, typer.Option(help="Serving: requests a second arriving at random (Poisson) "
                                                            "over all replicas, instead of --concurrency.")] = None,
    runtime: Annotated[str | None, typer.Option(help="Serving: the runtime that serves: vllm, sglang, tensorrt-llm, "
                                                     "llama.cpp or hf (transformers generate); its batching, "
                                                     "overheads, layouts and formats [llama.cpp for GGUF weights, "
                                                     "else vllm].")] = None,
    split: Annotated[str | None, typer.Option(help="Serving: how a replica spreads over its GPUs: tp (tensor "
                                                   "parallel), pp (pipeline), layer (llama.cpp's default, one GPU "
                                                   "busy at a time) or row (llama.cpp) [the runtime's fastest]."
                                              )] = None,
    ttft_ms: Annotated[float | None, typer.Option(help="Serving: longest time to the first token.")] = None,
    tpot_ms: Annotated[float | None, typer.Option(help="Serving: longest time per output token.")] = None,
    weights: WeightsOption = None,
    kv_dtype: Annotated[str | None, typer.Option(help="Serving: the KV cache's storage, fp8 (fp8_e4m3, fp8_e5m2), bf16 "
                                                      "or fp16, as vLLM's --kv-cache-dtype [auto: the model's dtype]."
                                                 )] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Serving: the context each sequence may reach, vLLM's "
                                                           "--max-model-len [--prompt-tokens + --output-tokens].")
                             ] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Serving: the most sequences a replica decodes at once, "
                                                          "vLLM's --max-num-seqs (llama.cpp's --parallel); alone, "
                                                          "also --concurrency [the runtime's: vllm 256].")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="Serving: the share of each GPU's memory for weights, activations and the KV cache, vLLM's "
             "--gpu-memory-utilization [the runtime's: vllm 0.9].")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch: samples per optimizer step over every GPU, kept "
                                                   f"on every row [{Run.batch}].")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (language models).")] = None,
    image_size: Annotated[int | None, typer.Option(help="Pixels per side (image models).")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16-mixed, fp16-mixed, bf16 (pure), "
                                                       "fp8 or fp8-bf16 (torchao float8 linear layers) "
                                                       "[each GPU's default: bf16 autocast if it has bf16].")] = None,
    checkpointing: Annotated[str | None, typer.Option(help="none, full or selective (torchtitan's op policy) "
                                                         "[none if it fits, else full].")] = None,
    optimizer: OptimizerOption = None,
    optimizer_in_backward: OptimizerInBackwardFlag = False,
    sharding: Annotated[str | None, typer.Option(help="ddp, zero1, zero2 or fsdp [ddp if it fits, else fsdp].")
                        ] = None,
    lora_rank: LoraRankOption = None,
    qlora: QloraFlag = False,
    lora_targets: LoraTargetsOption = None,
    lora_dropout: LoraDropoutOption = None,
    qlora_recipe: QloraRecipeOption = None,
    loss: LossOption = None,
    attention: AttentionOption = None,
    compile_blocks: CompileFlag = False,
    tp: Annotated[int | None, typer.Option("--tp", "--tensor-parallel-size", help=(
        "Serving: GPUs a replica (tensor parallel), vLLM's --tensor-parallel-size [each of 1, 2, 4, 8]; training "
        "ranks data-parallel counts only (plan a --tp layout with gpuwise plan)."))] = None,
    pp: PpOption = None,
    cp: CpOption = None,
    ep: EpOption = None,
    nodes: NodesOption = None,
    offload: OffloadOption = None,
    tokens: Annotated[float | None, typer.Option(help="The goal: tokens to train on, e.g. 1e9.")] = None,
    samples: Annotated[float | None, typer.Option(help="The goal in samples (images, sequences).")] = None,
    epochs: Annotated[float | None, typer.Option(help="The goal in epochs of --dataset-size samples.")] = None,
    dataset_size: Annotated[int | None, typer.Option(help="Samples in one epoch (with --epochs).")] = None,
    budget: Annotated[float | None, typer.Option(help="USD: for the job with --rent, for the GPUs with --buy.")] = None,
    buy: Annotated[bool, typer.Option("--buy/--rent", help="Cost by purchase price instead of rent.")] = False,
    deadline: Annotated[str | None, typer.Option(help="Longest time to the goal, e.g. 36h, 3d.")] = None,
    max_gpus: Annotated[int | None, typer.Option(help="The most GPUs to use.")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", "--gpus", help="Only these catalog GPUs, comma-separated.")
                   ] = None,
    segment: Annotated[str | None, typer.Option(help="Only consumer, workstation, datacenter or edge.")] = None,
    vendor: Annotated[str | None, typer.Option(help="Only these vendors, comma-separated.")] = None,
    ecosystem: Annotated[str | None, typer.Option(help="Only GPUs PyTorch runs on with this stack, e.g. cuda "
                                                       "(leaves out chips that need a port).")] = None,
    prices: Annotated[str | None, typer.Option(help="A CSV of your own quotes: gpu,rent_usd_per_hour,buy_usd"
                                                    "[,date]; they replace the cloud snapshot's and the catalog's.")
                      ] = None,
    spot: Annotated[bool, typer.Option("--spot", help="Rent at the price snapshot's spot prices (spare capacity "
                                                      "the cloud may take back) [on-demand].")] = False,
    provider: Annotated[str | None, typer.Option(help="Rent from this cloud of the price snapshot only (aws, cudo, "
                                                      "hyperstack, lambda, nebius, vast, verda) [the cheapest offer].")
                        ] = None,
    sort: Annotated[str | None, typer.Option(help="time, cost or energy [time; cost when serving].")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw time to goal against cost, with the Pareto front, "
                                                  "to this PNG or SVG file.")] = None,
    json_out: JsonFlag = False,
    output: FormatOption = None,
) -> None:
    """Rank every catalog GPU and GPU count for your training or serving run: speed, time to goal, cost, energy.
    With no --model: six common jobs, each ranked over the catalog (the fastest, cheapest, most per joule).

    Examples: gpuwise recommend --model gpt2 --tokens 1e9; gpuwise recommend --model llama3-8b --seq 8192
    --batch 512 --tokens 1e12 --max-gpus 64; gpuwise recommend --model llama2-7b --task finetune-lora
    --tokens 5e7 --segment consumer --buy --budget 3000
    """
    fmt = output_format(output, json_out)
    check_plot(plot)
    if batch is not None and batch < 1:  # not "batch or the default": --batch 0 meant the default
        raise GpuwiseError(f"--batch {batch} is not a batch", f"pass a whole number from 1, or drop --batch "
                           f"[{Run.batch}]")
    gpus = gpu_names(gpu)
    segments = comma_list(segment, "--segment", "segment", "consumer,workstation")
    vendors = comma_list(vendor, "--vendor", "vendor", "NVIDIA,AMD")
    serving = serve or task == "infer"
    layout = [f"--{k} {v}" for k, v in (("tp", None if serving else tp), ("pp", pp), ("cp", cp), ("ep", ep),
                                       ("nodes", nodes), ("offload", offload)) if v not in (None, 1, "none")]
    if layout:  # recommend enumerates data-parallel GPU counts (ddp or fsdp) for one layout: the plain one
        raise GpuwiseError(f"{layout[0]}: recommend ranks data-parallel GPU counts, not model-parallel layouts or "
                           "offload", f"plan that layout with gpuwise plan {' '.join(layout)} --gpus N, or drop "
                           f"{layout[0]}")
    if task == "decode":
        raise GpuwiseError("recommend ranks generation with its serving model (--serve): --task decode is one step "
                           "for gpuwise plan", "pass --serve (the context is --prompt-tokens + --output-tokens), or "
                           "run gpuwise plan --task decode --context N")
    if sort is not None and sort not in ("time", "cost", "energy"):  # --sort '' is a slip, not the default
        raise GpuwiseError(f"--sort {sort!r} is not one of time, cost, energy", "pass --sort cost")
    if (epochs is None) != (dataset_size is None):
        raise GpuwiseError("--epochs and --dataset-size go together", "pass both, e.g. --epochs 3 "
                           "--dataset-size 50000")
    if epochs is not None and dataset_size is not None:
        if not (math.isfinite(epochs) and epochs > 0):
            raise GpuwiseError(f"--epochs {epochs:g} is not a positive number", "pass e.g. --epochs 3")
        if dataset_size < 1:
            raise GpuwiseError(f"--dataset-size {dataset_size} is not a number of samples",
                               "pass e.g. --dataset-size 50000")
        if samples is not None or tokens is not None:
            raise GpuwiseError("--epochs sets the goal, and so do --tokens and --samples", "give one goal")
        samples = epochs * dataset_size
    # Without torch: every argument is checked before the engine (and torch) loads.
    from gpuwise.hardware.calibration import stored_calibrations
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.hub import model_files
    from gpuwise.recommend.prices import read_prices
    from gpuwise.recommend.request import Constraints, Goal

    catalog = load_catalog()
    if model is None and hf_config is None:  # no workload: the guide, computed
        from gpuwise.recommend.guide import guide

        if prices or plot or spot or any(v is not None for v in (tokens, samples, budget, deadline, max_gpus, gpu,
                                                                  segment, vendor, ecosystem, provider)):
            raise GpuwiseError("goals and filters apply to a workload", "add --model NAME (or --hf-config)")
        with _progress("ranking six jobs over the catalog", fmt):
            result = guide(catalog=catalog, calibrations=stored_calibrations(os.environ))
        _show(result, None, fmt)
        return
    model_files(model, hf_config)  # a missing file is refused before torch loads
    rent, bought = read_prices(prices, catalog) if prices else ({}, {})
    constraints = Constraints(
        mode="buy" if buy else "rent", budget_usd=budget,
        deadline_s=None if deadline is None else parse_duration(deadline), max_gpus=max_gpus,
        gpus=gpu_keys(gpus, catalog), segments=segments, vendors=vendors,
        ecosystem=ecosystem, rent=rent, buy=bought, rent_kind="spot" if spot else "on-demand", provider=provider)
    goal = Goal(tokens=tokens, samples=samples)
    if serving and loss is not None:
        raise GpuwiseError("--loss has no meaning when serving", "drop --loss")
    if serving and compile_blocks:  # serving is ranked by its decode model (recommend/serve.py)
        raise GpuwiseError("--compile is not ranked when serving (decode reads the weights and the cache: fusion "
                           "changes little)", "drop --compile, or plan a compiled prefill with gpuwise plan --task "
                           "infer --compile")
    if serving and attention is not None:
        raise GpuwiseError(f"--attention {attention} is not ranked when serving: recommend --serve prices decode from "
                           "the bytes each step reads", f"drop --attention, or plan a prefill with gpuwise plan --task "
                           f"infer --attention {attention}")
    if serving:
        trained = [f for f, v in (("--checkpointing", checkpointing), ("--sharding", sharding),
                                  ("--lora-rank", lora_rank), ("--lora-targets", lora_targets),
                                  ("--lora-dropout", lora_dropout), ("--qlora-recipe", qlora_recipe), ("--seq", seq),
                                  ("--optimizer", optimizer),
                                  ("--optimizer-in-backward", optimizer_in_backward or None)) if v is not None]
        if trained:
            raise GpuwiseError(f"{trained[0]} has no meaning when serving",
                               f"drop {trained[0]} (the context is --prompt-tokens + --output-tokens)")
        if concurrency is None and tokens_per_s is None and request_rate is None:  # one engine at --max-num-seqs
            concurrency = max_num_seqs
        traffic = Traffic(**_given(prompt_tokens=prompt_tokens, output_tokens=output_tokens, concurrency=concurrency,
                                   tokens_per_s=tokens_per_s, ttft_s=None if ttft_ms is None else ttft_ms / 1e3,
                                   tpot_s=None if tpot_ms is None else tpot_ms / 1e3, weights=weights or None,
                                   kv_dtype=kv_dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                   tensor_parallel=tp, gpu_memory_utilization=gpu_memory_utilization,
                                   request_rate=request_rate, runtime=runtime, split=split))
        from dataclasses import replace

        from gpuwise.planning.sources.resolve import resolve_source
        from gpuwise.recommend.serve import serve as rank_serving
        from gpuwise.recommend.serve import served_weights

        source = resolve_source(model, hf_config)  # (torch loads here: every flag is checked above)
        if (stored := served_weights(source, weights or None)) is not None:  # a quantised checkpoint's own format
            traffic = replace(traffic, weights=stored)

        with _progress(f"ranking GPUs to serve {model or hf_config}: capturing the model", fmt):
            result = rank_serving(source, traffic, constraints, precision=precision,
                                  image_size=image_size, goal=goal, **_given(batch=batch, sort=sort),
                                  catalog=catalog, calibrations=stored_calibrations(os.environ))
        _show(result, plot, fmt)
        return
    served = [f for f, v in (("--weights", weights), ("--tpot-ms", tpot_ms), ("--ttft-ms", ttft_ms),
                             ("--tokens-per-s", tokens_per_s), ("--concurrency", concurrency),
                             ("--prompt-tokens", prompt_tokens), ("--output-tokens", output_tokens),
                             ("--kv-dtype", kv_dtype), ("--max-model-len", max_model_len),
                             ("--max-num-seqs", max_num_seqs), ("--gpu-memory-utilization", gpu_memory_utilization),
                             ("--request-rate", request_rate), ("--runtime", runtime), ("--split", split))
              if v is not None]
    if served:
        raise GpuwiseError(f"{served[0]} applies to serving", f"add --serve, or drop {served[0]}")
    given = {"task": task, "seq": seq, "image_size": image_size, "checkpointing": checkpointing,
             "sharding": sharding, "lora_rank": lora_rank, "precision": precision, "qlora": qlora or None,
             "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward or None}
    given |= {"loss": loss}
    given |= {"compile": compile_blocks or None, "attention": attention}
    lora_given = [f for f, v in (("--qlora", qlora or None), ("--lora-rank", lora_rank),
                                 ("--lora-targets", lora_targets), ("--lora-dropout", lora_dropout),
                                 ("--qlora-recipe", qlora_recipe)) if v is not None]
    if lora_given and task != "finetune-lora":
        raise GpuwiseError(f"{lora_given[0]} applies to LoRA fine-tuning", "add --task finetune-lora")
    given |= {"lora_targets": lora_targets, "lora_dropout": lora_dropout, "qlora_recipe": qlora_recipe}
    given = Setup.recipe_defaults(given)  # QLoRA as PEFT runs it: checkpointing on unless given
    setup = Run(**_given(batch=batch), options={k: v for k, v in given.items() if v is not None and k != "sharding"}
                ).setup()
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.recommend.search import recommend as rank

    with _progress(f"ranking GPUs for {model or hf_config}: capturing the model", fmt):
        result = rank(resolve_source(model, hf_config), setup, goal, constraints, precision=precision,
                      sharding=sharding, checkpointing_given=given["checkpointing"] is not None, **_given(sort=sort),
                      catalog=catalog, calibrations=stored_calibrations(os.environ))
    _show(result, plot, fmt)


def _given(**options):
    """The options the user gave (None: not given, so the dataclass's default holds)."""
    return {k: v for k, v in options.items() if v is not None}


def _progress(text: str, fmt: str):
    """A spinner on stderr while the ranking runs, on a terminal and for tables only."""
    from gpuwise import render

    return render.progress(text, enabled=render.show_progress(fmt))


def _show(result, plot: str | None, fmt: str) -> None:
    """Print the ranking; an empty one also says so in a line on stderr and exits 1 (nothing to recommend is a check
    that failed, not a result to act on)."""
    import sys

    from gpuwise import render

    render.emit(result, format=fmt)
    if plot is not None and getattr(result, "rows", True):  # after the table: a path we cannot write loses nothing
        from gpuwise.plot import plot_recommend

        plot_recommend(result, plot)
        if fmt == "table":
            print(f"time against cost drawn to {plot}")
    if hasattr(result, "rows") and not result.rows:
        left = len(getattr(result, "excluded", ()))
        print(f"no option fits: {left} GPU option(s) left out, each with its reason above" if left else
              "no option fits: no catalog GPU passed the filters", file=sys.stderr)
        raise typer.Exit(1)
