"""Every command's table and lines at 20 to 120 columns (issue 30, item 10), rendered from hand-made results (no
planner runs): no name is split nor a figure cut ("…"), a GPU's key always shows, a command or flags to copy are one
whole line (wider than the terminal they overflow rather than break), and notes wrap at spaces with the lines after
their first indented, so each reads as one."""

from __future__ import annotations

import io
import itertools
import re
import shlex

import numpy as np
import pytest
from rich.console import Console
from rich.text import Text

from gpuwise.doctor import DoctorReport, Finding
from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost.step import StepTime
from gpuwise.planning.fit import GpuFit
from gpuwise.planning.planner import MemoryPlan
from gpuwise.planning.remedies import Remedy
from gpuwise.planning.setup import Setup
from gpuwise.recommend.guide import Guide, Scenario
from gpuwise.recommend.option import Recommendation, TrainingOption
from gpuwise.recommend.prices import Price
from gpuwise.recommend.request import Constraints, Goal
from gpuwise.render import emit
from gpuwise.render._common import Column, Whole, hidden_note, print_fields, print_fit, wrap, wrap_units
from gpuwise.render.recommend import render_guide
from gpuwise.units import GiB, MiB

WIDTHS = [20, 30, 40, 60, 80, 120]


def _console(width: int) -> Console:
    """A pipe's console at ``width``, as the CLI's (render.terminal) but plain rich: these renderers take any."""
    return Console(file=io.StringIO(), width=width, highlight=False, soft_wrap=False, color_system=None)


def _render(result, width: int) -> str:
    console = _console(width)
    emit(result, console=console)
    return console.file.getvalue()


def _split(texts, out: str, width: int) -> list[str]:
    """The words of ``texts`` that ``out`` does not show whole (one wider than a whole line may be cut)."""
    shown = set(out.split())
    return [w for text in texts for w in text.split() if len(w) <= width - 2 and w not in shown]


def _over(out: str, width: int, allowed: tuple[str, ...] = ()) -> list[str]:
    """Lines wider than ``width``, but for the ones that are a command or flags to copy, whole."""
    return [line for line in out.splitlines() if len(line) > width and line.strip() not in allowed]


# -- gpuwise plan ------------------------------------------------------------------------------------------------

KEYS = ("rtx-4070-ti-super", "rtx-4090", "a100-80gb-sxm", "h100-sxm", "coral-edge-tpu")  # the longest key first
REMEDIES = (("activation checkpointing", "--checkpointing full", 148.1, "no"),
            ("FSDP over 4 GPUs (global batch 4)", "--batch 4 --checkpointing full --gpus 4 --sharding fsdp", 38.6,
             "fits"),
            ("QLoRA, 4-bit base, one GPU (fine-tuning only)",
             "--task finetune-lora --checkpointing full --lora-rank 16 --qlora", 25.1, "fits"))


def _plan() -> MemoryPlan:
    """A plan as the planner leaves it for llama3-8b at 8,192 tokens on an H100 (the README's example): five GPUs'
    fits, the memory at the peak, and three remedies."""
    catalog = load_catalog()
    required = 175.3 * GiB
    gpus = []
    for i, key in enumerate(KEYS):
        memory = catalog.get(key).memory_bytes
        step = StepTime(seconds=1.11 + i, mfu=0.4, basis="kernels", bound_s=0.454 + i,
                        phases_s={"forward": 0.32, "backward": 0.628, "optimizer": 0.166},
                        families_s={"matmul": 0.42, "attention": 0.16, "elementwise": 0.15})
        gpus.append(GpuFit(gpu=key, name=catalog.get(key).name, memory_bytes=memory, required_bytes=int(required),
                           headroom_bytes=int(memory - required), status="no", max_batch=0,
                           step_time_s=step.seconds, step_time_bound_s=step.bound_s, rates="datasheet", step=step))
    breakdown = {"weights": int(29.9 * GiB), "gradients": 0, "optimizer": int(59.8 * GiB),
                 "activations": int(77.2 * GiB), "temporaries": int(7.8 * GiB), "inputs": 128 * 1024}
    setup = Setup(seq=8192)
    remedies = tuple(Remedy(name=name, flags=flags, setup=setup, peak_bytes=int(need * GiB),
                            required_bytes=int(need * GiB), status=status) for name, flags, need, status in REMEDIES)
    return MemoryPlan(model="llama3-8b", setup=setup, params=8_030_000_000, trainable_params=8_030_000_000,
                      flops_per_step=430_400_000_000_000, bytes_per_step=0, tokens_per_step=8192,
                      peak_bytes=sum(breakdown.values()), overhead_bytes=544 * MiB, paged_bytes=0,
                      activations_bytes=int(77.2 * GiB), breakdown=breakdown, peak_at="backward", gpu="h100-sxm",
                      fits=False, max_batch=0, gpus=tuple(gpus), remedies=remedies, uncosted={},
                      captured_blocks=(2, 3), timeline=np.zeros((2, len(breakdown))), timeline_phases=("forward",) * 2)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_plan_keeps_every_gpu_name_and_figure_at_any_width(width):
    """At 40 columns the memory at the peak cut '474.7 …' and 'activati…'; under 37 the fit table split its GPU
    names. Now the bar shortens (or goes: the share says it), and a table too narrow for a GPU's name, fit and step
    gives each GPU as lines: its name, then every column as "header: value"."""
    plan = _plan()
    out = _render(plan, width)
    assert "…" not in out
    flags = tuple(flags for _, flags, _, _ in REMEDIES)
    assert not _over(out, width, flags)
    for fit in plan.gpus:  # each GPU's key whole at the start of its row, or on a line of its own
        assert re.search(rf"^{re.escape(fit.gpu)}(\s|$)", out, re.M), (fit.gpu, out)
    shown = " ".join(out.split())
    for category in ("weights", "optimizer", "activations", "temporaries", "inputs"):
        assert re.search(rf"(^|\s){category}:?\s", out), (category, out)
    for figure in ("29.9 GiB", "59.8 GiB", "77.2 GiB", "7.8 GiB", "128 KiB", "1.11 s"):
        assert figure in shown, figure
    if width <= 30:  # the GPUs as lines: every column kept, none hidden
        assert "hidden at" not in out
        assert "h100-sxm memory: 80 GiB, headroom: -95.3 GiB, fits: no, max batch: 0, step: 4.11 s, bound: 3.45 s" \
            in shown, out
    assert not re.search(r"\b(max\s*\n\s*batch)\b", hidden_note_line(out))


