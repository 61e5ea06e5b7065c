"""The typer app every command file registers with, and the options they share."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuwise import __version__

app = typer.Typer(
    name="gpuwise",
    help="Measured answers to GPU questions: is my stack right, will it fit, which GPU, how fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables (--format json).")]
FormatOption = Annotated[str | None, typer.Option("--format", help=(
    "table, json, csv (every column, raw numbers, units in the header: memory_gib) or md (a GitHub Markdown table) "
    "[table]."))]
DeviceOption = Annotated[str | None, typer.Option(
    help="cpu, cuda, cuda:N or mps (default: the first GPU torch can use, else mps, else cpu).")]

# The planner's recipe options, one declaration for plan and recommend (train refuses them as plan only).
OptimizerOption = Annotated[str | None, typer.Option(
    help="adamw, sgd (momentum 0.9), adamw8bit or paged-adamw8bit (bitsandbytes), adafactor, lion [adamw].")]
OptimizerInBackwardFlag = Annotated[bool, typer.Option(
    "--optimizer-in-backward", help="Step each parameter as soon as its gradient is ready (torchtune's "
    "optimizer_in_bwd): one GPU, no accumulation.")]
LoraRankOption = Annotated[int | None, typer.Option(help="LoRA rank for --task finetune-lora.")]
QloraFlag = Annotated[bool, typer.Option("--qlora", help="finetune-lora with a 4-bit frozen base.")]
LoraTargetsOption = Annotated[str | None, typer.Option(help=(
    "LoRA targets: short names q,k,v,o,gate,up,down, all-linear (every linear layer but the head), layer names as "
    "PEFT's target_modules (q_proj, attention.wq), fnmatch patterns ('*.wq') or re:REGEX on qualified names "
    "[every linear layer in the blocks]."))]
LoraDropoutOption = Annotated[float | None, typer.Option(
    help="Dropout on each adapter's input (PEFT's lora_dropout) [0].")]
QloraRecipeOption = Annotated[str | None, typer.Option(help=(
    "peft: as PEFT's prepare_model_for_kbit_training leaves the model (weights not in 4 bits up-cast to fp32, "
    "gradient checkpointing on unless --checkpointing is given); plain: the model as loaded, in the compute dtype "
    "(litgpt, torchtune, Unsloth) [peft]."))]
LossOption = Annotated[str | None, typer.Option(help=(
    "A decoder LM's loss: standard (the whole logits up-cast to fp32, as transformers does), chunked (torchtune's "
    "chunked cross-entropy, 8 chunks) or fused (a fused linear + cross-entropy, as Liger runs it) [standard]."))]
CompileFlag = Annotated[bool, typer.Option("--compile", help=(
    "torch.compile the model's repeated blocks, as torchtitan does (train compiles the model; plan and recommend "
    "model each block's AOTAutograd partition and inductor's pointwise fusion, the rest eager); training, or plan "
    "--task infer."))]
AttentionOption = Annotated[str | None, typer.Option(help=(
    "eager (q @ k^T, softmax, @ v: the s x s scores kept), sdpa, flash (FlashAttention-2; fp16/bf16) or flex "
    "(FlexAttention); gpuwise (gpuwise.ops.attention) for the built-in GPT and Llama [the model's own: an "
    "--hf-config's attn_implementation, else sdpa]."))]

# Model parallelism and offload (parallel/, parallel/sharding.py): --gpus is the total, tp x pp x cp x dp.
TpOption = Annotated[int | None, typer.Option("--tp", help=(
    "Tensor-parallel GPUs (Megatron's split: q,k,v,gate,up column-parallel, o,down row-parallel, heads and "
    "vocabulary split) [1]."))]
PpOption = Annotated[int | None, typer.Option("--pp", help=(
    "Pipeline stages, 1F1B schedule (--batch / --micro-batch micro-batches); the plan is the worst stage's [1]."))]
SequenceParallelFlag = Annotated[bool, typer.Option("--sequence-parallel", help=(
    "With --tp: norms and the residual stream split along the sequence too, as torchtitan's TP plan runs them."))]
CpOption = Annotated[int | None, typer.Option("--cp", help="Context-parallel GPUs (ring attention) [1].")]
EpOption = Annotated[int | None, typer.Option("--ep", help=(
    "Expert-parallel GPUs for a Mixture-of-Experts model (torchtitan's EP): each holds experts / N of every MoE layer, "
    "tokens exchanged by all-to-all; borrowed from the data-parallel (and context-parallel) GPUs, so N divides them "
    "and --gpus is unchanged [1]."))]
MoeImbalanceOption = Annotated[float | None, typer.Option("--moe-imbalance", help=(
    "The busiest routed expert's tokens over its balanced share (a capacity factor, 1 to experts / top-k): with "
    "--ep the plan is the busiest GPU's, its experts' activations and FLOPs grown to match [1.0, balanced]."))]
NodesOption = Annotated[int | None, typer.Option("--nodes", help=(
    "Nodes the --gpus span, for HSDP: --sharding fsdp shards within a node and replicates across nodes [1]."))]
OffloadOption = Annotated[str | None, typer.Option("--offload", help=(
    "none, optimizer (ZeRO-Offload: fp32 master, states and the step on the host) or params (FSDP2 "
    "CPUOffloadPolicy: the sharded parameters, gradients and states on the host; needs --sharding fsdp). "
    "Host memory is reported apart [none]."))]


# Inference (planning/transforms/quantize.py, planning/cost/serving.py): one --weights for plan and recommend --serve.
WeightsOption = Annotated[str | None, typer.Option(help=(
    "Inference weights: bf16 or fp16 (as computed), int8 (bitsandbytes LLM.int8), nf4 (bitsandbytes 4-bit, double "
    "quantisation), int4 (AWQ/GPTQ, group 128) or fp8; the blocks' linear layers only; embeddings, norms and head stay "
    "in the compute dtype. recommend --serve also takes llama.cpp's GGUF types (q4_0, q4_k_m, q5_k_m, q6_k, q8_0, f16) "
    "and FP4 (nvfp4, mxfp4: Blackwell) [as computed]."))]
ContextOption = Annotated[int | None, typer.Option(help=(
    "--task decode: tokens already in each sequence's KV cache; the step feeds one more [the model's default "
    "sequence]."))]


def _version(value: bool) -> None:
    if value:
        print(f"gpuwise {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """gpuwise: GPU answers with measurements instead of folklore."""


def check_plot(plot: str | None) -> None:
    """``--plot`` draws a PNG or an SVG, by the file's suffix: any other is refused before the work starts."""
    from gpuwise.errors import GpuwiseError

    if plot is not None and not plot.lower().endswith((".png", ".svg")):
        raise GpuwiseError(f"--plot {plot}: the picture is a PNG or an SVG",
                           f"pass --plot {plot.rsplit('.', 1)[0]}.png or .svg")




