"""gpuwise.Monitor in a process: the loop's timings, the samples, the log, and real CPU runs diagnosed."""

from __future__ import annotations

import json
import time

import pytest

from gpuwise.monitor.sampler import EVENTS_ENV, Monitor
from gpuwise.monitor.samples import Record, Sample, StepEvent, read_log


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


def test_every_rank_writes_its_events_with_its_items_and_accumulation(tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(EVENTS_ENV, str(events))
    monkeypatch.setenv("RANK", "1")  # under torchrun: a rank other than 0 speaks too (the watch names stragglers)
    with Monitor(interval_s=0.05, gpus=False) as mon:
        mon.step(seconds=0.5, items=32, micro_batches=4)
    (line,) = events.read_text().splitlines()
    event = json.loads(line)
    assert (event["items"], event["micro_batches"], event["rank"]) == (32, 4, None)  # no process group: no rank


def test_host_samples_carry_the_processs_resident_memory_and_threads():
    import mmap
    import threading

    import psutil

    with Monitor(interval_s=0.02, gpus=False) as mon:
        time.sleep(0.05)
        ballast = mmap.mmap(-1, 64 * 2**20)  # fresh anonymous pages (malloc could reuse pages already resident)
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1  # resident once touched
        time.sleep(0.1)
    hosts = [s.host for s in mon.record().samples if s.host is not None]
    rss = [h.process_rss_bytes for h in hosts]
    assert max(rss) - min(rss) >= 48 * 2**20  # the ballast shows
    assert max(rss) <= psutil.Process().memory_info().rss * 1.05
    assert all(h.process_threads >= threading.active_count() - 1 for h in hosts)  # the sampler thread among them
    assert all(h.tree_processes >= 1 and h.load_1m is not None for h in hosts)
    ballast.close()


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


def test_an_oom_is_recorded_where_it_happens_with_the_plans_breakdown_and_remedies():
    """On the CPU an OOM is raised by hand (torch.OutOfMemoryError), as the CUDA allocator raises it; the advice is
    the plan's for a real catalog GPU, so the numbers are the planner's own."""
    import torch

    from gpuwise.models.gpt import GPT, GPTConfig
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.training.config import TrainConfig
    from gpuwise.training.data import CharText
    from gpuwise.training.loss import model_loss
    from gpuwise.training.run import oom_advice_for
    from gpuwise.training.runplan import RunPlan
    from gpuwise.training.trainer import OutOfMemory, Runtime, Trainer

    # GPT-2 at micro-batch 64 x 1,024 tokens on a T4: the plan test_remedies.py makes (its gpt2 cases), read from
    # the session's captures
    advice = oom_advice_for(resolve_source("gpt2", None), Setup(micro_batch=64, seq=1024), "t4")
    assert advice.startswith("the plan's peak at micro-batch 64: ") and "optimizer" in advice
    assert "remedies in order: " in advice and "--" in advice.split("remedies in order: ")[1]

    def loss_fn(model, x, y):
        if x.shape[0] > 2:
            raise OutOfMemory(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return model_loss(model, x, y)

    data = CharText(seq=16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=data.vocab_size, block_size=16))
    mon = Monitor(interval_s=10, gpus=False)
    class Advised(RunPlan):  # the plan's OOM note, as the trainer adds it to the OOM's message
        def oom_note(self, micro: int) -> list[str]:
            return [f"plan advice at {micro}"]

    runtime = Runtime(monitor=mon, plan=Advised())
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), data, TrainConfig(steps=2, batch=4),
                      loss_fn=loss_fn, runtime=runtime)
    with mon:
        trainer.fit()
    (oom,) = mon.record().ooms
    assert oom.step == 1 and "out of memory at micro-batch 4" in oom.message and "plan advice at 4" in oom.message
    assert len(mon.record().steps) == 2 and mon.diagnose().bottleneck == "memory-full"


def test_a_fake_nvml_streams_into_the_monitor_and_a_power_capped_gpu_is_throttled():
    """NVML behind the same interface (tests/fakes/nvml.py): a busy H100 held at 1,400 of 1,980 MHz by
    a power cap lowered to 450 of its default 700 W, replayed through the Monitor's own sampler thread."""
    import fakes.nvml as fake

    nvml = fake.FakeNvml([fake.h100(util_gpu=99, clock_sm=1400, reasons=0x4, power_mw=449_000,
                                    power_limit_mw=450_000)])  # SwPowerCap, default limit 700 W
    with Monitor(interval_s=0.01, nvml=nvml, device="cpu") as mon:
        for _ in range(30):
            time.sleep(0.01)
            mon.step(seconds=0.01, data_wait_s=0.0)
    r = mon.record()
    assert r.device_kind == "cuda" and r.note is None  # NVML saw a GPU
    d = r.samples[-1].devices[0]
    assert d.util_pct == 99 and d.sm_clock_mhz == 1400 and d.clock_reasons == ("power cap (software)",)
    diag = mon.diagnose()
    assert diag.bottleneck == "throttled", diag