def hidden_note_line(out: str) -> str:
    """The note under the fit table naming the columns it left out, joined to one line ("" where none)."""
    m = re.search(r"^\d+ columns? hidden at .*?terminal$", out, re.M | re.S)
    return "" if m is None else m.group(0)


@pytest.mark.parametrize("width", WIDTHS)
def test_each_remedys_flags_are_one_whole_line_to_copy(width):
    """The remedies' flags were a table column folded at spaces ('--gpus' / '4 --sharding fsdp'): now each remedy is
    a line (what changes, what it needs, whether it fits) and its flags the next, whole, however narrow."""
    out = _render(_plan(), width)
    lines = out.splitlines()
    for name, flags, need, status in REMEDIES:
        assert f"  {flags}" in lines, (flags, out)
        at = lines.index(f"  {flags}")
        before = " ".join(" ".join(lines[:at]).split())
        assert before.endswith(f"{name}: needs {need} GiB, {status}"), before[-120:]


def test_a_two_line_header_is_named_on_one_line_when_hidden():
    """The fit table's 'max\\nbatch' header printed its line break inside the hidden-columns note."""
    note = hidden_note([Column(key="max_micro_batch", header="max\nbatch", priority=1)], 40)
    assert note.startswith("1 column hidden at 40 columns (max batch): ") and "\n" not in note


# -- gpuwise recommend -------------------------------------------------------------------------------------------

FLAGS = "--batch 512 --micro-batch 2 --gpus 64 --sharding fsdp --checkpointing selective"
PRICE_URL = ("https://github.com/skypilot-org/skypilot-catalog/blob/113567a74b2f208af08e0c9236e26cc354a2bf65/"
             "catalogs/v8/cudo/vms.csv")
BASIS = ("kernels by family (tiles x waves for GEMMs, bytes for the rest; fitted on NeuSight and OpenXLA per-kernel "
         "data, held-out median error: sgemm 9%-18%, tensor 8%-21%, memory-bound 3%-24%, conv 20%-31%); clock x1.00 "
         "SIMT, x0.86 tensor · ddp over 64: 20 buckets, OpenXLA measured table sm_100_GB200, 64 GPUs")


def _option(gpu: str, count: int, flags: str = "--micro-batch 8", pareto: bool = False) -> TrainingOption:
    price = Price(usd=1.82, source=PRICE_URL, date="2026-12-04", provider="cudo", kind="on-demand",
                  instance="sapphire-rapids-h100_1x2v4gb", region="no-kristiansand-1")
    return TrainingOption(gpu=gpu, name=gpu, count=count, fits=True, flags=flags, step_time_s=0.0139,
                          throughput=4.7e6 / count, mfu=0.23, time_to_goal_s=1908.0 * count, basis=BASIS,
                          rent_usd_per_hour=price, rent_usd=7.71 * count, buy_usd=None, buy_price=None,
                          energy_kwh=2.96, per_joule=93.7, pareto=pareto,
                          setup=Setup(micro_batch=2, gpus=count, sharding="fsdp" if count > 1 else "ddp"),
                          phases_s={"forward": 0.00824, "backward": 0.00196, "communication": 0.00217},
                          families_s={"launch": 0.6, "matmul": 0.12}, step_time_error=0.2)