def comma_list(text: str | None, flag: str, what: str, example: str) -> tuple[str, ...]:
    """ "h100, a100" -> ("h100", "a100"); None -> () (any). A list that names nothing (--segment '', --gpu ',') is a
    slip, not "any": refused."""
    from gpuwise.errors import GpuwiseError

    if text is None:
        return ()
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise GpuwiseError(f"{flag} {text!r} names no {what}", f"pass e.g. {flag} {example}, or drop {flag} for "
                           f"every {what}")
    return items


def gpu_names(text: str | None) -> tuple[str, ...]:
    """``--gpu`` as plan and recommend read it, before the catalog loads: one catalog GPU or several, comma-separated
    ("h100,a100"); () without it (every catalog GPU)."""
    return comma_list(text, "--gpu", "GPU", "h100,a100 (gpuwise gpus lists the catalog keys)")


def gpu_keys(names: tuple[str, ...], catalog) -> tuple[str, ...]:
    """The catalog keys of ``gpu_names``, each once, in the order given (an unknown name: the catalog's one line)."""
    return tuple(dict.fromkeys(catalog.get(name).key for name in names))


def output_format(output: str | None, json_flag: bool) -> str:
    """The one output format ``--format`` and ``--json`` ask for, checked before any work: "table" without either.

    e.g. ``output_format("csv", False)`` -> "csv"; ``output_format(None, True)`` -> "json"
    """
    from gpuwise.render.formats import check_format

    return check_format(output, json_flag)
