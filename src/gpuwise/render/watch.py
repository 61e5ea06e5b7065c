"""``gpuwise watch``: the live status pinned under the command's output, the summary, and the JSON."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.render._common import Whole, print_fields
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


def _device_line(d: DeviceSample, used: bool | None) -> Text:
    """One GPU in one line: duty cycle, memory (the command's share), power, SM clock and why it is held, heat."""
    line = Text()
    line.append(f"GPU{d.index}" + ("*" if used else " "), style="bold")
    line.append(f" {(d.name or '').removeprefix('NVIDIA ')[:18]:<18}")
    util = d.util_pct
    line.append(f" util {_pct(util):>4}", style="yellow" if util is not None and util < 50 else "")
    if d.sm_active_pct is not None:
        line.append(f" (SM {d.sm_active_pct:.0f}%)")
    line.append(f"  mem {_gib(d.memory_used_bytes)}/{_gib(d.memory_total_bytes)} GiB")
    if d.process_memory_bytes is not None:
        line.append(f" (cmd {_gib(d.process_memory_bytes)})")
    if d.power_w is not None:
        line.append(f"  {d.power_w:.0f}" + (f"/{d.power_limit_w:.0f}" if d.power_limit_w else "") + " W")
    if d.sm_clock_mhz is not None:
        line.append(f"  SM {d.sm_clock_mhz:.0f}" + (f"/{d.sm_clock_max_mhz:.0f}" if d.sm_clock_max_mhz else "")
                    + " MHz")
    held = _throttles(d)
    if held:
        line.append(" " + ", ".join(held), style="bold red")
    if d.temperature_c is not None:
        hot = d.temperature_slowdown_c is not None and d.temperature_c >= d.temperature_slowdown_c - 5
        line.append(f"  {d.temperature_c:.0f}°C", style="red" if hot else "")
    return line


def _host_line(h: HostSample | None) -> Text:
    line = Text()
    line.append("CPU  ", style="bold")
    if h is None:
        return line.append("-")
    if h.cpu_pct:
        line.append(f"{sum(h.cpu_pct) / 100:.1f}/{len(h.cpu_pct)} cores busy")
    if h.process_cpu_pct is not None:
        line.append(f"  cmd {h.process_cpu_pct:.0f}%")
    if h.workers:
        line.append(f" + {h.workers} worker{'s' if h.workers != 1 else ''} "
                    f"{_pct(h.workers_cpu_pct)}")
    if h.memory_used_bytes is not None:
        line.append(f"  mem {_gib(h.memory_used_bytes)}/{_gib(h.memory_total_bytes)} GiB")
    if h.iowait_pct is not None and h.iowait_pct >= 10:
        line.append(f"  iowait {h.iowait_pct:.0f}%", style="yellow")
    return line


def status_lines(tick: Tick, *, max_gpus: int = 8) -> list[Text]:
    """The live view of one sample: a header (pid, time, steps), one line per GPU, one for the host."""
    head = Text()
    head.append("gpuwise watch", style="bold cyan")
    head.append(f" · pid {tick.pid} · {tick.t:.0f} s · {tick.samples} samples")
    step = tick.last_step
    if step is not None:
        head.append(f" · step {step.step}: {step.seconds * 1e3:.0f} ms")
        if step.seconds > 0:
            share = step.data_wait_s / step.seconds
            head.append(f", data wait {100 * share:.0f}%", style="yellow" if share >= 0.3 else "")
    devices = tick.sample.devices
    lines = [head]
    for d in devices[:max_gpus]:
        lines.append(_device_line(d, bool(d.process_memory_bytes)))
    if len(devices) > max_gpus:
        lines[-1].append(f"  (+{len(devices) - max_gpus} more GPUs)", style="dim")
    lines.append(_host_line(tick.sample.host))
    return lines


class WatchPanel:
    """The live status, pinned to the bottom rows of the terminal while the command's output scrolls above it.

    Why not rich's Live: the command writes straight to the terminal (its output stays a TTY: colours, progress bars,
    line buffering, all as without gpuwise). Live redraws by moving the cursor up over its last frame, so any line
    the command printed in between would be overwritten and half a frame left behind. Instead the panel shrinks the
    terminal's scrolling region by its height (DECSTBM, as apt's progress bar does) and draws in the rows below it,
    saving and restoring the cursor around each frame: the command's output scrolls untouched in the region above.
    At the end the region is reset and the rows cleared (the panel is transient). The lines are rendered with rich.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.height = 0
        self.rows = 0

    def _write(self, text: str) -> None:
        f = self.console.file
        f.write(text)
        f.flush()

    def start(self, start: WatchStart) -> None:
        rows = self.console.size.height
        want = 2 + max(0, start.gpus)  # header, one per GPU, host
        self.height = min(want, rows // MAX_PANEL_SHARE)
        if self.height < 2:  # a terminal too short for a panel: none
            self.height = 0
            return
        self._reserve(rows)

    def _reserve(self, rows: int) -> None:
        """Scroll ``height`` blank lines up (the screen's last lines stay visible), set the scrolling region above the
        panel, and put the cursor back where the output goes on."""
        self.rows = rows
        h = self.height
        # newlines first: DECSTBM moves the cursor home, and the cursor must end inside the region
        self._write("\n" * h + "\0337" + f"\033[1;{rows - h}r" + "\0338" + f"\033[{h}A")

    def update(self, tick: Tick) -> None:
        if not self.height:
            return
        rows = self.console.size.height
        if rows != self.rows:  # the terminal was resized: the region follows
            self._write("\0337\033[r\0338")
            if rows // MAX_PANEL_SHARE < 2:
                self.height = 0
                return
            self.height = min(self.height, rows // MAX_PANEL_SHARE)
            self._reserve(rows)
        lines = status_lines(tick, max_gpus=self.height - 2)[:self.height]
        width = self.console.size.width
        frame = ["\0337"]
        for i in range(self.height):
            frame.append(f"\033[{self.rows - self.height + 1 + i};1H\033[2K")
            if i < len(lines):
                text = lines[i].copy()
                text.truncate(width - 1, overflow="ellipsis")
                with self.console.capture() as cap:
                    self.console.print(text, end="", no_wrap=True, overflow="ellipsis", crop=True)
                frame.append(cap.get())
        frame.append("\0338")
        self._write("".join(frame))

    def stop(self) -> None:
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
