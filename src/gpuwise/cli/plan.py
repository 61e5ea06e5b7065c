"""``gpuwise plan``."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from gpuwise.cli._app import (
    AttentionOption,
    CompileFlag,
    ContextOption,
    CpOption,
    DeviceOption,
    EpOption,
    FormatOption,
    JsonFlag,
    LoraDropoutOption,
    LoraRankOption,
    LoraTargetsOption,
    LossOption,
    MoeImbalanceOption,
    NodesOption,
    OffloadOption,
    OptimizerInBackwardFlag,
    OptimizerOption,
    PpOption,
    QloraFlag,
    QloraRecipeOption,
    SequenceParallelFlag,
    TpOption,
    WeightsOption,
    app,
    check_plot,
    gpu_keys,
    gpu_names,
    output_format,
)
from gpuwise.errors import GpuwiseError


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A built-in model (see --list-models) or path/to/file.py:function, where "
        "function(batch_size) returns (model, inputs).")] = None,
    hf_config: Annotated[str | None, typer.Option(help=(
        "A Hugging Face config.json, a checkpoint folder (its safetensors read for the stored dtypes), a .gguf file, "
        "or a Hub id owner/name[@revision] (from the local cache, else downloaded) (needs gpuwise[hf]).")
    )] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the built-in models and exit.")] = False,
    task: Annotated[str | None, typer.Option(help="train, finetune-lora, infer (a prefill of --seq tokens) or "
                                                  "decode (one token after --context cached ones).")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch: samples per optimizer step over every GPU "
                                                   "[--micro-batch x --gpus].")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per GPU per forward; the rest of --batch is "
                                                         "accumulated [--batch / --gpus, else 1].")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (language models).")] = None,
    image_size: Annotated[int | None, typer.Option(help="Pixels per side (image models).")] = None,
    audio_seconds: Annotated[float | None, typer.Option(help="Seconds of audio a sample (speech models; --seq is "
                                                             "then the transcript's tokens) [10; Whisper: 30].")
                             ] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16-mixed, fp16-mixed, bf16 (pure), fp8 "
                                                       "(torchao float8 linear layers over bf16-mixed) or fp8-bf16 "
                                                       "(over pure bf16).")] = None,
    optimizer: OptimizerOption = None,
    optimizer_in_backward: OptimizerInBackwardFlag = False,
    checkpointing: Annotated[str | None, typer.Option(help="none, full (recompute every block) or selective "
                                                         "(torchtitan's op policy: keep every other matmul's output "
                                                         "and attention's).")] = None,
    n_gpus: Annotated[int | None, typer.Option("--gpus", help="GPUs in all: data-parallel x --tp x --pp x --cp "
                                                                  "(--ep borrows from the data-parallel ones) "
                                                                  "[--tp x --pp x --cp x --ep].")] = None,
    sharding: Annotated[str | None, typer.Option(help="ddp, zero1, zero2 or fsdp (with --gpus > 1).")] = None,
    lora_rank: LoraRankOption = None,
    qlora: QloraFlag = False,
    lora_targets: LoraTargetsOption = None,
    lora_dropout: LoraDropoutOption = None,
    qlora_recipe: QloraRecipeOption = None,
    weights: WeightsOption = None,
    context: ContextOption = None,
    kv_dtype: Annotated[str | None, typer.Option(help="--task decode: the KV cache's storage, fp8 (fp8_e4m3, "
                                                      "fp8_e5m2), bf16 or fp16, as vLLM's --kv-cache-dtype [auto: "
                                                      "as the step computes].")] = None,
    attention: AttentionOption = None,
    loss: LossOption = None,
    compile_blocks: CompileFlag = False,
    tp: TpOption = None,
    sequence_parallel: SequenceParallelFlag = False,
    pp: PpOption = None,
    cp: CpOption = None,
    ep: EpOption = None,
    moe_imbalance: MoeImbalanceOption = None,
    nodes: NodesOption = None,
    offload: OffloadOption = None,
    gpu: Annotated[str | None, typer.Option(help="Fit on this catalog GPU only, or on these, comma-separated "
                                                 "(h100,a100: max batch and remedies for the first), with remedies "
                                                 "if it does not fit (default: every catalog GPU; remedies for "
                                                 "--device's GPU, else h100-sxm).")] = None,
    device: DeviceOption = None,
    solve: Annotated[str | None, typer.Option(help="max-context, max-batch or min-gpus: the longest --seq (--context "
                                                   "for decode), the largest --micro-batch or the fewest --gpus "
                                                   "(--sharding fsdp|zero*, or --tp) that fits --gpu (else the GPU "
                                                   "plan names), with the plan there.")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw the memory timeline to this PNG or SVG file.")] = None,
    json_out: JsonFlag = False,
    output: FormatOption = None,
) -> None:
    """Simulate one training or inference step on fake tensors: exact peak memory, FLOPs and fit.

    Examples: gpuwise plan --model gpt2 --batch 8; gpuwise plan --model llama3-8b --gpu h100 --seq 8192;
    gpuwise plan --model llama2-7b --task finetune-lora --qlora --gpu rtx-4090;
    gpuwise plan --model llama3-8b --task decode --context 8192 --batch 8 --weights int4 --gpu rtx-4090;
    gpuwise plan --model my_net.py:build --batch 32 --json;
    gpuwise plan --model llama3-8b --task decode --weights int4 --gpu rtx-4090 --solve max-context;
    gpuwise plan --model llama3-8b --sharding fsdp --seq 8192 --gpu h100 --solve min-gpus
    """
    from gpuwise import render

    fmt = output_format(output, json_out)
    if list_models:
        if model or hf_config:
            raise GpuwiseError("--list-models takes no model", "run 'gpuwise plan --list-models' alone")
        from gpuwise.models import MODELS

        render.emit(render.ModelList(tuple(MODELS.values())), format=fmt)
        return
    check_plot(plot)
    gpus = gpu_names(gpu)  # as recommend reads --gpu: one catalog GPU, or several comma-separated
    if solve is not None and len(gpus) > 1:
        raise GpuwiseError(f"--solve {solve} solves for one GPU; --gpu names {len(gpus)}",
                           f"pass one --gpu (e.g. --gpu {gpus[0]}), or plan without --solve to see them all fit")
    from gpuwise.planning.setup import Request, resolve  # without torch: the arguments are checked before it loads
    from gpuwise.planning.sources.hub import model_files

    request = Request(
        task=task, batch=batch, micro_batch=micro_batch, gpus=n_gpus, seq=seq, image_size=image_size,
        audio_seconds=audio_seconds, precision=precision, optimizer=optimizer,
        optimizer_in_backward=optimizer_in_backward, checkpointing=checkpointing, sharding=sharding,
        lora_rank=lora_rank, qlora=qlora, lora_targets=lora_targets, lora_dropout=lora_dropout,
        qlora_recipe=qlora_recipe, attention=attention, loss=loss, compile=compile_blocks, weights=weights,
        context=context, kv_dtype=kv_dtype, tp=tp, pp=pp, cp=cp, ep=ep, moe_imbalance=moe_imbalance,
        sp=sequence_parallel, nodes=nodes,
        offload=offload)
    if solve is None:
        setup = resolve(request)
    else:  # the search varies one flag: the request is checked as it will run
        from gpuwise.planning.solve import check_goal

        check_goal(solve, request)
    model_files(model, hf_config)  # a missing file is refused before torch loads
    if solve is not None:
        from gpuwise.planning.solve import solve_here

        with render.progress(f"solving {solve} for {model or hf_config}: plans on fake tensors",
                             enabled=render.show_progress(fmt)):
            solution = solve_here(solve, model, request, environ=os.environ, hf_config=hf_config,
                                  gpu=gpus[0] if gpus else None, device=device)
        render.emit(solution, format=fmt)
        result = solution.plan
    else:
        with render.progress(f"planning {model or hf_config}: one step on fake tensors",
                             enabled=render.show_progress(fmt)):
            result = _plan(model, setup, hf_config=hf_config, gpus=gpus, device=device)
        render.emit(result, format=fmt)
    if plot is not None:  # after the plan is shown: a path we cannot write loses nothing
        from gpuwise.plot import plot_plan

        plot_plan(result, plot)
        if fmt == "table":
            print(f"timeline drawn to {plot}")


def _plan(model: str | None, setup, *, hf_config: str | None, gpus: tuple[str, ...], device: str | None):
    """The plan fit on ``gpus`` (--gpu), else every catalog GPU. Several GPUs: the fit table holds those (the catalog
    for the plan is theirs alone), and max_batch and the remedies are for the first."""
    from gpuwise.planning.planner import plan_here, plan_model, where

    if len(gpus) > 1:
        from gpuwise.hardware.catalog import Catalog, load_catalog

        catalog = load_catalog()
        gpus = gpu_keys(gpus, catalog)  # names of one GPU ("h100,h100-sxm") plan as that one, below
        if len(gpus) > 1:
            context = where(os.environ, gpu=gpus[0], device=device)  # --device with --gpu is refused there
            return plan_model(model, setup, hf_config=hf_config, primary=gpus[0],
                              calibrations=context["calibrations"], catalog=Catalog(tuple(map(catalog.get, gpus))))
    return plan_here(model, setup, environ=os.environ, hf_config=hf_config, gpu=gpus[0] if gpus else None,
                     device=device)
