"""gpuwise watch: a command (or a pid) watched from outside, its exit code passed through, the loop's own events joined,
the log, the plot, the JSON, the live panel, a fake NVML, and the watcher's cost. All without a GPU."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import gpuwise.monitor.child as child_module
import gpuwise.monitor.watch as watch_module
from fakes.nvml import two_gpu_nvml
from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.monitor.samples import DeviceSample, HostSample, Sample, StepEvent, read_log
from gpuwise.monitor.watch import Tick, WatchStart, device_summary, watch
from gpuwise.render.watch import WatchPanel, status_lines, watch_json

PY = sys.executable
GiB = 2 ** 30


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def one_line_error(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# -- a command, its exit code, its samples -----------------------------------------------------------------------


def test_a_command_that_exits_0_is_sampled_and_the_cpu_side_is_said_once(capfd):
    code = main(["watch", "--interval", "0.05", "--", PY, "-c", "import time; time.sleep(0.4); print('child says hi')"])
    out, err = capfd.readouterr()
    assert code == 0
    assert "child says hi" in out  # the command's own output, straight through
    assert "exit code" in out and "bottleneck" in out
    notes = [line for line in err.splitlines() if "watching the CPU side" in line]
    assert len(notes) == 1 and notes[0].startswith("no NVIDIA or AMD GPU (")


def test_library_result_records_samples_until_the_command_ends():
    starts = []
    r = watch(py("import time; time.sleep(0.4)"), interval_s=0.05, on_start=starts.append)
    assert r.exit_code == 0 and not r.failed and r.command[0] == PY
    assert 0.35 < r.seconds < 2.0
    assert len(r.record.samples) >= 5
    assert all(s.host is not None and s.host.cpu_pct for s in r.record.samples)
    assert r.record.device_kind == "cpu" and r.note.endswith("watching the CPU side") and "\n" not in r.note
    assert r.diagnosis.note is None or "watching the CPU side" not in r.diagnosis.note  # said once, at the start
    assert len(starts) == 1 and starts[0].pid == r.pid and starts[0].gpus == 0
    assert "record=" not in repr(r)


def test_the_last_sample_comes_as_the_command_ends_not_an_interval_later():
    r = watch(py("import time; time.sleep(0.3)"), interval_s=5.0)
    assert r.seconds < 1.5  # a 5 s interval is not slept out after the command ended
    assert len(r.record.samples) == 2  # one at the start, one at the end


def test_exit_code_is_passed_through_and_the_diagnosis_still_printed(capfd):
    code = main(["watch", "--interval", "0.05", "--", PY, "-c", "import sys, time; time.sleep(0.2); sys.exit(3)"])
    out = capfd.readouterr().out
    assert code == 3
    assert "3 (the command failed)" in out and "bottleneck" in out


def test_a_command_killed_by_a_signal_exits_128_plus_n():
    r = watch(py("import os, signal; os.kill(os.getpid(), signal.SIGTERM)"), interval_s=0.05)
    assert r.exit_code == 128 + signal.SIGTERM and r.failed


def test_options_after_the_command_belong_to_the_command(capfd):
    code = main(["watch", "--interval", "0.05", PY, "-c", "import sys; sys.exit(len(sys.argv))", "--json", "x"])
    assert code == 3  # argv: -c, --json, x: watch did not take --json
    assert "exit code" in capfd.readouterr().out


# -- bad input: one line, exit 2, nothing run --------------------------------------------------------------------


def test_no_command_is_a_one_line_error(capfd):
    assert main(["watch"]) == 2
    assert "nothing to watch" in one_line_error(capfd)


def test_a_command_that_does_not_exist_is_a_one_line_error(capfd):
    assert main(["watch", "--", "gpuwise-no-such-program-xyz", "--flag"]) == 2
    assert "no such command: gpuwise-no-such-program-xyz" in one_line_error(capfd)
    assert main(["watch", "--", "./no/such/script.sh"]) == 2
    assert "no such command" in one_line_error(capfd)


def test_pid_of_a_dead_process_is_a_one_line_error(capfd):
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid is free
    assert main(["watch", "--pid", str(p.pid)]) == 2
    assert f"no running process {p.pid}" in one_line_error(capfd)
    assert main(["watch", "--pid", "0"]) == 2
    one_line_error(capfd)


def test_command_and_pid_together_is_an_error():
    with pytest.raises(GpuwiseError, match="not both"):
        watch(["true"], pid=os.getpid())


def test_unwritable_log_is_a_one_line_error_and_the_command_never_ran(tmp_path, capfd):
    marker = tmp_path / "ran"
    code = main(["watch", "--log", str(tmp_path / "no" / "such" / "dir" / "run.jsonl"), "--", PY, "-c",
                 f"open({str(marker)!r}, 'w').close()"])
    assert code == 2
    assert "cannot write the log" in one_line_error(capfd)
    time.sleep(0.2)
    assert not marker.exists()


def test_plot_path_refused_before_the_command_runs(tmp_path, capfd):
    marker = tmp_path / "ran"
    for plot in ("timeline.jpg", str(tmp_path / "missing" / "t.png")):
        assert main(["watch", "--plot", plot, "--", PY, "-c", f"open({str(marker)!r}, 'w').close()"]) == 2
        one_line_error(capfd)
    assert not marker.exists()


# -- --pid -------------------------------------------------------------------------------------------------------


def test_pid_of_a_live_process_records_until_it_ends():
    p = subprocess.Popen(["sleep", "30"])

    def stop():
        time.sleep(0.5)
        p.kill()
        p.wait()

    threading.Thread(target=stop, daemon=True).start()
    t = time.perf_counter()
    r = watch(pid=p.pid, interval_s=0.05)
    assert time.perf_counter() - t < 5
    assert r.command is None and r.pid == p.pid and r.exit_code is None
    assert len(r.record.samples) >= 4


def test_pid_ends_when_the_process_is_a_zombie_its_parent_has_not_reaped():
    p = subprocess.Popen(["sleep", "30"])
    threading.Timer(0.3, p.kill).start()  # killed, not waited for: a zombie until the end of the test
    try:
        r = watch(pid=p.pid, interval_s=0.05)
        assert r.seconds < 5 and r.record.samples
    finally:
        p.wait()


# -- Ctrl-C ------------------------------------------------------------------------------------------------------


def test_ctrl_c_reaches_the_command_and_what_was_recorded_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(child_module, "_tty_pgrp", lambda: None)  # no terminal sent it to the command: forward
    # a process started in the background (cmd &) ignores SIGINT, and so would the command it starts
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    log = tmp_path / "run.jsonl"
    threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        r = watch(py("import time; time.sleep(20)"), interval_s=0.05, log=log)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert r.interrupted and r.exit_code == 130 and r.seconds < 10  # Python dies of SIGINT: 128 + 2
    assert len(r.record.samples) >= 5
    assert read_log(log).samples == r.record.samples  # nothing lost


def test_a_terminal_ctrl_c_is_not_sent_twice(monkeypatch):
    child = subprocess.Popen(["sleep", "5"])
    try:
        monkeypatch.setattr(child_module, "_tty_pgrp", lambda: os.getpgrp())
        assert child_module.Signals._terminal_sent_it(child.pid)  # same group, the terminal's: it got it already
        monkeypatch.setattr(child_module, "_tty_pgrp", lambda: None)
        assert not child_module.Signals._terminal_sent_it(child.pid)
    finally:
        child.kill()
        child.wait()


# -- the loop's own events, the log --------------------------------------------------------------------------------

LOADER_CHILD = """
import time
from gpuwise.monitor.sampler import Monitor

