"""The two width leftovers of issue 30, item 10: the live ``gpuwise watch`` panel, which cut its one-line GPU rows
with "…" below ~125 columns, and ``gpuwise doctor``, whose fixes wrapped a ``pip install ... --index-url ...`` in the
middle of prose. Now a panel row folds onto lines of its own at spaces (its height fixed while the terminal's size
is), and a fix's command is one whole line, as recommend and plan print theirs."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest
from rich.console import Console

from fakes.environments import cpu_env, cuda_env
from gpuwise.doctor import DoctorReport, Finding, check_gpu, diagnose
from gpuwise.monitor.samples import DeviceSample, HostSample, Sample, StepEvent
from gpuwise.monitor.watch import Tick, WatchStart
from gpuwise.render import emit
from gpuwise.render.watch import MAX_PANEL_SHARE, WatchPanel, status_lines
from gpuwise.units import GiB

# -- the live panel of gpuwise watch ----------------------------------------------------------------------------


def device(index: int = 0, **changes) -> DeviceSample:
    """A busy H100 held at its power cap, as NVML reads it."""
    d = DeviceSample(index=index, name="NVIDIA H100 80GB HBM3", util_pct=97.0, memory_used_bytes=61 * GiB,
                     memory_total_bytes=80 * GiB, process_memory_bytes=58 * GiB, power_w=690.0, power_limit_w=700.0,
                     sm_clock_mhz=1500.0, sm_clock_max_mhz=1980.0, clock_reasons=("power cap (software)",),
                     temperature_c=71.0, sm_active_pct=88.0)
    return replace(d, **changes)


def tick(devices=None, *, t: float = 12.0, step: StepEvent | None = None, **host) -> Tick:
    devices = (device(),) if devices is None else devices
    h = HostSample(**{"cpu_pct": (50.0, 100.0), "memory_used_bytes": 4 * GiB, "memory_total_bytes": 16 * GiB,
                      "process_cpu_pct": 104.0, "workers": 4, "workers_cpu_pct": 380.0, **host})
    step = step or StepEvent(step=42, t=10.0, seconds=0.3, data_wait_s=0.12)
    return Tick(t=t, sample=Sample(t=t, devices=tuple(devices), host=h), samples=24, steps=step.step,
                last_step=step, pid=1234)


def figures(d: DeviceSample) -> list[str]:
    """What the panel says of a GPU, each a piece that must stay on one line, written from the sample's fields."""
    gib = 2 ** 30
    return [f"util {d.util_pct:.0f}%", f"(SM {d.sm_active_pct:.0f}%)",
            f"mem {d.memory_used_bytes / gib:.1f}/{d.memory_total_bytes / gib:.1f} GiB",
            f"(cmd {d.process_memory_bytes / gib:.1f})", f"{d.power_w:.0f}/{d.power_limit_w:.0f} W",
            f"SM {d.sm_clock_mhz:.0f}/{d.sm_clock_max_mhz:.0f} MHz", f"{d.temperature_c:.0f}°C",
            *(d.clock_reasons or ())]


def frames(out: str) -> list[dict[int, str]]:
    """The frames the panel drew: for each, the terminal row each line went to and the line's text (the panel
    moves the cursor to a row, erases it, and writes the line there)."""
    found = []
    for chunk in out.split("\x1b7"):
        rows = re.findall(r"\x1b\[(\d+);1H\x1b\[2K([^\x1b]*)", chunk)
        if rows:
            found.append({int(row): text for row, text in rows})
    return found


def watched(width: int, height: int, ticks: list[Tick], gpus: int) -> tuple[WatchPanel, int, str]:
    """A panel on a terminal ``width`` x ``height``, started and drawn with each tick in turn: the panel, its
    height while drawn, and all it wrote."""
    console = Console(file=io.StringIO(), force_terminal=True, width=width, height=height, color_system=None)
    panel = WatchPanel(console)
    panel.start(WatchStart(pid=1234, command=("python", "train.py"), gpus=gpus, note=None))
    for t in ticks:
        panel.update(t)
    drawn = panel.height
    panel.stop()
    return panel, drawn, console.file.getvalue()


def words(lines) -> set[str]:
    """The words of ``lines``, less the separators between a row's pieces (left out where a piece starts a line)."""
    return {w.rstrip(",") for line in lines for w in line.split()} - {"·", "+"}


def unfolded_words(t: Tick) -> set[str]:
    """Every word the panel has to say about ``t``: its lines at a width that holds them whole."""
    return words(line.plain for line in status_lines(t))


