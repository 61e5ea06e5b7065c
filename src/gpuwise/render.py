"""Renderers: library results -> rich tables for people, plain dicts for ``--json``."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.doctor import DoctorReport
from gpuwise.hardware.catalog import DTYPES, Accelerator
from gpuwise.hardware.detect import LocalMachine
from gpuwise.units import human_bytes

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.bench.suite import BenchResult
    from gpuwise.models import ZooModel
    from gpuwise.planning.plan import MemoryPlan
    from gpuwise.training.run import TrainSummary
    from gpuwise.training.trainer import StepLog

_STATUS_STYLE = {"ok": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red")}


def _num(value: float | None, fmt: str = "g") -> str:
    return "-" if value is None else format(value, fmt)


def _short(value: float | None) -> str:
    """A rate or bandwidth for a narrow column: whole numbers from 100 up, else 3 digits."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain JSON-ready values."""
    if isinstance(obj, Accelerator):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(data: Any) -> None:
    print(json.dumps(to_jsonable(data), indent=2))


# ---------------------------------------------------------------------------------------------
# doctor


def doctor_json(report: DoctorReport) -> list[dict[str, Any]]:
    return [to_jsonable(f) for f in report.findings]


def render_doctor(report: DoctorReport, console: Console) -> None:
    table = Table(title="gpuwise doctor", show_lines=False, expand=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding", overflow="fold")
    for f in report.findings:
        label, style = _STATUS_STYLE[f.status]
        finding = Text(f.message)
        if f.fix:
            finding.append(f"\nfix: {f.fix}", style="cyan")
        table.add_row(Text(label, style=style), f.check, finding)
    console.print(table)
    fails = sum(f.status == "fail" for f in report.findings)
    warns = sum(f.status == "warn" for f in report.findings)
    verdict = "stack OK" if not fails else "stack has problems: apply the fixes above"
    console.print(f"{fails} failed, {warns} warnings, {len(report.findings) - fails - warns} ok: {verdict}")


# ---------------------------------------------------------------------------------------------
# gpus


def _link(a: Accelerator) -> str:
    """ "NVLink 900" or "PCIe 64": the card-to-card link kind and its GB/s, compact."""
    kind = (a.interconnect or "-").split()[0].replace("Infinity", "IF")
    return f"{kind} {a.interconnect_gbps:.0f}" if a.interconnect_gbps else kind


def render_catalog(rows: list[Accelerator], console: Console) -> None:
    table = Table(title=f"gpuwise hardware catalog: {len(rows)} accelerators", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False)
    table.add_column("key", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    for column in ("GB/s", "fp32", "bf16", "fp8"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("link GB/s", no_wrap=True)
    table.add_column("$/h", justify="right", no_wrap=True)
    for a in rows:
        rates = [_short(a.peak_tflops.get(d)) for d in ("fp32", "bf16", "fp8")]
        table.add_row(a.key, human_bytes(a.memory_bytes), _short(a.memory_bandwidth_gbps), *rates,
                      _link(a), _num(a.cloud_usd_per_hour, ".2f"))
    console.print(table)
    console.print("fp32/bf16/fp8: dense TFLOPS (no 2:4 sparsity; GeForce with fp32 accumulate); IF: "
                  "Infinity Fabric. 'gpuwise gpus KEY' shows a row with all its figures and sources.")


def render_accelerator(a: Accelerator, console: Console) -> None:
    table = Table(title=a.name, show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    cc = f"{a.compute_capability[0]}.{a.compute_capability[1]}" if a.compute_capability else "-"
    rows = [
        ("key", a.key), ("vendor", a.vendor), ("segment", a.segment), ("architecture", a.arch),
        ("compute capability", cc), ("aliases", ", ".join(a.aliases) or "-"),
        ("memory", f"{human_bytes(a.memory_bytes)} {a.memory_type or ''} ({a.memory_bytes:,} bytes)"),
        ("memory bandwidth", f"{_num(a.memory_bandwidth_gbps)} GB/s"),
    ]
    for dtype in DTYPES:
        unit = "TOPS" if dtype == "int8" else "TFLOPS"
        rows.append((f"{dtype} dense", f"{_num(a.peak_tflops.get(dtype))} {unit}"))
    rows += [
        ("TDP", f"{_num(a.tdp_w)} W"),
        ("interconnect", f"{a.interconnect or '-'} ({_num(a.interconnect_gbps)} GB/s); "
                         f"{'cards link directly' if a.peer_link else 'no card-to-card link (PCIe only)'}"),
        ("host link", a.host_link or "-"),
        ("launched", f"{_num(a.launch_year)}" + (f" at ${a.launch_price_usd:,.0f}" if a.launch_price_usd else "")),
        ("cloud price", f"${a.cloud_usd_per_hour:.2f}/h ({a.cloud_price_source})" if a.cloud_usd_per_hour else "-"),
        ("estimated", ", ".join(a.estimated) or "none: all from vendor documents"),
        ("source", a.source),
    ]
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)


def render_local(machine: LocalMachine, console: Console) -> None:
    table = Table(title=f"this machine (torch build: {machine.torch_build})", box=box.SIMPLE_HEAD)
    table.add_column("device", no_wrap=True)
    table.add_column("name", overflow="fold")
    table.add_column("memory", justify="right", no_wrap=True)
    table.add_column("free", justify="right", no_wrap=True)
    table.add_column("arch", no_wrap=True)
    table.add_column("catalog", no_wrap=True)
    for d in machine.devices:
        device = d.backend if d.index is None else f"{d.backend}:{d.index}"
        name = Text(d.name)
        if d.note:
            name.append(f"\n{d.note}", style="dim")
        table.add_row(device, name, human_bytes(d.memory_total_bytes), human_bytes(d.memory_free_bytes),
                      d.arch or "-", d.catalog_match.key if d.catalog_match else "-")
    console.print(table)


def local_json(machine: LocalMachine) -> dict[str, Any]:
    data = to_jsonable(machine)
    for device, raw in zip(data["devices"], machine.devices, strict=True):
        device["catalog_match"] = raw.catalog_match.key if raw.catalog_match else None
    return data


# ---------------------------------------------------------------------------------------------
# plan


def _count(n: int) -> str:
    """Parameters as people say them: 124.4 M, 6.74 B."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.4g} M" if n >= 1e6 else f"{n:,}"


def plan_json(plan: MemoryPlan) -> dict[str, Any]:
    """Every field of the plan but the timeline arrays."""
    skip = {"timeline", "timeline_phases"}
    data = {f.name: to_jsonable(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in skip}
    for remedy, raw in zip(data["remedies"], plan.remedies, strict=True):
        remedy.pop("setup")
        remedy["fits"] = raw.fits
    for fit in data["gpus"]:
        fit["fits"] = fit["status"] != "no"
    return data


_FIT_STYLE = {"fits": "green", "tight": "yellow", "no": "red"}


def render_plan(plan: MemoryPlan, console: Console) -> None:
    s = plan.setup
    unit = "token" if plan.tokens_per_step > s.batch * s.grad_accum else "sample"
    console.print(f"[bold]gpuwise plan[/bold]: {plan.model} · {s.describe()} · {plan.tokens_per_step:,} "
                  f"{unit}s per step")
    head = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    head.add_column(style="bold", no_wrap=True)
    head.add_column(overflow="fold")
    trainable = f" ({_count(plan.trainable_params)} trainable)" if plan.trainable_params != plan.params else ""
    head.add_row("parameters", f"{_count(plan.params)}{trainable}")
    per_token = plan.flops_per_step / max(plan.tokens_per_step, 1)
    head.add_row("FLOPs per step", f"{plan.flops_per_step:.3e} ({per_token:.3g} per {unit}; matmuls and attention)")
    head.add_row("peak memory", f"{human_bytes(plan.peak_bytes)} of tensors (at {plan.peak_at}) + "
                 f"{human_bytes(plan.overhead_bytes)} CUDA context and workspaces")
    if s.training:
        head.add_row("activations", f"{human_bytes(plan.activations_bytes)} saved for backward at the end of forward")
    if plan.captured_blocks:
        head.add_row("captured", "2 and 3 blocks on fake tensors, scaled to the full stack")
    if plan.uncosted:
        head.add_row("uncosted ops", Text(", ".join(f"{op} x{n}" for op, n in sorted(plan.uncosted.items()))
                                          + " (no FLOP formula: not counted)", style="yellow"))
    console.print(head)

    total = max(plan.peak_bytes, 1)
    at_peak = Table(title="memory at the peak", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    at_peak.add_column("category", no_wrap=True)
    at_peak.add_column("bytes", justify="right", no_wrap=True)
    at_peak.add_column("share", justify="right", no_wrap=True)
    at_peak.add_column("", no_wrap=True)
    for cat, value in plan.breakdown.items():
        if value:
            at_peak.add_row(cat, human_bytes(value), f"{100 * value / total:.0f}%", "█" * round(30 * value / total))
    console.print(at_peak)

    fits = Table(title=f"fit (needs = peak + {human_bytes(plan.overhead_bytes)} overhead)", box=box.SIMPLE_HEAD,
                 padding=(0, 1), pad_edge=False)
    for col, justify in (("gpu", "left"), ("memory", "right"), ("needs", "right"), ("headroom", "right"),
                         ("fits", "left"), ("max batch", "right"), ("step ≥", "right")):
        fits.add_column(col, justify=justify, no_wrap=True)
    for f in plan.gpus:
        head_room = human_bytes(f.headroom_bytes) if f.headroom_bytes >= 0 else f"-{human_bytes(-f.headroom_bytes)}"
        fits.add_row(f.gpu, human_bytes(f.memory_bytes), human_bytes(f.required_bytes), head_room,
                     Text(f.status, style=_FIT_STYLE[f.status]), str(f.max_batch),
                     "-" if f.step_time_s is None else _seconds(f.step_time_s) + ("*" if f.rates == "measured" else ""))
    console.print(fits)
    measured = ", ".join(f.gpu for f in plan.gpus if f.rates == "measured")
    rates = f"rates gpuwise bench --calibrate measured (*: {measured}), elsewhere the " if measured else ""
    console.print(f"step ≥: roofline floor at the {rates}datasheet's dense peak; real steps reach 30-60% of it")
    if plan.remedies:
        rem = Table(title=f"does not fit {plan.gpu}: remedies in order, each on top of the ones before "
                          "(LoRA from the one-GPU step); flags: all to add to your command",
                    box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
        rem.add_column("change", overflow="fold")
        rem.add_column("flags", overflow="fold", style="cyan")
        rem.add_column("needs", justify="right", no_wrap=True)
        rem.add_column("fits", no_wrap=True)
        for r in plan.remedies:
            rem.add_row(r.name, r.flags, human_bytes(r.required_bytes), Text(r.status, style=_FIT_STYLE[r.status]))
        console.print(rem)
    elif not plan.fits:
        if s.training:
            console.print(f"does not fit {plan.gpu}, and no remedy gpuwise plans applies to this model")
        else:
            console.print(f"does not fit {plan.gpu} even at batch 1: inference needs more memory per GPU than "
                          "it has (tensor parallelism and weight quantisation are not planned yet)")


def render_models(models: list[ZooModel], console: Console) -> None:
    table = Table(title="built-in models (gpuwise plan --model NAME)", box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False)
    for col, justify in (("name", "left"), ("params", "right"), ("blocks", "right"), ("input", "left"),
                         ("default", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for m in models:
        default = f"{m.default_seq} tokens" if m.default_seq else f"{m.default_image_size}px" if m.default_image_size \
            else f"{m.config.in_features} features"
        table.add_row(m.name, _count(m.published_params), str(m.n_layer or "-"),
                      m.inputs, default)
    console.print(table)


# ---------------------------------------------------------------------------------------------
# bench


def _rate(r: BenchResult) -> str:
    if r.gbps is not None:
        return f"{r.gbps:,.1f} GB/s"
    return f"{r.tflops:.3g} TF/s" if r.tflops is not None else "-"


def _seconds(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def render_bench(results: list[BenchResult], header: str, console: Console) -> None:
    show_peak = any(r.pct_of_peak is not None for r in results)
    show_cpu = any(r.speedup_vs_cpu is not None for r in results)
    table = Table(title=f"gpuwise bench: {header}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    columns = [("op", "left"), ("dtype", "left"), ("shape", "left"), ("median", "right"), ("±", "right"),
               ("rate", "right")] + [("peak", "right")] * show_peak + [("vs CPU", "right")] * show_cpu
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=col not in ("shape",), overflow="fold")
    for r in results:
        op = f"{r.op} {r.backend}" if r.backend else r.op
        if not r.repeats:
            table.add_row(op, r.dtype, r.shape, Text(r.note or "not run", style="yellow"), "", "",
                          *[""] * (show_peak + show_cpu))
            continue
        spread = 50 * (r.p90_s - r.p10_s) / r.median_s if r.median_s else 0.0
        row = [op, r.dtype, r.shape, _seconds(r.median_s), f"{spread:.0f}%", _rate(r)]
        if show_peak:
            row.append("-" if r.pct_of_peak is None else f"{r.pct_of_peak:.0f}%")
        if show_cpu:
            row.append("-" if r.speedup_vs_cpu is None else f"{r.speedup_vs_cpu:.1f}x")
        table.add_row(*row)
    console.print(table)
    console.print("median of timed repeats after warm-up, the device synchronised before every clock read; ±: "
                  "half the p10-p90 spread" + ("; peak: share of the catalog's dense figure for this device and "
                                                "dtype (bandwidth for copies)" if show_peak else "") + ".")


def render_compare(pairs: list[tuple[BenchResult, BenchResult, float]], names: tuple[str, str],
                   console: Console) -> None:
    table = Table(title=f"{names[1]} against {names[0]}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col, justify in (("op", "left"), ("dtype", "left"), ("shape", "left"), (names[0], "right"),
                         (names[1], "right"), ("speed-up", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for a, b, ratio in pairs:
        op = f"{a.op} ({a.backend})" if a.backend else a.op
        style = "green" if ratio > 1.05 else "red" if ratio < 0.95 else ""
        table.add_row(op, a.dtype, a.shape, _seconds(a.median_s), _seconds(b.median_s),
                      Text(f"{ratio:.2f}x", style=style))
    console.print(table)
    if not pairs:
        console.print("no results in common (same op, dtype, shape and backend)")


# ---------------------------------------------------------------------------------------------
# train


class TrainProgress:
    """A progress bar (step, loss, throughput, ETA) on a terminal, one line per log step otherwise."""

    def __init__(self, console: Console, *, live: bool, total: int | None = None) -> None:
        self.console, self.bar, self.task, self.total = console, None, None, total
        if live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.description}"), TimeRemainingColumn(), console=console)

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, soft_wrap=True)

    def log(self, entry: StepLog) -> None:
        rate = f"{entry.tokens_per_s:,.0f}/s"
        evals = f"  eval {entry.eval_loss:.4f}" if entry.eval_loss is not None else ""
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task("", total=self.total)
            self.bar.update(self.task, completed=entry.step, description=f"loss {entry.loss:.3f}{evals} · {rate}")
            return
        norm = f"  |g| {entry.grad_norm:.3f}" if entry.grad_norm is not None else ""
        self.console.print(f"step {entry.step:>6}  loss {entry.loss:.4f}{evals}  lr {entry.lr:.2e}{norm}  {rate}"
                           + (f"  MFU {100 * entry.mfu:.1f}%" if entry.mfu else "")
                           + (f"  peak {human_bytes(entry.peak_memory_bytes)}" if entry.peak_memory_bytes else "")
                           + ("  (fp16 step skipped)" if entry.skipped else ""), markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.stop()


def render_train(s: TrainSummary, console: Console) -> None:
    table = Table(box=box.SIMPLE, show_header=False, title=f"gpuwise train: {s.task}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    where = s.device + (f" x {s.processes} processes ({s.sharding})" if s.processes > 1 else "")
    rows = [
        ("model", f"{s.params:,} parameters · {s.optimizer}" + (" · compiled" if s.compiled else "")),
        ("device", f"{where} · {s.precision}"),
        ("batch", f"{s.batch} = micro-batch {s.micro_batch} x {s.grad_accum} accumulation"
         + (f" x {s.processes} processes" if s.processes > 1 else "")),
        ("steps", f"{s.steps} in {s.seconds:.1f} s" + (f", resumed from {s.resumed_from}" if s.resumed_from else "")),
        ("loss", f"{s.final_loss:.4f}" + (f" · held-out {s.eval_loss:.4f}" if s.eval_loss is not None else "")),
        ("throughput", f"{s.throughput:,.0f} {s.unit}/s" if s.throughput else "-"),
    ]
    if s.mfu is not None:
        rows.append(("MFU", f"{100 * s.mfu:.1f}% of the catalog's peak"))
    if s.peak_memory_bytes is not None:
        rows.append(("peak memory", human_bytes(s.peak_memory_bytes)))
    if s.skipped_steps:
        rows.append(("fp16 skips", f"{s.skipped_steps} steps skipped by the scaler (inf/NaN gradients)"))
    if s.auto:
        rows.append(("auto", s.auto))
    rows += [("note", e) for e in s.events]
    if s.checkpoint_dir:
        rows.append(("checkpoints", s.checkpoint_dir))
    for k, v in rows:
        table.add_row(k, Text(v))
    console.print(table)


# ---------------------------------------------------------------------------------------------
# one way out: every command hands its result to emit


@dataclasses.dataclass(frozen=True)
class CatalogRows:
    """``gpuwise gpus`` with filters: the rows that matched."""

    rows: tuple[Accelerator, ...]


@dataclasses.dataclass(frozen=True)
class ModelList:
    """``gpuwise plan --list-models``."""

    models: tuple[ZooModel, ...]


def _models_json(listing: ModelList) -> list[dict[str, Any]]:
    return [{"name": m.name, "params": m.published_params, "blocks": m.n_layer, "inputs": m.inputs,
             "default_seq": m.default_seq, "default_image_size": m.default_image_size, "source": m.source}
            for m in listing.models]


def _views() -> dict[str, tuple[Any, Any]]:
    """Result type name -> (table renderer, JSON view). By name: the torch-importing types load on demand."""
    return {
        "DoctorReport": (render_doctor, doctor_json),
        "LocalMachine": (render_local, local_json),
        "Accelerator": (render_accelerator, lambda a: [a]),
        "CatalogRows": (lambda c, console: render_catalog(list(c.rows), console), lambda c: list(c.rows)),
        "ModelList": (lambda m, console: render_models(list(m.models), console), _models_json),
        "MemoryPlan": (render_plan, plan_json),
        "TrainSummary": (render_train, lambda s: s),
    }


def emit(result: Any, *, json: bool, console: Console | None = None) -> None:
    """Print a command's result: as JSON with ``json``, else as its tables (on stdout unless ``console``)."""
    table, as_json = _views()[type(result).__name__]
    if json:
        print_json(as_json(result))
    else:
        table(result, console or Console(highlight=False, soft_wrap=False))