def sleepy(n):
    for i in range(n):
        time.sleep(0.06)
        yield i

with Monitor(interval_s=0.05, gpus=False) as m:
    for _ in m.loader(sleepy(10)):
        time.sleep(0.01)
        m.step()
"""


def test_a_monitor_in_the_command_joins_its_steps_and_the_log_reads_back(tmp_path):
    log = tmp_path / "run.jsonl"
    before = set(Path(tempfile.gettempdir()).glob("gpuwise-watch-*"))
    r = watch(py(LOADER_CHILD), interval_s=0.1, log=log)
    assert r.exit_code == 0
    steps = r.record.steps
    assert [s.step for s in steps] == list(range(1, 11))
    for s in steps[1:]:
        assert 0.05 < s.data_wait_s < s.seconds < 0.5
    # on the watch's clock: each step ends within the watch, after the command started, in order
    assert all(0 < s.t <= r.seconds for s in steps) and [s.t for s in steps] == sorted(s.t for s in steps)
    assert r.record.extra["events_offset_s"] is not None and r.record.extra["events_offset_s"] >= 0
    assert r.diagnosis.bottleneck == "input-bound"
    back = read_log(log)
    assert back.samples == r.record.samples and back.steps == r.record.steps
    kinds = {json.loads(line)["kind"] for line in log.read_text().splitlines()}
    assert kinds == {"sample", "step"}
    assert set(Path(tempfile.gettempdir()).glob("gpuwise-watch-*")) <= before  # the events file is gone
    from gpuwise.plot import plot_watch

    plot_watch(r, tmp_path / "steps.png")  # the CPU side and a data-wait panel
    assert (tmp_path / "steps.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_events_written_before_a_pid_attach_are_skipped_and_new_ones_read(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind":"step","step":1,"t":0.5,"seconds":0.5}\n')
    ev = watch_module._Events(path, from_end=True)
    assert ev.read(now=10.0) == []
    with path.open("a") as f:
        f.write('{"kind":"step","step":2,"t":1.0,"seconds":0.5}\n{"kind":"step","step":3,"t":1.5,"sec')
    (two,) = ev.read(now=10.0)
    assert two.step == 2 and two.t == pytest.approx(10.0)  # offset 9.0 from its read time
    with path.open("a") as f:
        f.write('onds":0.5}\n')  # the rest of the half-written line
    (three,) = ev.read(now=10.5)
    assert three.step == 3 and three.t == pytest.approx(10.5)
    ev.close()


# -- a fake NVML ---------------------------------------------------------------------------------------------------


def test_fake_nvml_devices_summarised_and_the_used_gpu_found(tmp_path, capfd):
    watched: set[int] = set()
    nvml = two_gpu_nvml(watched)
    r = watch(py("import time; time.sleep(0.4)"), interval_s=0.05, nvml=nvml,
              on_start=lambda s: watched.add(s.pid))
    assert r.note is None and r.record.device_kind == "cuda"
    assert nvml.state["inits"] == 0 and nvml.state["reads"] >= 2 * 5  # NVML shut down; both GPUs read each sample
    assert r.devices_used == (0,)
    gpu0, gpu1 = device_summary(r.record, r.devices_used)
    assert gpu0["used"] is True and gpu1["used"] is False
    assert gpu0["util_median_pct"] == 80 and gpu0["power_median_w"] == pytest.approx(300)
    assert gpu0["power_limit_w"] == pytest.approx(700) and gpu0["memory_peak_bytes"] == 10 * GiB
    assert gpu0["process_memory_peak_bytes"] == 8 * GiB and gpu0["memory_total_bytes"] == 80 * GiB
    assert gpu0["sm_clock_median_mhz"] == 1980 and gpu0["temperature_max_c"] == 60
    assert gpu1["util_median_pct"] == 0 and gpu1["process_memory_peak_bytes"] is None
    data = watch_json(r)
    assert data["device"] == "cuda" and data["devices_used"] == [0] and len(data["devices"]) == 2
    assert data["diagnosis"]["evidence"] is not None
    # the plot with GPU panels
    from gpuwise.plot import plot_watch

    path = tmp_path / "gpu.png"
    plot_watch(r, path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_reader_object_stands_in_for_nvml():
    class Reader:
        indices = (0,)
        closed = False

        def read(self, pids):
            return (DeviceSample(index=0, util_pct=5.0, process_memory_bytes=GiB if pids else None),)

        def close(self):
            self.closed = True

    reader = Reader()
    r = watch(py("import time; time.sleep(0.2)"), interval_s=0.05, reader=reader)
    assert reader.closed and r.record.device_kind == "cuda" and r.devices_used == (0,)
    assert all(s.devices[0].util_pct == 5.0 for s in r.record.samples)


# -- --json, --plot ------------------------------------------------------------------------------------------------


def test_json_output_parses_and_has_the_fields(capfd):
    code = main(["watch", "--json", "--interval", "0.05", "--", PY, "-c", "import time; time.sleep(0.3)"])
    out, err = capfd.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["command"] == [PY, "-c", "import time; time.sleep(0.3)"] and data["exit_code"] == 0
    assert data["samples"] >= 3 and data["seconds"] > 0.25 and data["devices"] == []
    assert data["host"]["cores"] >= 1 and data["steps"]["count"] == 0
    assert data["note"].endswith("watching the CPU side")
    assert set(data["diagnosis"]) >= {"bottleneck", "evidence", "fix"} and isinstance(data["diagnosis"]["fix"], list)
    assert "watching the CPU side" not in err  # with --json the note is in the JSON, not on stderr


def test_plot_writes_a_png_of_the_cpu_side(tmp_path, capfd):
    path = tmp_path / "timeline.png"
    code = main(["watch", "--plot", str(path), "--interval", "0.05", "--", PY, "-c",
                 "x = sum(i * i for i in range(3_000_000))"])
    assert code == 0
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"timeline drawn to {path}" in capfd.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written atomically: no temporary left


# -- the live panel --------------------------------------------------------------------------------------------------


def tick(**device) -> Tick:
    d = DeviceSample(index=0, name="NVIDIA H100 80GB HBM3", util_pct=97.0, memory_used_bytes=61 * GiB,
                     memory_total_bytes=80 * GiB, process_memory_bytes=58 * GiB, power_w=690.0, power_limit_w=700.0,
                     sm_clock_mhz=1500.0, sm_clock_max_mhz=1980.0, clock_reasons=("power cap (software)",),
                     temperature_c=71.0, **device)
    host = HostSample(cpu_pct=(50.0, 100.0), memory_used_bytes=4 * GiB, memory_total_bytes=16 * GiB,
                      process_cpu_pct=104.0, workers=4, workers_cpu_pct=380.0)
    step = StepEvent(step=42, t=10.0, seconds=0.3, data_wait_s=0.12)
    return Tick(t=12.0, sample=Sample(t=12.0, devices=(d,), host=host), samples=24, steps=42, last_step=step,
                pid=1234)


def test_status_lines_show_gpu_host_and_step():
    head, gpu, host = (line.plain for line in status_lines(tick()))
    assert "pid 1234" in head and "step 42: 300 ms" in head and "data wait 40%" in head
    assert "util  97%" in gpu and "61.0/80.0 GiB (cmd 58.0)" in gpu and "690/700 W" in gpu
    assert "SM 1500/1980 MHz" in gpu and "power cap (software)" in gpu and "71°C" in gpu
    assert "1.5/2 cores busy" in host and "cmd 104%" in host and "4 workers 380%" in host


def test_the_panel_pins_itself_under_the_output_and_leaves_nothing_behind():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100, height=24, color_system=None)
    panel = WatchPanel(console)
    panel.start(WatchStart(pid=1234, command=("python", "train.py"), gpus=1, note=None))
    assert panel.height == 4  # at 100 columns the GPU row (116) folds to two lines
    panel.update(tick())
    panel.stop()
    out = buf.getvalue()
    assert "\x1b[1;20r" in out  # the scrolling region stops above the 4 panel rows
    assert "\x1b[21;1H" in out and "\x1b[24;1H" in out and "util  97%" in out
    assert out.endswith("\x1b7\x1b[r\x1b[21;1H\x1b[J\x1b8")  # region reset, rows cleared, cursor back
    tiny = WatchPanel(Console(file=io.StringIO(), force_terminal=True, width=80, height=5))
    tiny.start(WatchStart(pid=1, command=None, gpus=8, note=None))
    assert tiny.height == 0  # too short a terminal: no panel
    tiny.update(tick())
    tiny.stop()


# -- several ranks in one events file (torchrun) ------------------------------------------------------------------


def rank_events(rank: int, started: float, n: int, step_s: float) -> list[tuple[float, str]]:
    """A rank's step events as (watch time it was written, line); its Monitor started at watch time ``started``,
    its own ``t`` counts from there."""
    return [(started + (i + 1) * step_s, json.dumps({"kind": "step", "step": i + 1, "t": (i + 1) * step_s,
                                                     "seconds": step_s, "rank": rank})) for i in range(n)]


def feed(ev, lines: list[tuple[float, str]], path: Path, *, poll: float = watch_module.EVENT_POLL_S,
         busy: tuple[float, float] | None = None) -> list:
    """Append the lines in watch-time order and read the file every ``poll`` seconds, as the watch does: each read
    takes every line written since the last one. ``busy``: (from, to) watch times the watcher does not read in (a
    slow sensor): the lines written meanwhile are read late, at once."""
    out, ordered = [], sorted(lines)
    now = ordered[0][0] - poll / 2
    while ordered:
        now += poll
        if busy is not None and busy[0] <= now < busy[1]:
            continue
        due = [line for t, line in ordered if t <= now]
        ordered = [(t, line) for t, line in ordered if t > now]
        if due:
            with path.open("a") as f:
                f.write("".join(line + "\n" for line in due))
        out += ev.read(now=now)
    return out


def test_two_ranks_interleaved_in_one_events_file_each_keep_their_own_clock(tmp_path):
    # rank 0's Monitor started at watch time 1.0 with 0.2 s steps, rank 1's at 1.5 (it started later) with 0.15 s
    # steps: their lines interleave in the file, and rank 1's t restarts below rank 0's. From 2.4 s to 3.0 s the
    # watcher is busy (a slow sensor read): the lines of that time are read 0.6 s late. Each rank's offset, kept
    # from its earlier reads, still places them; one offset for both (reset at every interleaved line, each
    # estimate then from a single late read) put them up to 0.6 s late.
    path = tmp_path / "events.jsonl"
    path.touch()
    ev = watch_module._Events(path)
    lines = rank_events(0, 1.0, 12, 0.2) + rank_events(1, 1.5, 12, 0.15)
    truth = {(0, i + 1): 1.0 + (i + 1) * 0.2 for i in range(12)} | {(1, i + 1): 1.5 + (i + 1) * 0.15 for i in range(12)}
    got = feed(ev, lines, path, busy=(2.4, 3.0))
    assert len(got) == 24 and {s.rank for s in got} == {0, 1}
    assert [s.rank for s in got] != sorted(s.rank for s in got)  # the ranks came interleaved
    tol = watch_module.EVENT_POLL_S + 1e-9
    for s in got:  # each on the watch's clock within a poll (one offset for both would put rank 1 0.5 s off)
        assert truth[(s.rank, s.step)] <= s.t <= truth[(s.rank, s.step)] + tol
    assert 1.0 <= ev.offsets[0] <= 1.0 + tol and 1.5 <= ev.offsets[1] <= 1.5 + tol
    assert ev.offset == ev.offsets[0]  # the lowest rank's, for the record's "events_offset_s"
    ev.close()


def test_a_new_monitor_in_one_rank_resets_only_that_ranks_offset(tmp_path):
    path = tmp_path / "events.jsonl"
    path.touch()
    ev = watch_module._Events(path)
    tol = watch_module.EVENT_POLL_S + 1e-9
    feed(ev, rank_events(0, 1.0, 5, 0.2) + rank_events(1, 1.5, 5, 0.2), path)
    first = dict(ev.offsets)
    assert 1.0 <= first[0] <= 1.0 + tol and 1.5 <= first[1] <= 1.5 + tol
    # rank 0 starts a second Monitor at watch time 10.0 (its t starts over); rank 1 goes on with its clock
    again = rank_events(0, 10.0, 3, 0.2)
    more = [(1.5 + (i + 6) * 0.2 + 8.0, json.dumps({"kind": "step", "step": i + 6, "t": (i + 6) * 0.2 + 8.0,
                                                    "seconds": 0.2, "rank": 1})) for i in range(2)]
    got = feed(ev, again + more, path)
    assert 10.0 <= ev.offsets[0] <= 10.0 + tol and ev.offsets[1] == pytest.approx(first[1], abs=1e-9)
    for s, truth in zip([s for s in got if s.rank == 0], (10.2, 10.4, 10.6), strict=True):
        assert truth <= s.t <= truth + tol
    for s, truth in zip([s for s in got if s.rank == 1], (1.5 + 1.2 + 8.0, 1.5 + 1.4 + 8.0), strict=True):
        assert truth <= s.t <= truth + tol
    ev.close()


def test_the_watched_tree_counts_processes_the_command_starts():
    # two children started anew (as torchrun starts its ranks): in the tree, not counted as loader workers
    code = ("import subprocess, sys, time\n"
            "ps = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.2)']) for _ in range(2)]\n"
            "[p.wait() for p in ps]\n")
    r = watch(py(code), interval_s=0.1)
    assert r.exit_code == 0
    hosts = [s.host for s in r.record.samples if s.host is not None and s.host.tree_processes is not None]
    assert max(h.tree_processes for h in hosts) >= 3  # the command and its two children
    assert max(h.tree_threads for h in hosts) >= 3
    assert max(h.workers or 0 for h in hosts) == 0


RANKS_CHILD = """
import os, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp
from gpuwise.monitor.sampler import Monitor