@pytest.mark.parametrize("width", [20, 30, 40, 60, 80, 100, 120])
def test_the_live_panel_folds_a_gpu_row_rather_than_cutting_it(width):
    """At 100 columns the row of a GPU held at its power cap ended 'SM 1500/1980 MHz powe…', at 40 'util  97%
    me…'. Now it folds at its spaces onto more lines, each inside the terminal (less its last column, where a
    character would scroll the screen), and every figure and the reason the clock is held stay whole."""
    held = device(clock_reasons=("power cap (software)", "thermal (software)"), temperature_c=88.0)
    ticks = [tick(), tick([held], t=3600.0, step=StepEvent(step=12_345, t=3599.0, seconds=1.25, data_wait_s=0.5))]
    _, drawn, out = watched(width, 200, ticks, gpus=1)
    assert "…" not in out
    shown = frames(out)
    assert len(shown) == 2 and all(len(f) == drawn for f in shown)  # every row of the panel drawn, each frame
    assert all(len(text) <= width - 1 for f in shown for text in f.values()), shown
    for n, (frame, t) in enumerate(zip(shown, ticks, strict=True)):
        lines = [frame[row] for row in sorted(frame)]
        assert words(lines) <= unfolded_words(t)  # no word cut, none made up
        # the rows are sized for a GPU held for one reason: all of the first sample shows; in the second a second
        # reason takes the room of what matters least (its power, its clock), and what matters most always shows
        d = t.sample.devices[0]
        pieces = figures(d)[:4] + list(d.clock_reasons) if n else figures(d)
        for piece in [*pieces, "gpuwise watch", f"{t.t:.0f} s"]:
            if len(piece) <= width - 3:  # a piece wider than a line may break at its spaces, like any text
                assert any(piece in " ".join(line.split()) for line in lines), (piece, lines)
        assert any(line.startswith("GPU0* H100") for line in lines) and "HBM3" in " ".join(lines)


@pytest.mark.parametrize(("width", "height"), [(40, 24), (60, 24), (80, 30), (100, 40)])
def test_the_panel_keeps_its_height_and_says_how_many_gpus_it_shows(width, height):
    """Eight GPUs on a short terminal: the panel takes at most a third of the rows, every GPU it shows is whole,
    the header says how many it shows, and the height is the same from frame to frame whatever the figures do
    (the panel is redrawn in place over the same rows: a row that grew would push into the output above)."""
    quiet = [device(i, clock_reasons=(), sm_active_pct=None, process_memory_bytes=None, util_pct=3.0)
             for i in range(8)]
    busy = [device(i, clock_reasons=("power cap (software)", "thermal (hardware)", "power brake (hardware)"))
            for i in range(8)]
    _, drawn, out = watched(width, height, [tick(quiet), tick(busy), tick(quiet, t=86_400.0)], gpus=8)
    assert 2 <= drawn <= height // MAX_PANEL_SHARE and "…" not in out
    shown = frames(out)
    assert {tuple(sorted(f)) for f in shown} == {tuple(range(height - drawn + 1, height + 1))}
    text = ["\n".join(f[row] for row in sorted(f)) for f in shown]
    gpus = len(re.findall(r"^GPU\d", text[0], re.M))
    assert gpus >= 1 and all(len(re.findall(r"^GPU\d", t, re.M)) == gpus for t in text)
    assert all((f"{gpus} of 8 GPUs shown" in " ".join(t.split())) == (gpus < 8) for t in text)
    assert all(len(line) <= width - 1 for t in text for line in t.splitlines())


def test_a_wide_terminal_keeps_one_line_a_gpu():
    """Where a row fits, the panel is as it was: a header, a line per GPU, a line for the host."""
    _, drawn, out = watched(160, 48, [tick([device(0), device(1)])], gpus=2)
    (frame,) = frames(out)
    assert drawn == 4 and [frame[row].split()[0] for row in sorted(frame)] == ["gpuwise", "GPU0*", "GPU1*", "CPU"]
    assert all(p in " ".join(frame[46].split()) for p in figures(device(1)))


def test_a_narrower_terminal_lays_the_panel_out_again():
    """The terminal made narrower while the command runs: the rows are laid out for the new width, nothing cut."""
    console = Console(file=io.StringIO(), force_terminal=True, width=160, height=48, color_system=None)
    panel = WatchPanel(console)
    panel.start(WatchStart(pid=1234, command=None, gpus=1, note=None))
    panel.update(tick())
    wide = panel.height
    console.width = 50
    panel.update(tick())
    narrow = panel.height
    panel.stop()
    out = console.file.getvalue()
    last = frames(out)[-1]
    assert wide == 3 and narrow > wide and len(last) == narrow and "…" not in out
    assert all(len(text) <= 49 for text in last.values())


# -- gpuwise doctor's fixes ------------------------------------------------------------------------------------

WIDTHS = [20, 30, 40, 60, 80, 120]
WHEEL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/"


def _doctor(report: DoctorReport, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, highlight=False, soft_wrap=False, color_system=None)
    emit(report, console=console)
    return console.file.getvalue()