def _recommendation() -> Recommendation:
    catalog = load_catalog()
    rows = (_option("rtx-4070-ti-super", 64, FLAGS, pareto=True), _option("a100-80gb-sxm", 8),
            _option("h100-sxm", 4, pareto=True))
    why = "an inference chip: no fp16, bf16 or fp32 rate to train with"
    return Recommendation(model="llama3-8b", setup=Setup(micro_batch=512), goal=Goal(tokens=1e9),
                          constraints=Constraints(), unit="tokens", sort="time", rows=rows,
                          excluded=(TrainingOption.left_out(catalog.get("coral-edge-tpu"), 1, why),))


@pytest.mark.parametrize("width", [*WIDTHS, 200])
def test_recommend_prints_the_command_whole_and_every_gpu_and_figure(width):
    """At 80 columns the suggested command wrapped with the notes ('... --sharding' / 'fsdp --checkpointing'); at 40
    the table cut its 'rent' header to 'ren'. Now the command is a line of its own, whole; a table too narrow for
    the GPU and the figures that rank it gives each row as lines."""
    r = _recommendation()
    out = _render(r, width)
    command = f"gpuwise train ... {FLAGS}"
    assert f"  {command}" in out.splitlines(), out
    assert "…" not in out and not _over(out, width, (command,))
    for o in r.rows:
        assert re.search(rf"^\s*(\*\s+)?{re.escape(o.gpu)}(\s|$)", out, re.M), (o.gpu, out)
    assert re.search(r"^\s*coral-edge-tpu\s", out, re.M)  # the left-out row, with its reason whole
    assert not _split([BASIS, "an inference chip: no fp16, bf16 or fp32 rate to train with"], out, width)
    if width >= 60:
        assert re.search(r"(^| )rent( |$)", out, re.M)  # every header whole
    # the URL of the price is whole where the width holds it, and cut (where a terminal folds) only where not
    assert (PRICE_URL in out) == (width >= len(PRICE_URL))


@pytest.mark.parametrize("width", [40, 50, 60])
@pytest.mark.parametrize("result", ["plan", "recommend"])
def test_notes_wrap_at_spaces_and_keep_each_figure_with_its_unit(width, result):
    """rich wrapped the notes and the plan's fields anywhere a space was: 'forward 8.24' / 'ms, backward' (50
    columns), '+ 544' / 'MiB CUDA context' (40 and 60). A figure and its unit now wrap as one word, and every word of
    a note shows whole."""
    out = _render(_plan() if result == "plan" else _recommendation(), width)
    lines = out.splitlines()
    apart = [(a, b) for a, b in itertools.pairwise(lines)
             if re.search(r"\d$", a.rstrip()) and re.match(r"\s*(ms|s|min|h|GiB|MiB|KiB|GB/s)\b", b)]
    assert not apart, apart
    if result == "recommend":
        assert not _split([BASIS], out, width)
        assert f"basis of the first row: {BASIS}" in " ".join(out.split())


@pytest.mark.parametrize("width", [40, 80, 120])
def test_the_guide_prints_each_command_whole(width):
    """`gpuwise recommend` with no model listed its six commands as rich wrapped them: '... --tokens 5e7' /
    '--deadline 1d'. Each is now a whole line; the picks wrap at spaces, every GPU key whole."""
    commands = ("gpuwise recommend --model llama2-7b --task finetune-lora --seq 2048 --batch 16 --tokens 5e7 "
                "--deadline 1d",
                "gpuwise recommend --model llama3-8b --seq 8192 --batch 512 --tokens 1e12 --max-gpus 512 "
                "--deadline 30d")
    names = ("LoRA fine-tune of a 7B model, 50M tokens within a day",
             "pre-train an 8B model on 1T tokens within 30 days")
    scenarios = tuple(Scenario(name=name, command=command, fastest=_option("jetson-agx-orin", 1),
                               cheapest=_option("rtx-4070-ti-super", 2), most_per_joule=None)
                      for name, command in zip(names, commands, strict=True))
    console = _console(width)
    render_guide(Guide(scenarios=scenarios, mode="rent"), console)
    out = console.file.getvalue()
    assert all(f"  {c}" in out.splitlines() for c in commands), out
    assert "…" not in out and not _over(out, width, commands)
    assert {"jetson-agx-orin:", "rtx-4070-ti-super:"} <= set(out.split())


# -- gpuwise doctor and watch ------------------------------------------------------------------------------------