def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torch
    t = torch.ones(1)
    time.sleep(0.3 * rank)  # rank 1's Monitor starts later: another clock
    with Monitor(interval_s=0.1, gpus=False) as m:
        for _ in range(8):
            time.sleep(0.05 + 0.05 * rank)  # rank 1 the straggler
            dist.all_reduce(t)
            m.step(items=4)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]),), nprocs=2)
"""


@pytest.mark.slow
def test_two_real_ranks_write_one_events_file_and_the_report_has_both(tmp_path):
    import socket

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_CHILD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = watch([PY, str(script), str(port)], interval_s=0.2)
    assert r.exit_code == 0
    by_rank = {k: [s for s in r.record.steps if s.rank == k] for k in (0, 1)}
    assert [len(v) for v in by_rank.values()] == [8, 8]
    for steps in by_rank.values():  # each rank on the watch's clock, in its order, within the watch
        assert [s.t for s in steps] == sorted(s.t for s in steps) and all(0 < s.t <= r.seconds for s in steps)
    # the collective ties the ranks: step k ends at about the same time on both (within the read delay and a step)
    for a, b in zip(by_rank[0], by_rank[1], strict=True):
        assert abs(a.t - b.t) < 0.2
    ranks = {x.rank: x for x in r.report.ranks}
    assert set(ranks) == {0, 1} and r.report.throughput.items == 64
    assert max(h.host.tree_processes for h in r.record.samples if h.host and h.host.tree_processes) >= 3


# -- the report in --json, the summary, the plot panels ---------------------------------------------------------------


def test_json_has_the_report_with_judged_p95_wall_throughput_and_rss(capfd):
    child = LOADER_CHILD.replace("m.step()", "m.step(items=8)")
    code = main(["watch", "--json", "--interval", "0.05", "--", PY, "-c", child])
    out = capfd.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["steps"]["count"] == 10 and data["diagnosis"]["bottleneck"] == "input-bound"  # old keys kept
    rep = data["report"]
    assert rep["judged"] is True and rep["bottleneck"] == "input-bound" and rep["missing"] == []
    st, tp = rep["steps"], rep["throughput"]
    assert st["count"] == 10 and st["median_s"] <= st["p95_s"] <= st["max_s"]
    assert tp["items"] == 80 and tp["items_per_s"] == pytest.approx(80 / tp["wall_s"])
    assert data["steps"]["items_per_s"] == tp["items_per_s"] and data["steps"]["step_p95_s"] == st["p95_s"]
    assert rep["memory"]["process_rss_bytes"] > 10 * 2 ** 20
    assert rep["memory"]["process_rss_peak_bytes"] >= rep["memory"]["process_rss_bytes"]


def test_json_of_a_loop_without_a_monitor_says_not_judged_and_what_is_missing(capfd):
    assert main(["watch", "--json", "--interval", "0.05", "--", PY, "-c", "import time; time.sleep(0.3)"]) == 0
    rep = json.loads(capfd.readouterr().out)["report"]
    assert rep["judged"] is False and rep["bottleneck"] == "not-judged" and "step timings" in rep["missing"]


def synthetic_result(*, gpus: bool = False, allocator: bool = False):
    from gpuwise.monitor.report import build_report
    from gpuwise.monitor.rules import judge
    from gpuwise.monitor.samples import AllocatorSample, Record
    from gpuwise.monitor.watch import WatchResult

    steps, t = [], 0.0
    for i in range(40):  # 50 ms steps, every 10th a 400 ms stall
        s = 0.4 if (i + 1) % 10 == 0 else 0.05
        t += s
        steps.append(StepEvent(step=i + 1, t=t, seconds=s, data_wait_s=0.01, items=32))
    samples = tuple(Sample(
        t=0.25 * i, host=HostSample(cpu_pct=(50.0, 50.0), process_cpu_pct=100.0,
                                    process_rss_bytes=(200 + 8 * i) * 2 ** 20),
        devices=(DeviceSample(index=0, util_pct=60.0, memory_used_bytes=GiB, memory_total_bytes=80 * GiB,
                              power_w=300.0),) if gpus else (),
        allocator=AllocatorSample(allocated_bytes=(1 + i) * 2 ** 26, reserved_bytes=(2 + i) * 2 ** 26) if allocator
        else None) for i in range(int(t / 0.25) + 1))
    record = Record(samples=samples, steps=tuple(steps), device_kind="cuda" if gpus else "cpu")
    diagnosis = judge(record)
    return WatchResult(command=("python", "train.py"), pid=1, exit_code=0, seconds=t, record=record,
                       diagnosis=diagnosis, report=build_report(record, diagnosis))


def test_the_summary_shows_p95_wall_samples_per_second_and_rss():
    from gpuwise.render.watch import render_watch

    r = synthetic_result()
    console = Console(file=io.StringIO(), width=200, color_system=None)
    render_watch(r, console)
    text = console.file.getvalue()
    wall = 36 * 0.05 + 4 * 0.4  # 3.4 s
    assert "50 ms median (p95 400 ms, max 400 ms)" in text
    assert f"{1280 / wall:,.3g} samples/s over wall clock" in text  # 376/s, not 32 / 50 ms = 640/s
    last = (200 + 8 * (len(r.record.samples) - 1)) * 2 ** 20
    from gpuwise.units import human_bytes

    assert f"RSS {human_bytes(last)} at the end, peak {human_bytes(last)}" in text


def test_plot_has_step_time_and_memory_panels(tmp_path):
    from gpuwise.plot import STALL_MARK, plot_watch, watch_figure

    fig = watch_figure(synthetic_result())
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["CPU %", "step ms", "data wait %", "process memory MiB"]
    step_ax, mem_ax = fig.axes[1], fig.axes[3]
    legend = [t.get_text() for t in step_ax.get_legend().get_texts()]
    assert legend[0] == "step time" and legend[1] == "median 50 ms"
    assert legend[2] == f"4 steps >= {STALL_MARK:g}x the median"  # the four 400 ms stalls, marked
    (rss,) = mem_ax.get_lines()
    assert rss.get_label() == "the command's RSS" and rss.get_ydata()[-1] > rss.get_ydata()[0]  # the climb shows
    import matplotlib.pyplot as plt

    plt.close(fig)
    gpu = watch_figure(synthetic_result(gpus=True, allocator=True))
    labels = [ax.get_ylabel() for ax in gpu.axes]
    assert labels == ["utilisation %", "memory GiB", "power W", "step ms", "data wait %", "process memory MiB"]
    assert [line.get_label() for line in gpu.axes[-1].get_lines()] == [
        "the command's RSS", "allocator: allocated", "allocator: reserved"]
    plt.close(gpu)
    path = tmp_path / "panels.png"
    plot_watch(synthetic_result(), path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_healthy_loop_marks_no_stall():
    from gpuwise.monitor.rules import judge
    from gpuwise.monitor.samples import Record
    from gpuwise.monitor.watch import WatchResult
    from gpuwise.plot import watch_figure

    steps = tuple(StepEvent(step=i + 1, t=0.1 * (i + 1), seconds=0.1 * (1.5 if i == 7 else 1.0)) for i in range(30))
    record = Record(steps=steps, samples=(Sample(t=0.0), Sample(t=3.0)))
    r = WatchResult(command=None, pid=1, exit_code=None, seconds=3.0, record=record, diagnosis=judge(record))
    fig = watch_figure(r)
    step_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "step ms")
    assert [t.get_text() for t in step_ax.get_legend().get_texts()] == ["step time", "median 100 ms"]
    assert not [ax for ax in fig.axes if ax.get_ylabel().startswith("process memory")]  # no RSS read: no panel
