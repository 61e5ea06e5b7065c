"""gpuwise train's throughput is over the wall clock (issue 29: "959 samples/s for a run that did 261/s"): a run
that stalls every 10th step (a log callback that sleeps) reports the items over the time the test measured itself,
not the median step's rate; the monitor gets each step's items and accumulation and names the stalls."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from gpuwise.training.config import TrainConfig, TrainOptions
from gpuwise.training.meter import wall_throughput
from gpuwise.training.run import run_training
from gpuwise.training.trainer import StepLog

SEQ, BATCH, MICRO, STEPS, STALL_S = 16, 4, 2, 60, 0.3


def test_a_run_that_stalls_every_tenth_step_reports_items_over_the_wall_clock(monkeypatch):
    from gpuwise.monitor.sampler import Monitor

    seen: list[tuple[float, StepLog]] = []
    events = []
    real_step = Monitor.step

    def step(self, **kw):
        events.append(real_step(self, **kw))
        return events[-1]

    monkeypatch.setattr(Monitor, "step", step)

    def on_log(log: StepLog) -> None:
        seen.append((time.perf_counter(), log))
        if log.step % 10 == 0:
            time.sleep(STALL_S)  # outside the timed step, as a checkpoint save or an evaluation would be

    opts = TrainOptions(seq=SEQ, device="cpu", auto=False,
                        config=TrainConfig(steps=STEPS, batch=BATCH, micro_batch=MICRO, log_every=1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared 2-core box make every step jitter (that is oversubscription)
    try:
        summary = run_training(opts, on_log=on_log, environ={})
    finally:
        torch.set_num_threads(threads)
    assert summary.steps == STEPS and summary.unit == "tokens" and len(seen) == STEPS
    # the reference, measured here: tokens of steps 2..60 over the time from the first log line to the last
    (t0, first), (t1, last) = seen[0], seen[-1]
    tokens = (STEPS - 1) * BATCH * SEQ
    assert last.items_done - first.items_done == tokens
    measured = tokens / (t1 - t0)
    assert summary.throughput == pytest.approx(measured, rel=0.10)
    old = statistics.median(log.tokens_per_s for _, log in seen[1:])  # what it reported before: the median step
    assert old > 1.3 * measured  # 5 stalls of 0.3 s against 59 steps of ~20-40 ms: 1.6-2.3x on this CPU

    # the monitor had each step's tokens and its two micro-batches, and saw the stalls between the steps
    assert len(events) == STEPS and {(e.items, e.micro_batches) for e in events} == {(BATCH * SEQ, BATCH // MICRO)}
    d = summary.diagnosis
    stalls = next((f for f in d.findings if f.bottleneck == "stalls"), None)
    assert stalls is not None, d
    # the sleep after step 10's log line lands before step 11 begins: phase 1
    assert stalls.evidence["period_steps"] == 10 and stalls.evidence["period_phase"] == 1
    assert stalls.evidence["cause"] == "between steps"
    assert stalls.evidence["items_per_s_wall"] == pytest.approx(measured, rel=0.15)  # steps 7-60 only


def test_wall_throughput_takes_the_steps_after_the_first_log_line():
    logs = [StepLog(step=s, loss=1.0, lr=0.1, grad_norm=None, tokens_per_s=1e6, mfu=None, peak_memory_bytes=None,
                    data_wait=0.0, skipped=False, elapsed_s=e, items_done=n)
            for s, e, n in ((10, 5.0, 640), (20, 7.0, 1280), (30, 13.0, 1920))]
    assert wall_throughput(logs) == pytest.approx((1920 - 640) / (13.0 - 5.0))  # 160/s, not the steps' 1e6
    assert wall_throughput(logs[:1]) == pytest.approx(640 / 5.0)  # one line: from the first step's start
    assert wall_throughput([]) is None
