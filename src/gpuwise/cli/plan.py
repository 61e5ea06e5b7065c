"""``gpuwise plan``."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from gpuwise.cli._app import DeviceOption, JsonFlag, app, check_png
from gpuwise.errors import GpuwiseError

LORA_TARGETS_HELP = ("LoRA targets: short names q,k,v,o,gate,up,down, all-linear (every linear layer but the head), "
                     "layer names as PEFT's target_modules (q_proj, attention.wq), fnmatch patterns ('*.wq') or "
                     "re:REGEX on qualified names [every linear layer in the blocks].")
QLORA_RECIPE_HELP = ("peft: as PEFT's prepare_model_for_kbit_training leaves the model (weights not in 4 bits up-cast "
                     "to fp32, gradient checkpointing on unless --checkpointing is given); plain: the model as "
                     "loaded, in the compute dtype (litgpt, torchtune, Unsloth) [peft].")

LOSS_HELP = ("A decoder LM's loss: standard (the whole logits up-cast to fp32, as transformers does), chunked "
             "(torchtune's chunked cross-entropy, 8 chunks) or fused (a fused linear + cross-entropy, as Liger "
             "runs it) [standard].")


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A built-in model (see --list-models) or path/to/file.py:function, where "
        "function(batch_size) returns (model, inputs).")] = None,
    hf_config: Annotated[str | None, typer.Option(help="A Hugging Face config.json (needs gpuwise[hf]).")] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the built-in models and exit.")] = False,
    task: Annotated[str | None, typer.Option(help="train, finetune-lora or infer.")] = None,
    batch: Annotated[int | None, typer.Option(help="Global batch: samples per optimizer step over every GPU "
                                                   "[--micro-batch x --gpus].")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per GPU per forward; the rest of --batch is "
                                                         "accumulated [--batch / --gpus, else 1].")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (language models).")] = None,
    image_size: Annotated[int | None, typer.Option(help="Pixels per side (image models).")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16-mixed, fp16-mixed or bf16 (pure).")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw, sgd (momentum 0.9), adamw8bit or paged-adamw8bit "
                                                       "(bitsandbytes), adafactor, lion.")] = None,
    optimizer_in_backward: Annotated[bool, typer.Option(
        "--optimizer-in-backward", help="Step each parameter as soon as its gradient is ready (torchtune's "
        "optimizer_in_bwd): one GPU, no accumulation.")] = False,
    checkpointing: Annotated[str | None, typer.Option(help="none or full (recompute every block).")] = None,
    n_gpus: Annotated[int | None, typer.Option("--gpus", help="Data-parallel GPUs.")] = None,
    sharding: Annotated[str | None, typer.Option(help="ddp, zero1, zero2 or fsdp (with --gpus > 1).")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA rank for --task finetune-lora.")] = None,
    qlora: Annotated[bool, typer.Option("--qlora", help="finetune-lora with a 4-bit frozen base.")] = False,
    lora_targets: Annotated[str | None, typer.Option(help=LORA_TARGETS_HELP)] = None,
    lora_dropout: Annotated[float | None, typer.Option(help="Dropout on each adapter's input (PEFT's lora_dropout) "
                                                            "[0].")] = None,
    qlora_recipe: Annotated[str | None, typer.Option(help=QLORA_RECIPE_HELP)] = None,
    attention: Annotated[str | None, typer.Option(help="sdpa, or gpuwise (gpuwise.ops.attention) for the "
                                                       "built-in GPT and Llama models.")] = None,
    loss: Annotated[str | None, typer.Option(help=LOSS_HELP)] = None,
    gpu: Annotated[str | None, typer.Option(help="Fit on this catalog GPU only, with remedies if it does not "
                                                 "fit (default: every catalog GPU; remedies for --device's "
                                                 "GPU, else h100-sxm).")] = None,
    device: DeviceOption = None,
    plot: Annotated[str | None, typer.Option(help="Draw the memory timeline to this PNG file.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Simulate one training or inference step on fake tensors: exact peak memory, FLOPs and fit.

    Examples: gpuwise plan --model gpt2 --batch 8; gpuwise plan --model llama3-8b --gpu h100 --seq 8192;
    gpuwise plan --model llama2-7b --task finetune-lora --qlora --gpu rtx-4090;
    gpuwise plan --model my_net.py:build --batch 32 --json
    """
    from gpuwise import render

    if list_models:
        if model or hf_config:
            raise GpuwiseError("--list-models takes no model", "run 'gpuwise plan --list-models' alone")
        from gpuwise.models import MODELS

        render.emit(render.ModelList(tuple(MODELS.values())), json=json_out)
        return
    check_png(plot)
    from gpuwise.planning import Setup
    from gpuwise.planning.plan import plan_here

    training_only = [f for f, v in (("--optimizer", optimizer), ("--optimizer-in-backward", optimizer_in_backward),
                                    ("--checkpointing", checkpointing)) if v not in (None, False)]
    if task == "infer" and training_only:
        raise GpuwiseError(f"{training_only[0]} has no meaning for --task infer", f"drop {training_only[0]}")
    lora_given = [f for f, v in (("--qlora", qlora or None), ("--lora-rank", lora_rank),
                                 ("--lora-targets", lora_targets), ("--lora-dropout", lora_dropout),
                                 ("--qlora-recipe", qlora_recipe)) if v is not None]
    if lora_given and task != "finetune-lora":
        raise GpuwiseError(f"{lora_given[0]} applies to LoRA fine-tuning", "add --task finetune-lora")
    given = {"task": task, "seq": seq, "image_size": image_size, "precision": precision,
             "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward or None,
             "checkpointing": checkpointing, "sharding": sharding,
             "lora_rank": lora_rank, "qlora": qlora or None, "attention": attention}
    given |= {"loss": loss}
    given |= {"lora_targets": lora_targets, "lora_dropout": lora_dropout, "qlora_recipe": qlora_recipe}
    setup = Setup.for_batch(batch=batch, micro_batch=micro_batch, gpus=n_gpus or 1,
                            **{k: v for k, v in Setup.recipe_defaults(given).items() if v is not None})
    result = plan_here(model, setup, environ=os.environ, hf_config=hf_config, gpu=gpu, device=device)
    render.emit(result, json=json_out)
    if plot is not None:  # after the plan is shown: a path we cannot write loses nothing
        from gpuwise.plot import plot_plan

        plot_plan(result, plot)
        if not json_out:
            print(f"timeline drawn to {plot}")