# each: a machine, and the commands its fixes hold (written out here, not taken from the code that builds them)
MACHINES = {
    "no GPU": (cpu_env(), [WHEEL + "cu130"]),
    "driver 535 under a cu130 build": (cuda_env(driver="535.104.05"), [WHEEL + "cu126"]),
    "the CPU build on a GPU machine": (cuda_env(torch_changes={"cuda": None, "version": "2.13.0+cpu"}),
                                       [WHEEL + "cu130"]),
    "no cuDNN nor NCCL": (cuda_env(torch_changes={"cudnn_version": None, "nccl_version": None}),
                          ["pip install --force-reinstall torch==2.13.0"] * 2),
    "no Triton": (cuda_env(triton_version=None), ["pip install triton==3.6.0"] * 2),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("machine", list(MACHINES))
def test_doctor_prints_a_fixs_command_whole_on_its_own_line(machine, width):
    """At 80 columns the no-GPU fix read '... (R580 or newer) and pip install torch==2.13.0' / '--index-url
    https://download.pytorch.org/whl/cu130': the command in two pieces, mid-sentence. Now it is a line of its own,
    whole (wider than the terminal it overflows, as every command does), the prose around it wrapped at spaces,
    and the finding reads as before, in order, nothing left out."""
    env, commands = MACHINES[machine]
    report = diagnose(env)
    out = _doctor(report, width)
    lines = [line.strip() for line in out.splitlines()]
    assert sorted(line for line in lines if line.startswith(("pip ", "python "))) == sorted(commands), out
    assert all(len(line) <= width for line in out.splitlines() if line.strip() not in commands), out
    said = "".join(out.split())  # a word wider than a line is cut where a terminal would fold it: no spaces
    for f in report.findings:
        assert "".join(f.message.split()) in said
        if f.fix:
            assert "".join(f"fix: {f.fix}".split()) in said, f.fix


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_prints_a_python_one_liner_whole_too(width):
    """The MPS fix holds a ``python -c '...'`` whose quoted code has spaces: wrapped, it could not be pasted."""
    env = cpu_env(torch=replace(cpu_env().torch, mps_built=True, mps_available=False), os="Darwin", machine="arm64")
    finding = check_gpu(env)
    command = "python -c 'import platform; print(platform.machine())'"
    assert finding is not None and command in finding.fix
    out = _doctor(DoctorReport(findings=(finding,)), width)
    assert command in [line.strip() for line in out.splitlines()], out
    assert all(len(line) <= width for line in out.splitlines() if line.strip() != command), out
    assert "must print arm64" in " ".join(out.split())


def test_a_fix_without_a_command_is_laid_out_as_before():
    """A fix of prose only is wrapped beside its check as it was (the one place a command changes the layout)."""
    report = DoctorReport(findings=(Finding(check="precision", status="warn", message="TF32 matmul is off",
                                            fix="call torch.set_float32_matmul_precision('high') at the start of "
                                                "training, or train in bf16-mixed"),))
    assert _doctor(report, 60).splitlines() == [
        "gpuwise doctor",
        "warn  precision  TF32 matmul is off",
        "                 fix: call",
        "                 torch.set_float32_matmul_precision('high')",
        "                 at the start of training, or train in",
        "                 bf16-mixed",
        "0 failed, 1 warnings, 0 ok: stack OK"]


@pytest.mark.parametrize(("fix", "parts"), [
    ("pip install torch==2.13.0 (add --index-url for a CUDA build, see pytorch.org)",
     ["pip install torch==2.13.0", "(add --index-url for a CUDA build, see pytorch.org)"]),
    ("a CUDA library is missing or shadowed: remove cuda/cudnn folders from LD_LIBRARY_PATH, or reinstall: pip "
     "install --force-reinstall torch==2.13.0",
     ["a CUDA library is missing or shadowed: remove cuda/cudnn folders from LD_LIBRARY_PATH, or reinstall:",
      "pip install --force-reinstall torch==2.13.0"]),
    ("fix the driver finding above if there is one; otherwise run nvidia-smi and python -c 'import torch; "
     "torch.cuda.init()' to see the error",
     ["fix the driver finding above if there is one; otherwise run nvidia-smi and",
      "python -c 'import torch; torch.cuda.init()'", "to see the error"]),
    ("without one: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, or keep it",
     ["without one:", "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu", ", or keep it"]),
    ("pip install triton-windows", ["pip install triton-windows"]),
    ("set PYTORCH_ALLOC_CONF=expandable_segments:True", ["set PYTORCH_ALLOC_CONF=expandable_segments:True"]),
])
def test_a_fix_is_split_into_its_prose_and_its_commands(fix, parts):
    """Where a command in a fix starts and ends: its options and their values, its package (or code), and no word
    of the prose after it, nor the punctuation that ends it."""
    from gpuwise.render._common import Whole
    from gpuwise.render.doctor import fix_parts

    got = fix_parts(fix)
    assert got == parts
    assert [isinstance(p, Whole) for p in got] == [p.startswith(("pip ", "python ")) for p in parts]


def test_a_fields_value_is_not_printed_in_its_keys_style():
    """``print_fields`` shows the key bold and the value plain: the key's style once spread to the whole line (``key +
    Text(...)`` keeps the key's base style), so every value of watch's end summary printed bold on a terminal."""
    import io

    from rich.console import Console

    from gpuwise.render._common import print_fields

    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system="standard")
    print_fields(console, [("step", "300 ms")])
    text = out.getvalue()
    assert "\x1b[1mstep" in text  # the key bold
    between = text[text.index("step"):text.index("300 ms")]
    assert "\x1b[0m" in between, repr(text)  # the bold ends before the value (it was "\x1b[1mstep    300 ms\x1b[0m")
