"""gpuwise.Monitor in a process: the loop's timings, the samples, the log, and real CPU runs diagnosed."""

from __future__ import annotations

import json
import time

import pytest

from gpuwise.monitor.samples import Record, Sample, StepEvent, read_log
from gpuwise.monitor.sampler import EVENTS_ENV, Monitor


class Sleepy:
    """An iterable whose every item takes ``seconds`` to make."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.seconds)
            yield i


def test_loader_times_the_wait_in_next_and_step_ends_the_step():
    with Monitor(interval_s=0.05, gpus=False) as mon:
        for _ in mon.loader(Sleepy(4, 0.03)):
            time.sleep(0.01)  # the step's own work
            mon.step()
    steps = mon.record().steps
    assert [s.step for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert 0.025 < s.data_wait_s < s.seconds  # the 30 ms sleep, inside the step
        assert s.seconds - s.data_wait_s >= 0.009  # and the work after it
    assert sum(s.seconds for s in steps) == pytest.approx(steps[-1].t, abs=0.02)  # steps tile the run


def test_without_nvidia_gpus_it_watches_the_cpu_side_and_says_so_in_one_line():
    with Monitor(interval_s=0.02) as mon:
        time.sleep(0.1)
    r = mon.record()
    assert r.device_kind == "cpu" and "CPU side" in r.note and "\n" not in r.note
    assert len(r.samples) >= 3 and all(s.devices == () and s.allocator is None for s in r.samples)
    host = r.samples[-1].host
    assert host.cpu_pct and all(0 <= c <= 100 for c in host.cpu_pct)
    assert 0 < host.memory_used_bytes < host.memory_total_bytes and host.process_cpu_pct is not None


def test_the_log_is_json_lines_that_read_back_as_the_record(tmp_path):
    path = tmp_path / "run.jsonl"
    with Monitor(interval_s=0.02, log=path, gpus=False) as mon:
        for _ in mon.loader(range(3)):
            time.sleep(0.02)
            mon.step(flops=1e9)
        mon.oom(3, "out of memory at micro-batch 8")
    back, seen = read_log(path), mon.record()
    assert back.steps == seen.steps and back.ooms == seen.ooms
    assert back.samples == seen.samples  # every field, the per-core tuple included
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds.count("step") == 3 and kinds.count("oom") == 1 and kinds.count("sample") >= 2


def test_a_cut_off_last_line_is_skipped_and_a_bad_line_is_one_error(tmp_path):
    from gpuwise.errors import GpuwiseError
    from gpuwise.monitor.samples import to_line

    path = tmp_path / "log.jsonl"
    good = to_line(StepEvent(step=1, t=1.0, seconds=1.0))
    path.write_text(good + "\n" + good[:20])
    assert len(read_log(path).steps) == 1
    path.write_text("not json\n" + good + "\n")
    with pytest.raises(GpuwiseError, match="line 1 is not a gpuwise log line"):
        read_log(path)


def test_steps_go_to_the_watchs_events_file_when_it_asks(tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_ENV, str(events))
    with Monitor(interval_s=0.05, gpus=False) as mon:
        mon.step(seconds=0.5, data_wait_s=0.25)
    (line,) = events.read_text().splitlines()
    assert json.loads(line) == {"kind": "step", **json.loads(line)} and json.loads(line)["data_wait_s"] == 0.25


def test_a_log_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path):
    from gpuwise.errors import GpuwiseError

    with pytest.raises(GpuwiseError, match="it is a folder"):
        Monitor(log=tmp_path).start()


def test_the_last_steps_window_keeps_their_samples_only():
    mon = Monitor(gpus=False)
    mon._steps = [StepEvent(step=i, t=float(i), seconds=1.0) for i in range(1, 11)]
    mon._samples = [Sample(t=t / 2) for t in range(0, 21)]
    r = mon.record(last_steps=3)
    assert [s.step for s in r.steps] == [8, 9, 10] and min(s.t for s in r.samples) == 7.0
    assert isinstance(r, Record)
