"""The ``gpuwise`` command line: parse, call the library, hand the result to a renderer.

Errors a user can fix print one line, ``error: <what> (hint: <what to do>)``, and exit 2; a
traceback only with ``GPUWISE_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer
from rich.console import Console

from gpuwise import __version__
from gpuwise.errors import GpuwiseError

app = typer.Typer(
    name="gpuwise",
    help="Measured answers to GPU questions: is my stack right, will it fit, which GPU, how fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


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


@app.command()
def doctor(json_out: JsonFlag = False) -> None:
    """Check the PyTorch / CUDA / driver / GPU stack and say how to fix what is wrong.

    Exit code 0 when no check fails, 1 when one does.

    Examples: gpuwise doctor; gpuwise doctor --json
    """
    from gpuwise import render
    from gpuwise.doctor import diagnose
    from gpuwise.environment import gather_environment

    report = diagnose(gather_environment(os.environ))
    if json_out:
        render.print_json(render.doctor_json(report))
    else:
        render.render_doctor(report, _console())
    raise typer.Exit(report.exit_code)


@app.command()
def gpus(
    name: Annotated[str | None, typer.Argument(help="Show one accelerator, e.g. h100, 4090, mi300x.")] = None,
    segment: Annotated[str | None, typer.Option(help="consumer, workstation, datacenter or edge.")] = None,
    vendor: Annotated[str | None, typer.Option(help="NVIDIA, AMD, Intel, Huawei, Google or Apple.")] = None,
    min_memory: Annotated[str | None, typer.Option(
        help="At least this much memory, e.g. 24GB (10^9 bytes) or 24GiB (2^30 bytes); "
             "vendors' '24GB' cards hold 24 GiB.")] = None,
    local: Annotated[bool, typer.Option("--local", help="Show this machine's GPUs and CPU instead.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """List the hardware catalog, show one accelerator with its sources, or this machine.

    Examples: gpuwise gpus; gpuwise gpus h100; gpuwise gpus --segment consumer --min-memory 24GB;
    gpuwise gpus --local --json
    """
    from gpuwise import render
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.units import parse_bytes

    catalog = load_catalog()
    filters = segment is not None or vendor is not None or min_memory is not None
    if local:
        if name is not None or filters:
            raise GpuwiseError("--local shows this machine and takes no name or filters",
                               hint="run 'gpuwise gpus --local' alone")
        from gpuwise.environment import gather_environment
        from gpuwise.hardware.detect import describe_local

        machine = describe_local(gather_environment(os.environ), catalog)
        if json_out:
            render.print_json(render.local_json(machine))
        else:
            render.render_local(machine, _console())
        return
    if name is not None:
        if filters:
            raise GpuwiseError("a NAME shows one accelerator and takes no filters",
                               hint=f"run 'gpuwise gpus {name}' alone, or filters without a name")
        row = catalog.get(name)
        if json_out:
            render.print_json([row])
        else:
            render.render_accelerator(row, _console())
        return
    rows = catalog.filter(segment=segment, vendor=vendor,
                          min_memory_bytes=parse_bytes(min_memory) if min_memory is not None else None)
    if json_out:
        render.print_json(rows)
    else:
        render.render_catalog(rows, _console())


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A built-in model (see --list-models) or path/to/file.py:function, where "
        "function(batch_size) returns (model, inputs).")] = None,
    hf_config: Annotated[str | None, typer.Option(help="A Hugging Face config.json (needs gpuwise[hf]).")] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the built-in models and exit.")] = False,
    task: Annotated[str | None, typer.Option(help="train, finetune-lora or infer.")] = None,
    batch: Annotated[int | None, typer.Option(help="Micro-batch per GPU.")] = None,
    seq: Annotated[int | None, typer.Option(help="Tokens per sequence (language models).")] = None,
    image_size: Annotated[int | None, typer.Option(help="Pixels per side (image models).")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16-mixed, fp16-mixed or bf16 (pure).")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd (momentum 0.9).")] = None,
    checkpointing: Annotated[str | None, typer.Option(help="none or full (recompute every block).")] = None,
    grad_accum: Annotated[int | None, typer.Option(help="Micro-batches per optimizer step.")] = None,
    n_gpus: Annotated[int | None, typer.Option("--gpus", help="Data-parallel GPUs.")] = None,
    sharding: Annotated[str | None, typer.Option(help="ddp, zero1, zero2 or fsdp (with --gpus > 1).")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA rank for --task finetune-lora.")] = None,
    qlora: Annotated[bool, typer.Option("--qlora", help="finetune-lora with a 4-bit frozen base.")] = False,
    attention: Annotated[str | None, typer.Option(help="sdpa, or gpuwise (gpuwise.ops.attention) for the "
                                                       "built-in GPT and Llama models.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Fit on this catalog GPU only, with remedies if it does not "
                                                 "fit (default: every catalog GPU; remedies for this machine's "
                                                 "GPU, else h100-sxm).")] = None,
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

        if json_out:
            render.print_json([{"name": m.name, "params": m.published_params, "blocks": m.n_layer,
                                "inputs": m.inputs, "default_seq": m.default_seq,
                                "default_image_size": m.default_image_size, "source": m.source}
                               for m in MODELS.values()])
        else:
            render.render_models(list(MODELS.values()), _console())
        return
    if plot is not None and not plot.lower().endswith(".png"):
        raise GpuwiseError(f"--plot {plot}: the picture is a PNG", f"pass --plot {plot.rsplit('.', 1)[0]}.png")
    from gpuwise.planning import Setup, plan_model

    training_only = [f for f, v in (("--optimizer", optimizer), ("--checkpointing", checkpointing)) if v is not None]
    if task == "infer" and training_only:
        raise GpuwiseError(f"{training_only[0]} has no meaning for --task infer", f"drop {training_only[0]}")
    if (lora_rank is not None or qlora) and task != "finetune-lora":
        raise GpuwiseError(f"{'--qlora' if qlora else '--lora-rank'} applies to LoRA fine-tuning",
                           "add --task finetune-lora")
    given = {"task": task, "batch": batch, "seq": seq, "image_size": image_size, "precision": precision,
             "optimizer": optimizer, "checkpointing": checkpointing, "grad_accum": grad_accum, "gpus": n_gpus,
             "sharding": sharding, "lora_rank": lora_rank, "qlora": qlora or None, "attention": attention}
    setup = Setup(**{k: v for k, v in given.items() if v is not None})
    primary = None
    if gpu is None:  # remedies for this machine's GPU when the catalog knows it
        from gpuwise.environment import gather_environment
        from gpuwise.hardware.catalog import load_catalog
        from gpuwise.hardware.detect import describe_local

        local = describe_local(gather_environment(os.environ), load_catalog())
        primary = next((d.catalog_match.key for d in local.devices
                        if d.catalog_match is not None and d.backend != "cpu"), None)
    from gpuwise.bench.results import cache_dir, load_calibrations

    calibrations = load_calibrations(cache_dir(dict(os.environ)))  # from gpuwise bench --calibrate
    result = plan_model(model, setup, hf_config=hf_config, gpu=gpu, primary=primary, calibrations=calibrations)
    if json_out:
        render.print_json(render.plan_json(result))
    else:
        render.render_plan(result, _console())
    if plot is not None:  # after the plan is shown: a path we cannot write loses nothing
        from gpuwise.plot import plot_plan

        plot_plan(result, plot)
        if not json_out:
            print(f"timeline drawn to {plot}")


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
    if json_out:
        render.print_json(summary)
    else:
        render.render_train(summary, _console())


def _csv(value: str | None, allowed: tuple[str, ...], flag: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(v.strip().lower() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise GpuwiseError(f"{flag} {value!r}: {', '.join(bad) or 'empty'} not one of {', '.join(allowed)}",
                           f"pass a comma-separated list, e.g. {flag} {allowed[0]},{allowed[1]}")
    return items


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes, few repeats (about a minute on a CPU).")] = False,
    ops: Annotated[str | None, typer.Option(help="Comma-separated: gemm, copy, h2d, attention, conv2d, block, "
                                                 "train-step (default: all).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="GEMM dtypes, comma-separated: fp32, tf32, fp16, "
                                                             "bf16, fp8 (default: fp32,bf16; all on a GPU).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N or mps (default: the GPU if any).")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw a roofline to this PNG file.")] = None,
    save: Annotated[str | None, typer.Option(help="Write the results to this JSON file.")] = None,
    compare: Annotated[list[str] | None, typer.Option(help="A file from --save: compare this run with it; "
                                                           "give it twice to compare two files.")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Store the measured GEMM and copy rates for "
                                                                "later plans of this device.")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Time GEMMs, copies, attention backends, conv2d, a transformer block and a training step, honestly.

    Examples: gpuwise bench --quick; gpuwise bench --ops gemm --dtype bf16,fp8 --plot roofline.png;
    gpuwise bench --save h200.json; gpuwise bench --compare h200.json --compare a100.json
    """
    from gpuwise import render
    from gpuwise.bench import results as store

    if plot is not None and not plot.lower().endswith(".png"):
        raise GpuwiseError(f"--plot {plot}: the picture is a PNG", f"pass --plot {plot.rsplit('.', 1)[0]}.png")
    compare = compare or []
    if len(compare) > 2:
        raise GpuwiseError("--compare takes one file (against this run) or two",
                           "pass --compare A.json [--compare B.json]")
    if len(compare) == 2:
        extra = [f for f, v in (("--save", save), ("--plot", plot), ("--calibrate", calibrate), ("--quick", quick),
                                ("--ops", ops), ("--dtype", dtype), ("--device", device)) if v]
        if extra:
            raise GpuwiseError(f"two --compare files run nothing, so {extra[0]} has nothing to act on",
                               f"drop {extra[0]}, or compare one file against a new run")
        (_, a), (_, b) = store.load(compare[0]), store.load(compare[1])
        from gpuwise.bench.suite import compare as pair

        pairs = pair(a, b)
        if json_out:
            render.print_json([{"op": x.op, "dtype": x.dtype, "shape": x.shape, "backend": x.backend,
                                "a_median_s": x.median_s, "b_median_s": y.median_s, "speedup": r}
                               for x, y, r in pairs])
        else:
            render.render_compare(pairs, (compare[0], compare[1]), _console())
        return
    if compare and json_out:
        raise GpuwiseError("--json prints this run's results; a comparison needs two saved runs",
                           f"run with --save new.json, then: gpuwise bench --compare {compare[0]} --compare new.json")
    baseline = store.load(compare[0])[1] if compare else None
    for target in (save, plot):  # fail before a run of minutes, not after it
        if target is not None:
            from pathlib import Path

            folder = Path(target).parent
            if Path(target).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
                raise GpuwiseError(f"cannot write {target}", "pick a file in a folder you can write to")
    import torch

    from gpuwise.bench.suite import DTYPES, OPS, run_suite

    chosen_ops = _csv(ops, OPS, "--ops") or OPS
    name = device or ("cuda" if torch.cuda.is_available() else
                      "mps" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "cpu")
    default_dtypes = ("fp32", "tf32", "fp16", "bf16", "fp8") if name.startswith("cuda") else ("fp32", "bf16")
    chosen_dtypes = _csv(dtype, DTYPES, "--dtype") or default_dtypes
    if calibrate and not {"gemm", "copy"} <= set(chosen_ops):
        raise GpuwiseError("--calibrate stores GEMM and copy rates", "include gemm,copy in --ops (or drop --ops)")
    from gpuwise.environment import gather_environment
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.hardware.detect import describe_local

    local = describe_local(gather_environment(os.environ), load_catalog())
    from gpuwise.bench.device import device_for

    name = device_for(name).name  # checked here, before anything runs: "cuda" becomes "cuda:0"
    kind, _, number = name.partition(":")
    index = int(number or 0)
    match = next((d for d in local.devices if d.backend == kind or ((kind == "cuda" and d.backend == "rocm")
                  and (d.index in (None, index)))), None)
    accelerator = match.catalog_match if match else None
    label = f"{name} ({match.name if match else name}), torch {torch.__version__}"

    progress = None
    if sys.stderr.isatty() and not json_out:
        from rich.progress import Progress

        bar = Progress(transient=True, console=Console(stderr=True))
        task = bar.add_task("bench", total=None)
        bar.start()
        progress = lambda text: bar.update(task, description=text)  # noqa: E731
    try:
        results = run_suite(name, quick=quick, ops=chosen_ops, dtypes=chosen_dtypes, accelerator=accelerator,
                            progress=progress)
    finally:
        if progress is not None:
            bar.stop()
    if not results:
        raise GpuwiseError(f"nothing of --ops {','.join(chosen_ops)} runs on {name}",
                           "h2d needs a CUDA GPU; see 'gpuwise bench --help' for the ops")
    if json_out:
        render.print_json(store.to_dicts(results))
    else:
        render.render_bench(results, label, _console())
        if baseline is not None:
            from gpuwise.bench.suite import compare as pair

            render.render_compare(pair(baseline, results), (compare[0], "this run"), _console())
    machine = {"device": label, "catalog": accelerator.key if accelerator else None}
    if save is not None:
        store.save(results, save, machine=machine)
    if calibrate and accelerator is None:
        print(f"calibration not stored: plans are for catalog GPUs and {name} matches none", file=sys.stderr)
    elif calibrate:
        cal = store.Calibration.from_results(accelerator.key, results)
        where = store.save_calibration(cal, store.cache_dir(dict(os.environ)))
        if not json_out:
            quick_note = " (--quick sizes: below what the full suite reaches)" if quick else ""
            print(f"calibration for {cal.device} stored in {where}{quick_note}: plans for it use these rates")
    if plot is not None:
        from gpuwise.plot import plot_roofline

        dtypes_run = sorted({r.dtype for r in results if r.op == "gemm" and r.tflops})
        if accelerator:  # a compute ceiling per dtype that ran, from the datasheet
            ceilings = {d: accelerator.peak_tflops.get(d) for d in dtypes_run if accelerator.peak_tflops.get(d)}
            peak_gbps = accelerator.memory_bandwidth_gbps
        else:  # no datasheet: the best this run reached
            ceilings = {d: max(r.tflops for r in results if r.op == "gemm" and r.dtype == d and r.tflops)
                        for d in dtypes_run}
            copies = [r.gbps for r in results if r.op == "copy" and r.gbps]
            peak_gbps = max(copies) if copies else None
        source = "catalog" if accelerator else "best measured"
        plot_roofline(results, plot, title=f"{label}: ceilings from the {source}", ceilings=ceilings,
                      peak_gbps=peak_gbps)
        if not json_out:
            print(f"roofline drawn to {plot}")


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """Click's usage-error base class, wherever this typer keeps click (vendored or not)."""
    return tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _command_name(argv: list[str]) -> str:
    """ "gpuwise gpus" when argv names a command, else "gpuwise"."""
    words = [a for a in argv if not a.startswith("-")]
    known = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return f"gpuwise {words[0]}" if words and words[0] in known else "gpuwise"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 1 a check failed, 2 a usage error, 3 a bug."""
    argv = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    debug = os.environ.get("GPUWISE_DEBUG", "") not in ("", "0")
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="gpuwise", standalone_mode=False)
    except GpuwiseError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except _usage_error_types() as exc:
        if debug:
            traceback.print_exc()
        message = exc.format_message().replace("\n", " ")  # type: ignore[attr-defined]
        print(f"error: {message} (hint: run '{_command_name(argv)} --help')", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("error: interrupted", file=sys.stderr)
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except Exception as exc:
        if debug:
            raise
        print(f"error: internal error: {type(exc).__name__}: {exc} "
              "(hint: rerun with GPUWISE_DEBUG=1 and report the traceback)", file=sys.stderr)
        return 3
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