FINDINGS = (Finding(check="python", status="ok", message="Python 3.11.7 (Linux x86_64)"),
            Finding(check="gpu", status="warn", message="no GPU: torch 2.13.0+cpu is the CPU build and this machine "
                    "has no NVIDIA GPU, so everything runs on the CPU", fix="to train on an NVIDIA GPU, on a machine "
                    "with one install its driver (R580 or newer) and pip install torch==2.13.0 --index-url "
                    "https://download.pytorch.org/whl/cu130"),
            Finding(check="dataloader", status="fail", message="2 usable CPU cores for CPU training: use "
                    "DataLoader(num_workers=0, pin_memory=False, persistent_workers=False)"))


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_splits_no_version_path_or_url(width):
    """At 40 columns the boxed table folded 'DataLoader(num_w' / 'orkers=0,' and the wheel index URL. Now each
    finding is wrapped at spaces beside its check, or under it where the terminal is narrow."""
    out = _render(DoctorReport(findings=FINDINGS), width)
    assert not _over(out, width, ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130",))
    assert not _split([f.message + " fix: " + (f.fix or "") for f in FINDINGS], out, width), out
    for f in FINDINGS:  # the status and the check at the start of a line
        assert re.search(rf"^{'FAIL' if f.status == 'fail' else f.status}\s+{f.check}(\s|$)", out, re.M), out
    assert "1 failed, 1 warnings, 1 ok: stack has problems" in " ".join(out.split())


@pytest.mark.parametrize("width", [30, 40, 80, 120])
def test_watch_prints_the_watched_command_whole(width):
    from gpuwise.monitor.rules import judge
    from gpuwise.monitor.samples import Record, Sample
    from gpuwise.monitor.watch import WatchResult

    command = ("torchrun", "--nproc-per-node", "8", "train.py", "--config", "configs/llama3-8b-long-run.yaml")
    record = Record(samples=(Sample(t=0.0), Sample(t=1.0)))
    r = WatchResult(command=command, pid=1, exit_code=0, seconds=1.0, record=record, diagnosis=judge(record),
                    log="/scratch/runs/llama3-8b-long-run/watch-log.jsonl")
    out = _render(r, width)
    joined = shlex.join(command)
    assert any(line.strip() == joined or line.split(None, 1)[-1] == joined for line in out.splitlines()), out
    assert not _over(out, width, (joined,)) and not _split([r.log], out, width)


# -- the pieces -------------------------------------------------------------------------------------------------

def test_wrap_breaks_at_spaces_keeps_a_figure_with_its_unit_and_cuts_only_a_word_wider_than_the_line():
    assert [t.plain for t in wrap("time: to the goal at the predicted rate", 20)] == [
        "time: to the goal at", "  the predicted rate"]
    assert [t.plain for t in wrap("needs 125.6 GiB, fits", 14)] == ["needs", "  125.6 GiB,", "  fits"]
    assert [t.plain for t in wrap("see " + "x" * 30 + " ok", 12)] == ["see", "x" * 12, "x" * 12, "x" * 6, "  ok"]
    command = Whole("gpuwise train ... --micro-batch 1 --gpus 64")
    assert [t.plain for t in wrap(command, 10)] == [command]  # a command is never wrapped: it overflows
    styled = wrap(Text("a b ") + Text("fits", style="green"), 6)
    assert [t.plain for t in styled] == ["a b", "  fits"] and styled[1].spans[0].style == "green"
    assert [t.plain for t in wrap_units(["memory: 80 GiB", "fits: no", "step: 1.11 s"], 26)] == [
        "  memory: 80 GiB,", "  fits: no, step: 1.11 s"]


def test_fields_sit_beside_their_keys_or_go_under_them():
    rows = [("key", "h100-sxm"), ("source", "see https://www.nvidia.com/en-us/data-center/h100/ for the rest"),
            ("command", Whole("torchrun --nproc-per-node 8 train.py --config a.yaml"))]
    console = _console(54)
    print_fields(console, rows)
    assert console.file.getvalue().splitlines() == [
        "key      h100-sxm",
        "source",  # its URL does not fit beside: the value goes under, whole
        "  see https://www.nvidia.com/en-us/data-center/h100/",
        "  for the rest",
        "command",
        "  torchrun --nproc-per-node 8 train.py --config a.yaml"]


def test_rows_too_wide_for_any_table_become_lines_with_every_column():
    columns = [Column(key="gpu"), Column(key="fits"), Column(key="step", numeric=True),
               Column(key="bound", numeric=True, priority=3)]
    console = _console(24)
    print_fit(console, columns, ["datacenter", ["rtx-4070-ti-super", "fits", "87.6 ms", "43.3 ms"]], title="fit")
    assert console.file.getvalue().splitlines() == [
        "fit", "datacenter", "rtx-4070-ti-super", "  fits: fits,", "  step: 87.6 ms,", "  bound: 43.3 ms"]
