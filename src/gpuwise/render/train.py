"""``gpuwise train``: the live progress and the summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.units import human_bytes

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.training.run import TrainSummary
    from gpuwise.training.trainer import StepLog


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
        # what the monitor sees in the last steps
        if entry.bottleneck not in (None, "healthy", "not-judged", "compute-bound"):
            rate += f" · {entry.bottleneck}"
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task("", total=self.total)
            self.bar.update(self.task, completed=entry.step, description=f"loss {entry.loss:.3f}{evals} · {rate}")
        # the history stays on screen: a line per log step, printed above the bar while it runs
        norm = f"  |g| {entry.grad_norm:.3f}" if entry.grad_norm is not None else ""
        line = (f"step {entry.step:>6}  loss {entry.loss:.4f}{evals}  lr {entry.lr:.2e}{norm}  {rate}"
                + (f"  MFU {100 * entry.mfu:.1f}%" if entry.mfu else "")
                + (f"  peak {human_bytes(entry.peak_memory_bytes)}" if entry.peak_memory_bytes else "")
                + ("  (fp16 step skipped)" if entry.skipped else ""))
        (self.bar.console if self.bar is not None else self.console).print(line, markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.stop()


def render_train(s: TrainSummary, console: Console) -> None:
    table = Table(box=box.SIMPLE, show_header=False, title=f"gpuwise train: {s.task}", title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # a long path or figure folds, never ends in '…'
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
    if s.diagnosis is not None:
        from gpuwise.render.diagnosis import render_lines

        for line in render_lines(s.diagnosis):
            key, _, text = line.partition(": ")
            rows.append((key, text) if text else ("", line))
    if s.input_fix is not None:
        rows.append(("input fix", _input_fix(s.input_fix)))
    for k, v in rows:
        table.add_row(k, Text(v))
    console.print(table)


def _input_fix(f) -> str:
    if f.note:
        return f.note
    change = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in f.changed.items())

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.0f} ms"

    speed = f" ({f.speedup:.1f}x)" if f.speedup else ""
    return (f"{change}: data wait {pct(f.before_data_wait)} -> {pct(f.after_data_wait)} of a step, step "
            f"{ms(f.before_step_s)} -> {ms(f.after_step_s)}{speed}, measured over {f.steps} steps")


def train_json(s: TrainSummary) -> dict:
    """The summary as JSON: its fields, the diagnosis in the monitor's JSON form."""
    from gpuwise.render._common import to_jsonable

    out = to_jsonable(s)
    if s.diagnosis is not None:
        from gpuwise.render.diagnosis import diagnosis_json

        out["diagnosis"] = diagnosis_json(s.diagnosis)
    return out
