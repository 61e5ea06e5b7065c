"""``gpuwise watch``: the live status pinned under the command's output, the summary, and the JSON."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.render._common import Whole, print_fields, wrap
from gpuwise.units import human_bytes

if TYPE_CHECKING:
    from gpuwise.monitor.samples import DeviceSample, HostSample
    from gpuwise.monitor.watch import Tick, WatchResult, WatchStart

MAX_PANEL_SHARE = 3  # the panel takes at most a third of the terminal's rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}%"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2 ** 30:.1f}"


def _throttles(d: DeviceSample) -> list[str]:
    from gpuwise.monitor.nvml import THROTTLING

    return [r for r in (d.clock_reasons or ()) if r in THROTTLING]


@dataclass(frozen=True)
class _Unit:
    """A piece of a panel row kept whole on a line ("mem 61.0/80.0 GiB"): the separator before it, left out where
    the piece starts a line, and how much it matters where the row has more than its lines hold: 0 is
    always shown, the highest goes first."""

    text: Text
    sep: str = "  "
    priority: int = 0


def _unit(text: str, sep: str = "  ", priority: int = 0, style: str = "") -> _Unit:
    return _Unit(Text(text, style=style), sep, priority)


def _name(d: DeviceSample) -> str:
    return (d.name or "").removeprefix("NVIDIA ")


def _device_units(d: DeviceSample, used: bool | None, name_width: int = 0) -> list[_Unit]:
    """One GPU: its name, duty cycle and memory (the command's share) always; then its SMs' activity, why its clock
    is held, its heat, its power, and last its SM clock. ``name_width``: names padded to it (one-line rows align)."""
    units = [_Unit(Text.assemble((f"GPU{d.index}" + ("*" if used else " "), "bold"), f" {_name(d):<{name_width}}"),
                   "")]
    util = d.util_pct
    units.append(_unit(f"util {_pct(util):>4}", " ", style="yellow" if util is not None and util < 50 else ""))
    if d.sm_active_pct is not None:
        units.append(_unit(f"(SM {d.sm_active_pct:.0f}%)", " ", 1))
    units.append(_unit(f"mem {_gib(d.memory_used_bytes)}/{_gib(d.memory_total_bytes)} GiB"))
    if d.process_memory_bytes is not None:
        units.append(_unit(f"(cmd {_gib(d.process_memory_bytes)})", " "))
    if d.power_w is not None:
        units.append(_unit(f"{d.power_w:.0f}" + (f"/{d.power_limit_w:.0f}" if d.power_limit_w else "") + " W",
                           priority=2))
    if d.sm_clock_mhz is not None:
        units.append(_unit(f"SM {d.sm_clock_mhz:.0f}" + (f"/{d.sm_clock_max_mhz:.0f}" if d.sm_clock_max_mhz else "")
                           + " MHz", priority=3))
    for n, reason in enumerate(_throttles(d)):  # each whole on a line: "power cap (software), thermal (hardware)"
        units.append(_unit(reason, ", " if n else " ", 1, "bold red"))
    if d.temperature_c is not None:
        hot = d.temperature_slowdown_c is not None and d.temperature_c >= d.temperature_slowdown_c - 5
        units.append(_unit(f"{d.temperature_c:.0f}°C", priority=1 if hot else 2, style="red" if hot else ""))
    return units


def _host_units(h: HostSample | None) -> list[_Unit]:
    """The CPU side: cores busy always; then the command's share, memory and I/O wait; its workers last."""
    units = [_Unit(Text("CPU", style="bold"), "")]
    if h is None:
        return [*units, _unit("-")]
    if h.cpu_pct:
        units.append(_unit(f"{sum(h.cpu_pct) / 100:.1f}/{len(h.cpu_pct)} cores busy"))
    if h.process_cpu_pct is not None:
        units.append(_unit(f"cmd {h.process_cpu_pct:.0f}%", priority=1))
    if h.workers:
        units.append(_unit(f"{h.workers} worker{'s' if h.workers != 1 else ''} {_pct(h.workers_cpu_pct)}", " + ",
                           2))
    if h.memory_used_bytes is not None:
        units.append(_unit(f"mem {_gib(h.memory_used_bytes)}/{_gib(h.memory_total_bytes)} GiB", priority=1))
    if h.iowait_pct is not None and h.iowait_pct >= 10:
        units.append(_unit(f"iowait {h.iowait_pct:.0f}%", priority=1, style="yellow"))
    return units


def _head_units(tick: Tick, shown: tuple[int, int] | None = None) -> list[_Unit]:
    """The header: the time and the last step always, then its data wait, the pid, the samples; ``shown``: (GPUs
    shown, GPUs) where the panel has no room for them all."""
    units = [_Unit(Text("gpuwise watch", style="bold cyan"), ""), _unit(f"pid {tick.pid}", " · ", 2),
             _unit(f"{tick.t:.0f} s", " · "), _unit(f"{tick.samples} samples", " · ", 3)]
    step = tick.last_step
    if step is not None:
        units.append(_unit(f"step {step.step}: {step.seconds * 1e3:.0f} ms", " · "))
        if step.seconds > 0:
            share = step.data_wait_s / step.seconds
            units.append(_unit(f"data wait {100 * share:.0f}%", ", ", 1, "yellow" if share >= 0.3 else ""))
    if shown is not None:
        units.append(_unit(f"{shown[0]} of {shown[1]} GPUs shown", " · ", style="dim"))
    return units


def _pack(units: Sequence[_Unit], width: int) -> list[Text]:
    """The pieces in order, in lines at most ``width`` wide: a piece goes beside the one before where it fits, else
    on the next line, indented by two; a piece wider than a line breaks at its spaces (``wrap``: only a word wider
    than the whole line is cut, where a terminal would fold it)."""
    lines: list[Text] = []
    line: Text | None = None
    for u in units:
        if line is not None and line.cell_len + len(u.sep) + u.text.cell_len <= width:
            line = Text.assemble(line, u.sep, u.text)  # assembled: ``a + b`` would give all of it a's style
            continue
        first = line is None
        if line is not None:
            lines.append(line)
        line = Text.assemble("" if first else "  ", u.text)
        if line.cell_len > width:
            *head, line = wrap(line, width, indent=2 if first else 0)
            lines += head
    if line is not None:
        lines.append(line)
    for text in lines:
        text.rstrip()
    return lines


def _fit(units: Sequence[_Unit], width: int, lines: int) -> list[Text]:
    """The pieces in at most ``lines`` lines (``_pack``): where they need more, the least important go, the
    rightmost first among equals, until the rest fit. Those of priority 0 always stay: the panel's shape has room
    for them at their widest (``_Shape``)."""
    units = list(units)
    packed = _pack(units, width)
    while len(packed) > lines and any(u.priority for u in units):
        del units[max(range(len(units)), key=lambda i: (units[i].priority, i))]
        packed = _pack(units, width)
    return packed


def status_lines(tick: Tick, *, max_gpus: int = 8, width: int | None = None) -> list[Text]:
    """The live view of one sample: a header (pid, time, steps), one row per GPU, one for the host; each row a line,
    or, given a ``width`` it does not fit, folded at its pieces onto as many lines as it needs."""
    return [line for units in _rows(tick, max_gpus) for line in _pack(units, width or 10 ** 6)]


def _rows(tick: Tick, shown: int) -> list[list[_Unit]]:
    """The pieces of each row of ``tick``'s view, the panel's and ``status_lines``': the header, the first ``shown``
    GPUs, the host."""
    devices = tick.sample.devices
    hidden = (shown, len(devices)) if len(devices) > shown else None
    pad = max((len(_name(d)) for d in devices[:shown]), default=0)
    return [_head_units(tick, hidden), *(_device_units(d, bool(d.process_memory_bytes), pad) for d in devices[:shown]),
            _host_units(tick.sample.host)]


@dataclass(frozen=True)
class _Shape:
    """The panel's rows: lines for the header, for each GPU shown, and for the host; decided by the terminal's size
    and the GPUs, not by the figures, so the panel keeps its height while they change."""

    head: int
    gpu: int
    host: int
    shown: int

    @property
    def height(self) -> int:
        return self.head + self.shown * self.gpu + self.host


def _widest(pid: int, gpus: int, tick: Tick | None, *, long: bool = False) -> Tick:
    """The sample the panel is sized for: ``tick``'s GPUs and host (before the first, a typical machine's), every
    figure at its widest and every field there, one reason the clock is held: a row that fits this keeps its lines
    while the figures change (a second reason or an I/O wait pushes the least important pieces out instead).
    ``long``: the counts of a run of weeks (its time, its step), for the pieces that are never left out."""
    from gpuwise.monitor.samples import DeviceSample, HostSample, Sample, StepEvent
    from gpuwise.monitor.watch import Tick

    sample = tick.sample if tick is not None else None
    devices = (sample.devices if sample is not None and sample.devices else
               tuple(DeviceSample(index=i, name="H100 80GB HBM3", memory_total_bytes=80 * 2 ** 30)
                     for i in range(gpus)))
    devices = tuple(replace(d, util_pct=100.0, sm_active_pct=100.0, memory_used_bytes=d.memory_total_bytes,
                            process_memory_bytes=d.memory_total_bytes, power_w=d.power_limit_w or 1000.0,
                            power_limit_w=d.power_limit_w or 1000.0, sm_clock_mhz=d.sm_clock_max_mhz or 3000.0,
                            sm_clock_max_mhz=d.sm_clock_max_mhz or 3000.0, clock_reasons=("power brake (hardware)",),
                            temperature_c=100.0) for d in devices)
    host = sample.host if sample is not None and sample.host is not None else None
    cores = len(host.cpu_pct) if host is not None and host.cpu_pct else os.cpu_count() or 1
    total = host.memory_total_bytes if host is not None and host.memory_total_bytes else 1024 * 2 ** 30
    host = HostSample(cpu_pct=(100.0,) * cores, memory_used_bytes=total, memory_total_bytes=total,
                      process_cpu_pct=100.0 * cores, workers=99, workers_cpu_pct=100.0 * cores)
    wide = 10 ** 7 - 1 if long else 9999  # 116 days in seconds, or 2.8 hours
    step = StepEvent(step=wide * 10, t=0.0, seconds=wide / 100, data_wait_s=wide / 100)
    return Tick(t=wide, sample=Sample(t=wide, devices=devices, host=host), samples=9999, steps=wide * 10,
                last_step=step, pid=pid)


def _shape(pid: int, gpus: int, tick: Tick | None, width: int, budget: int) -> _Shape | None:
    """Rows for ``gpus`` GPUs at ``width`` in at most ``budget`` lines: each part as many as its pieces need at their
    widest (``_widest``; those of priority 0 at a long run's), the header as its pieces of priority 0 and 1 need (its
    pid and sample count fill what room is left). Where the budget cannot hold every GPU so, the rows are sized for
    their pieces of priority 0 and 1, then 0 only (the others fill what room is left on those lines); where it still
    cannot, as many GPUs as it can hold, with the most detail that shows that many (the header says how many). None
    where even the header and the host do not fit."""
    typical, long = _widest(pid, gpus, tick), _widest(pid, gpus, tick, long=True)
    pad = max((len(_name(d)) for d in typical.sample.devices[:gpus]), default=0)

    def need(part: Callable[[Tick], list[list[_Unit]]], keep: int) -> int:
        rows = [[u for u in units if u.priority <= keep] for units in part(typical)]
        rows += [[u for u in units if not u.priority] for units in part(long)]
        return max((len(_pack(units, width)) for units in rows), default=0)

    def devices(t: Tick) -> list[list[_Unit]]:
        return [_device_units(d, True, pad) for d in t.sample.devices[:gpus]]

    best = None
    for keep in (3, 1, 0):
        gpu, host = need(devices, keep), need(lambda t: [_host_units(t.sample.host)], keep)
        head = need(lambda t: [_head_units(t)], min(keep, 1))
        shown = min(gpus, max(0, (budget - head - host) // max(gpu, 1)))
        if shown < gpus:  # the header says how many it shows
            head = need(lambda t: [_head_units(t, (gpus, gpus))], min(keep, 1))
            shown = min(gpus, max(0, (budget - head - host) // max(gpu, 1)))
        if head + host <= budget and (best is None or shown > best.shown):
            best = _Shape(head=head, gpu=gpu, host=host, shown=shown)
        if best is not None and best.shown == gpus:
            break
    return best


def _frame(tick: Tick, shape: _Shape, width: int) -> list[Text]:
    """``tick`` in the panel's rows: each part in its lines (``_fit``), a blank line where it needs fewer."""
    rows = _rows(tick, shape.shown)
    heights = [shape.head, *[shape.gpu] * (len(rows) - 2), shape.host]
    lines: list[Text] = []
    for units, n in zip(rows, heights, strict=True):
        fitted = _fit(units, width, n)
        lines += fitted[:n] + [Text()] * (n - len(fitted))
    return lines


class WatchPanel:
    """The live status, pinned to the bottom rows of the terminal while the command's output scrolls above it.

    Why not rich's Live: the command writes straight to the terminal (its output stays a TTY: colours, progress bars,
    line buffering, all as without gpuwise). Live redraws by moving the cursor up over its last frame, so any line
    the command printed in between would be overwritten and half a frame left behind. Instead the panel shrinks the
    terminal's scrolling region by its height (DECSTBM, as apt's progress bar does) and draws in the rows below it,
    saving and restoring the cursor around each frame: the command's output scrolls untouched in the region above.
    At the end the region is reset and the rows cleared (the panel is transient). The lines are rendered with rich.

    Its height is set by the terminal's size and the GPUs (``_Shape``), never by the figures: a row that does not
    fit the width folds onto lines of its own, sized for its widest figures, and where the figures need more the
    least important pieces give way; nothing is cut with "…" (the summary at the end shows everything).
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.height = 0
        self.rows = 0
        self.shape: _Shape | None = None
        self.sized: tuple[Any, ...] = ()  # what the shape was decided from: the terminal's size, the GPUs' names
        self.pid = 0
        self.gpus = 0

    def _write(self, text: str) -> None:
        f = self.console.file
        f.write(text)
        f.flush()

    def start(self, start: WatchStart) -> None:
        self.pid, self.gpus = start.pid, max(0, start.gpus)
        self._resize(None)

    def _room(self) -> int:
        """The panel's width: the terminal's less its last column (a character there can scroll the screen)."""
        return max(self.console.size.width - 1, 1)

    def _resize(self, tick: Tick | None) -> None:
        """Decide the panel's rows for the terminal's size and ``tick``'s GPUs (before the first, typical ones),
        and reserve them anew where they changed: the last rows of the terminal, a third of them at most; none
        where that is too few."""
        rows, width = self.console.size.height, self._room()
        self.sized = (rows, width, None if tick is None else tuple(d.name for d in tick.sample.devices))
        gpus = self.gpus if tick is None else len(tick.sample.devices)
        shape = None
        if rows // MAX_PANEL_SHARE >= 2:
            shape = _shape(self.pid, gpus, tick, width, rows // MAX_PANEL_SHARE)
        height = 0 if shape is None else shape.height
        if height == self.height and rows == self.rows:  # the same rows: drawn over as they are
            self.shape = shape
            return
        if self.height:
            # the old rows cleared first where the terminal kept its height (else they are where it put them)
            clear = f"\033[{self.rows - self.height + 1};1H\033[J" if rows == self.rows else ""
            self._write("\0337" + clear + "\033[r\0338")
        self.shape, self.height = shape, height
        if height:
            self._reserve(rows)

    def _reserve(self, rows: int) -> None:
        """Scroll ``height`` blank lines up (the screen's last lines stay visible), set the scrolling region above the
        panel, and put the cursor back where the output goes on."""
        self.rows = rows
        h = self.height
        # newlines first: DECSTBM moves the cursor home, and the cursor must end inside the region
        self._write("\n" * h + "\0337" + f"\033[1;{rows - h}r" + "\0338" + f"\033[{h}A")

    def update(self, tick: Tick) -> None:
        if not self.sized:
            return
        if self.sized != (self.console.size.height, self._room(), tuple(d.name for d in tick.sample.devices)):
            self._resize(tick)  # resized, or the first sample: its GPUs' names, not a typical one's
        if not self.height or self.shape is None:
            return
        lines = _frame(tick, self.shape, self._room())
        frame = ["\0337"]
        for i in range(self.height):
            frame.append(f"\033[{self.rows - self.height + 1 + i};1H\033[2K")
            if i < len(lines):
                with self.console.capture() as cap:
                    self.console.print(lines[i], end="", no_wrap=True, overflow="fold", crop=False)
                frame.append(cap.get())
        frame.append("\0338")
        self._write("".join(frame))

    def stop(self) -> None:
        self.sized = ()
        if not self.height:
            return
        top = self.rows - self.height + 1
        self._write(f"\0337\033[r\033[{top};1H\033[J\0338")
        self.height = 0


# -- the summary -------------------------------------------------------------------------------------------------


def _command(r: WatchResult) -> str:
    return shlex.join(r.command) if r.command is not None else f"pid {r.pid}"


def _exit(r: WatchResult) -> str:
    if r.exit_code is None:
        return "attached: " + ("stopped watching (Ctrl-C)" if r.interrupted else "the process ended")
    if r.exit_code == 0:
        return "0"
    why = "interrupted" if r.interrupted else "the command failed"
    if r.exit_code > 128:
        import signal

        names = {int(s): s.name for s in signal.Signals}
        if r.exit_code - 128 in names:
            why += f", {names[r.exit_code - 128]}"
    return f"{r.exit_code} ({why})"


def _device_text(row: dict[str, Any]) -> str:
    parts = [f"util {_pct(row['util_median_pct'])} median"]
    if row["memory_peak_bytes"] is not None:
        mem = f"memory peak {human_bytes(row['memory_peak_bytes'])} of {human_bytes(row['memory_total_bytes'])}"
        if row["process_memory_peak_bytes"] is not None:
            mem += f" (the command {human_bytes(row['process_memory_peak_bytes'])})"
        parts.append(mem)
    if row["power_median_w"] is not None:
        parts.append(f"power {row['power_median_w']:.0f} W median" +
                     (f" of {row['power_limit_w']:.0f} W" if row["power_limit_w"] else ""))
    if row["sm_clock_median_mhz"] is not None:
        parts.append(f"SM {row['sm_clock_median_mhz']:.0f}" +
                     (f"/{row['sm_clock_max_mhz']:.0f}" if row["sm_clock_max_mhz"] else "") + " MHz")
    if row["temperature_max_c"] is not None:
        parts.append(f"{row['temperature_max_c']:.0f}°C max")
    if row["throttle_reasons"]:
        parts.append("clocks held: " + ", ".join(row["throttle_reasons"]))
    return " · ".join(parts)


def _host_text(h: dict[str, Any]) -> str:
    parts = []
    if h["busy_cores_median"] is not None:
        parts.append(f"{h['busy_cores_median']:.1f} of {h['cores']} cores busy (median)")
    if h["process_cpu_median_pct"] is not None:
        cmd = f"the command {h['process_cpu_median_pct']:.0f}% of a core"
        if h["workers_max"]:
            cmd += f", {h['workers_max']:.0f} child processes {_pct(h['workers_cpu_median_pct'])}"
        parts.append(cmd)
    if h["memory_peak_bytes"] is not None:
        parts.append(f"memory peak {human_bytes(h['memory_peak_bytes'])} of {human_bytes(h['memory_total_bytes'])}")
    return " · ".join(parts) or "-"


def _rss_text(m: dict[str, Any]) -> str | None:
    """The command's own memory: its resident set now and at peak, and torch's allocator where sampled."""
    parts = []
    if m.get("process_rss_bytes") is not None:
        parts.append(f"RSS {human_bytes(m['process_rss_bytes'])} at the end, peak "
                     f"{human_bytes(m['process_rss_peak_bytes'])}")
    if m.get("allocator_allocated_bytes") is not None:
        parts.append(f"allocator {human_bytes(m['allocator_allocated_bytes'])} allocated, "
                     f"{human_bytes(m['allocator_reserved_bytes'])} reserved")
    return " · ".join(parts) or None


def _ranks_text(ranks: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One row per rank: its steps, median step, and the communication it waited for."""
    rows = []
    for r in ranks:
        text = f"{r['steps']} steps"
        if r["step_median_s"] is not None:
            text += f", {_ms(r['step_median_s'])} median"
        if r["exposed_comm_median_s"] is not None:
            text += f", waits {_ms(r['exposed_comm_median_s'])} on communication, own work " \
                    f"{_ms(r['own_work_median_s'])}"
        rows.append((f"rank {r['rank']}", text))
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _steps_text(s: dict[str, Any]) -> str:
    if not s["count"]:
        return "none seen (a loop timed with gpuwise.Monitor reports its steps and data wait to watch)"
    text = f"{s['count']}"
    if s["step_median_s"] is not None:
        text += f", {_ms(s['step_median_s'])} median"
        if s.get("step_p95_s") is not None and s.get("step_max_s") is not None:
            text += f" (p95 {_ms(s['step_p95_s'])}, max {_ms(s['step_max_s'])})"
    if s.get("items_per_s") is not None:
        text += f", {s['items_per_s']:,.3g} samples/s over wall clock"
    elif s.get("steps_per_s") is not None:
        text += f", {s['steps_per_s']:,.3g} steps/s over wall clock"
    if s["data_wait_share_median"] is not None:
        text += f", data wait {100 * s['data_wait_share_median']:.0f}% of a step"
    if s["ooms"]:
        text += f", {s['ooms']} out-of-memory error{'s' if s['ooms'] > 1 else ''}"
    return text


def render_watch(r: WatchResult, console: Console) -> None:
    from gpuwise.monitor.watch import device_summary, host_summary, step_summary
    from gpuwise.render.diagnosis import render_lines

    command = Whole(_command(r)) if r.command is not None else _command(r)  # one line: it pastes as printed
    rows: list[tuple[str, str | Text]] = [
        ("command", command), ("exit code", _exit(r)),
        ("watched", f"{r.seconds:.1f} s, {len(r.record.samples)} samples every {r.record.interval_s:g} s")]
    for row in device_summary(r.record, r.devices_used):
        who = (row["name"] or "").removeprefix("NVIDIA ")
        if row["used"] is False:
            who += " (not the command's)"
        rows.append((f"GPU {row['index']}", (who + ": " if who else "") + _device_text(row)))
    rows.append(("host", _host_text(host_summary(r.record))))
    report = _report(r)
    memory = _rss_text(report["memory"])
    if memory:
        rows.append(("memory", memory))
    rows.append(("steps", _steps_text(step_summary(r.record))))
    ranks = report["ranks"]
    if len(ranks) > 1:
        rows.extend(_ranks_text(ranks))
    if r.log:
        rows.append(("log", r.log + (f" ({r.log_error})" if r.log_error else "")))
    for line in render_lines(r.diagnosis):
        key, _, text = line.partition(": ")
        rows.append((key, text) if text and " " not in key.strip() else ("", line.strip()))
    # wrapped at spaces, never inside a word: the command is one line (it pastes as printed), a long path or URL
    # goes under its key whole
    print_fields(console, rows, title=Text("gpuwise watch", style="italic"))


def _report(r: WatchResult) -> dict[str, Any]:
    """The result's report as JSON (built here for a result made without one)."""
    if r.report is not None:
        return r.report.to_dict()
    from gpuwise.monitor.report import build_report

    return build_report(r.record, r.diagnosis, used=r.devices_used).to_dict()


def watch_json(r: WatchResult) -> dict[str, Any]:
    """command, pid, exit_code, seconds, samples, the per-device, host and step summaries, the note, the
    diagnosis in the monitor's JSON form, and ``report``: what ``Monitor.report()`` returns (``monitor.report``:
    judged or not, step median/p95/max, wall-clock samples/s, process RSS, per rank)."""
    from gpuwise.monitor.watch import device_summary, host_summary, step_summary
    from gpuwise.render.diagnosis import diagnosis_json

    return {"command": None if r.command is None else list(r.command), "pid": r.pid, "exit_code": r.exit_code,
            "seconds": round(r.seconds, 3), "interrupted": r.interrupted, "samples": len(r.record.samples),
            "interval_s": r.record.interval_s, "device": r.record.device_kind,
            "devices_used": list(r.devices_used), "devices": device_summary(r.record, r.devices_used),
            "host": host_summary(r.record), "steps": step_summary(r.record), "note": r.note, "log": r.log,
            "log_error": r.log_error, "metrics_url": r.metrics_url, "diagnosis": diagnosis_json(r.diagnosis),
            "report": _report(r)}


__all__ = ["WatchPanel", "render_watch", "status_lines", "watch_json"]
