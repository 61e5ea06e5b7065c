"""memory_rules.memory_leak through monitor.rules.judge: the issue's leaks (RSS +8 MB a step; the allocator 10 -> 70
GiB of 80 in two minutes) with the rate and the time to OOM against hand computations; the records that must not
fire (an allocator warming up then flat, RSS noise, 30 MB of growth, reserved growing with allocated flat, one jump);
and a real CPU loop that keeps 8 MB of tensors a step, under a Monitor."""

from __future__ import annotations

import json
import random
import time

import pytest

from gpuwise.monitor.memory_rules import LEAK_MIN_BYTES, LEAK_MIN_R2, memory_leak, r_squared, theil_sen
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import AllocatorSample, DeviceSample, HostSample, Record, Sample, StepEvent
from gpuwise.monitor.verdict import Context, Diagnosis, Verdict
from gpuwise.monitor.window import window
from gpuwise.render.diagnosis import diagnosis_json, render_lines
from gpuwise.units import GB, MB, GiB

CPU = Context(device="cpu", usable_cores=16)
HOST_TOTAL = 16 * GB


def leak(d: Diagnosis) -> Verdict | None:
    return next((f for f in d.findings if f.bottleneck == "memory-leak"), None)


def uniform_steps(n: int, seconds: float) -> tuple[StepEvent, ...]:
    return tuple(StepEvent(step=i + 1, t=(i + 1) * seconds, seconds=seconds) for i in range(n))


def host(rss: float, *, used_base: float = 4 * GB, workers_rss: float | None = None) -> HostSample:
    """A host whose used memory is a base plus what the process holds above 1 GB."""
    return HostSample(cpu_pct=(50.0,) * 4, memory_total_bytes=HOST_TOTAL, memory_used_bytes=int(used_base + rss - GB),
                      process_rss_bytes=int(rss), workers_rss_bytes=None if workers_rss is None else int(workers_rss))


def rss_record(rss_at, *, n_steps: int = 200, step_s: float = 0.25, dt: float = 0.5) -> Record:
    """n_steps uniform steps and a host sample every dt seconds, RSS given by ``rss_at(t)``."""
    n = round(n_steps * step_s / dt)
    samples = tuple(Sample(t=(i + 1) * dt, host=host(rss_at((i + 1) * dt))) for i in range(n))
    return Record(samples=samples, steps=uniform_steps(n_steps, step_s), interval_s=dt)


def trends(d: Diagnosis) -> dict:
    return d.evidence["memory_trends"]


# -- the fit -------------------------------------------------------------------------------------------------------


def test_theil_sen_ignores_an_outlier_and_r2_of_one_jump_is_at_most_three_quarters():
    xs = list(range(20))
    ys = [3.0 * x + 5 for x in xs]
    ys[7] = 1e6  # one wild reading
    b, a = theil_sen(xs, ys)
    assert b == pytest.approx(3.0) and a == pytest.approx(5.0)
    # a step at fraction p of a uniform span: R² = 3p(1-p) by hand (cov = p(1-p)/2, var t = 1/12, var y = p(1-p))
    ts = [i / 1000 for i in range(1001)]
    for p in (0.25, 0.5, 0.7):
        assert r_squared(ts, [float(t > p) for t in ts]) == pytest.approx(3 * p * (1 - p), abs=0.01)
    assert LEAK_MIN_R2 > 3 * 0.5 * 0.5  # so one jump never passes the fit test


# -- the leaks ---------------------------------------------------------------------------------------------


def test_rss_growing_8_mb_a_step_is_named_with_its_rate_and_time_to_oom():
    """Steps of alternating 0.2 and 0.3 s; each step keeps 8 MB more (RSS a staircase in the completed steps);
    samples every 0.5 s. By hand: 8 MB a step, 250 steps in 62.5 s = 4 steps/s -> 32 MB/s; the last sample has
    16 GB - used free, which runs out at 32 MB/s in (16 GB - used) / 32 MB/s."""
    durations = [0.2 if i % 2 == 0 else 0.3 for i in range(250)]
    ends, t = [], 0.0
    for s in durations:
        t += s
        ends.append(t)
    steps = tuple(StepEvent(step=i + 1, t=ends[i], seconds=durations[i]) for i in range(250))

    def rss(t: float) -> float:
        return GB + 8 * MB * sum(1 for e in ends if e <= t)

    samples = tuple(Sample(t=(i + 1) * 0.5, host=host(rss((i + 1) * 0.5))) for i in range(125))
    d = judge(Record(samples=samples, steps=steps, interval_s=0.5), CPU)
    assert d.bottleneck == "memory-leak"
    v = leak(d)
    assert v is not None and v.share is None
    ev = v.evidence
    assert ev["what"] == "process RSS" and ev["memory"] == "host"
    assert ev["rate_bytes_per_step"] == pytest.approx(8 * MB, rel=0.03)
    assert ev["rate_bytes_per_s"] == pytest.approx(32 * MB, rel=0.03)
    last = samples[-1].host
    room = HOST_TOTAL - last.memory_used_bytes
    assert ev["headroom_bytes"] == room
    assert ev["time_to_oom_s"] == pytest.approx(room / (32 * MB), rel=0.03)
    assert ev["oom_at_step"] == pytest.approx(250 + room / (8 * MB), rel=0.03)
    assert ev["r2"] > 0.99 and min(ev["half_rate_shares"]) > 0.9
    assert ev["growth_bytes"] == pytest.approx(ev["rate_bytes_per_s"] * ev["span_s"], rel=0.01)
    assert v.summary.startswith("process RSS grows 8.0 MB a step (") and "out of host memory in ~" in v.summary
    assert any("loss.item()" in f for f in v.fix)
    lines = render_lines(d)
    assert lines[0].startswith("bottleneck: memory-leak (process RSS grows 8.0 MB a step")
    json.dumps(diagnosis_json(d))


def test_rss_leak_with_50_mb_of_noise_keeps_its_rate():
    """The issue's case: +8 MB a step (2 GB over 250 steps) with +-50 MB of noise on each reading."""
    rng = random.Random(0)
    d = judge(rss_record(lambda t: GB + 8 * MB * t / 0.25 + rng.uniform(-50, 50) * MB, n_steps=250), CPU)
    ev = leak(d).evidence
    assert ev["rate_bytes_per_step"] == pytest.approx(8 * MB, rel=0.05)
    assert ev["rate_bytes_per_s"] == pytest.approx(32 * MB, rel=0.05)


def test_the_allocator_10_to_70_gib_of_80_in_two_minutes_fires_without_step_events():
    """No steps: judged over time. By hand: 60 GiB in 119 s; 10 GiB left at the end -> 10 * 119 / 60 = 19.8 s."""
    rate = 60 * GiB / 119

    def alloc(i: int) -> AllocatorSample:
        a = 10 * GiB + rate * i
        return AllocatorSample(allocated_bytes=int(a), reserved_bytes=int(a + 2 * GiB))

    dev = {"index": 0, "name": "NVIDIA H100", "util_pct": 98.0, "memory_total_bytes": 80 * GiB}
    samples = tuple(Sample(t=float(i + 1), devices=(DeviceSample(**dev, memory_used_bytes=int(12 * GiB + rate * i)),),
                           allocator=alloc(i)) for i in range(120))
    ctx = Context(device="cuda", usable_cores=16, memory_total_bytes=80 * GiB)
    d = judge(Record(samples=samples, device_kind="cuda"), ctx)
    assert d.bottleneck == "memory-leak"
    ev = d.evidence
    assert ev["what"] == "CUDA allocated memory" and ev["memory"] == "GPU"
    assert ev["rate_bytes_per_s"] == pytest.approx(rate, rel=0.01)
    assert ev["rate_bytes_per_step"] is None and ev["oom_at_step"] is None
    assert ev["start_bytes"] == pytest.approx(10 * GiB, rel=0.01) and ev["end_bytes"] == pytest.approx(70 * GiB,
                                                                                                        rel=0.01)
    assert ev["time_to_oom_s"] == pytest.approx(10 * 119 / 60, rel=0.02)
    assert any("_record_memory_history" in f and "memory_viz" in f for f in d.fix)
    assert "out of GPU memory in ~20 s" in d.summary
    # reserved grows with it: named once, by allocated
    assert trends(d)["cuda_reserved"]["fires"] is False


def test_the_non_pytorch_memory_on_the_device_shortens_the_time_to_oom():
    """NVML's process memory above the allocator's reserved (CUDA context, workspaces) is not there to grow into."""
    rate = 0.5 * GiB

    def sample(i: int) -> Sample:
        a = 10 * GiB + rate * i
        dev = DeviceSample(index=0, util_pct=98.0, memory_total_bytes=80 * GiB, memory_used_bytes=int(a + 3 * GiB),
                           process_memory_bytes=int(a + 2 * GiB))  # reserved a + 1 GiB: 1 GiB outside torch
        return Sample(t=float(i + 1), devices=(dev,), allocator=AllocatorSample(allocated_bytes=int(a),
                                                                                reserved_bytes=int(a + GiB)))

    d = judge(Record(samples=tuple(sample(i) for i in range(60)), device_kind="cuda"),
              Context(device="cuda", memory_total_bytes=80 * GiB))
    last = 10 * GiB + rate * 59
    assert d.evidence["headroom_bytes"] == pytest.approx(80 * GiB - last - GiB, abs=2)
    assert d.evidence["time_to_oom_s"] == pytest.approx((80 * GiB - last - GiB) / rate, rel=0.01)


def test_workers_rss_growing_is_named_as_copy_on_access():
    """Four workers' RSS together +4 MB a step (pytorch#13246), the main process flat."""
    samples = tuple(Sample(t=(i + 1) * 0.5, host=host(2 * GB, workers_rss=4 * GB + 4 * MB * (i + 1) * 0.5 / 0.25))
                    for i in range(100))
    d = judge(Record(samples=samples, steps=uniform_steps(200, 0.25), interval_s=0.5), CPU)
    v = leak(d)
    assert v is not None and v.evidence["what"] == "the loader workers' RSS"
    assert v.evidence["rate_bytes_per_step"] == pytest.approx(4 * MB, rel=0.03)
    assert any("13246" in f and "numpy" in f for f in v.fix)
    assert trends(d)["process_rss"]["fires"] is False


@pytest.mark.parametrize("tensor_bytes, pool", [(256 * 1024, "small"), (64 * 2**20, "large")])
def test_the_allocator_says_how_many_tensors_a_step_keeps_and_which_pool(tensor_bytes, pool):
    """A loop keeping tensors across steps: 4 a step of 256 KiB (under 1 MB: the small pool, e.g. per-step metrics
    kept on the GPU) or of 64 MiB (the large pool: outputs collected). By hand: allocations +4 a step, each
    tensor_bytes on average; the pool is the one that carries the growth."""
    kept = 4
    n_steps = 400 if pool == "small" else 40

    def alloc(step: int) -> AllocatorSample:
        grown = kept * tensor_bytes * step
        return AllocatorSample(allocated_bytes=2 * GiB + grown, reserved_bytes=3 * GiB + grown,
                               small_pool_allocated_bytes=10 * 2**20 + (grown if pool == "small" else 0),
                               allocations=500 + kept * step)

    events = tuple(StepEvent(step=i + 1, t=0.1 * (i + 1), seconds=0.1) for i in range(n_steps))
    samples = tuple(Sample(t=0.1 * (i + 1) + 0.05, allocator=alloc(i + 1)) for i in range(n_steps))
    d = judge(Record(samples=samples, steps=events, device_kind="cuda"),
              Context(device="cuda", usable_cores=8, memory_total_bytes=80 * GiB))
    assert d.bottleneck == "memory-leak"
    kind = d.evidence["tensors_growing"]
    assert kind["pool"] == pool and kind["bytes_per_allocation"] == pytest.approx(tensor_bytes, rel=0.01)
    assert kind["allocations_per_step"] == pytest.approx(kept, rel=0.05)
    assert f"in the {pool} pool" in d.expected


def test_step_peaks_growing_without_allocator_samples_judge_the_gpu():
    """Only the steps' max_memory_allocated (a log from train): +50 MB a step on 80 GiB. By hand: headroom 80 GiB -
    the last peak, at 50 MB a step and 2 steps a second."""
    steps = tuple(StepEvent(step=i + 1, t=(i + 1) * 0.5, seconds=0.5, peak_memory_bytes=int(20 * GiB + 50 * MB * i))
                  for i in range(100))
    d = judge(Record(steps=steps, device_kind="cuda"), Context(device="cuda", memory_total_bytes=80 * GiB))
    v = leak(d)
    assert v is not None and v.evidence["what"] == "the step's peak CUDA allocation"
    assert v.evidence["rate_bytes_per_step"] == pytest.approx(50 * MB, rel=0.01)
    assert v.evidence["rate_bytes_per_s"] == pytest.approx(100 * MB, rel=0.01)
    room = 80 * GiB - (20 * GiB + 50 * MB * 99)
    assert v.evidence["time_to_oom_s"] == pytest.approx(room / (100 * MB), rel=0.01)
    assert v.evidence["oom_at_step"] == pytest.approx(100 + room / (50 * MB), abs=2)


def test_nvml_process_memory_alone_fires_and_asks_for_the_allocator():
    """A watch from outside: NVML's per-process memory only, +0.2 GiB/s."""
    samples = tuple(Sample(t=float(i + 1), devices=(DeviceSample(
        index=0, util_pct=95.0, memory_total_bytes=80 * GiB, memory_used_bytes=int(11 * GiB + 0.2 * GiB * i),
        process_memory_bytes=int(10 * GiB + 0.2 * GiB * i)),)) for i in range(100))
    d = judge(Record(samples=samples, device_kind="cuda"), Context(device="cuda"))
    v = leak(d)
    assert v is not None and "NVML" in v.evidence["what"]
    room = 80 * GiB - (11 * GiB + 0.2 * GiB * 99)
    assert v.evidence["time_to_oom_s"] == pytest.approx(room / (0.2 * GiB), rel=0.01)
    assert any("gpuwise.Monitor" in f for f in v.fix)


# -- must not fire -------------------------------------------------------------------------------------------------


def test_an_allocator_that_warms_up_then_plateaus_does_not_fire():
    """100 steps of 1 s; allocated rises 2 -> 20 GiB until t = 64 s (past the 10-step warm-up cut, over 60% of the
    judged span) and stays there: a line fits it well (R² > 0.8), but the second half does not grow."""
    def alloc(t: float) -> AllocatorSample:
        a = 2 * GiB + 18 * GiB * min(t, 64.0) / 64.0
        return AllocatorSample(allocated_bytes=int(a), reserved_bytes=int(a + GiB))

    samples = tuple(Sample(t=float(i + 1), devices=(DeviceSample(index=0, util_pct=98.0,
                                                                 memory_total_bytes=80 * GiB),),
                           allocator=alloc(float(i + 1))) for i in range(100))
    d = judge(Record(samples=samples, steps=uniform_steps(100, 1.0), device_kind="cuda"),
              Context(device="cuda", memory_total_bytes=80 * GiB))
    assert leak(d) is None
    tr = trends(d)["cuda_allocated"]
    assert tr["r2"] >= LEAK_MIN_R2 and tr["growth_bytes"] > LEAK_MIN_BYTES  # only the halves test stops it
    assert tr["half_rate_shares"][1] < 0.05 and "levels off" in tr["why_not"]


def test_rss_noise_without_a_trend_does_not_fire():
    rng = random.Random(1)
    d = judge(rss_record(lambda t: 2 * GB + rng.uniform(-50, 50) * MB), CPU)
    assert d.bottleneck == "healthy"
    assert trends(d)["process_rss"]["fires"] is False


def test_a_growth_of_30_mb_does_not_fire():
    d = judge(rss_record(lambda t: GB + 30 * MB * t / 50.0), CPU)
    assert leak(d) is None
    tr = trends(d)["process_rss"]
    assert tr["r2"] > 0.99 and tr["growth_bytes"] < 30 * MB and "under the floor" in tr["why_not"]


def test_300_mb_on_a_60_gb_process_is_under_the_relative_floor():
    d = judge(rss_record(lambda t: 60 * GB + 300 * MB * t / 50.0), CPU)
    assert leak(d) is None and "of the start" in trends(d)["process_rss"]["why_not"]


def test_one_jump_does_not_fire():
    """A cache filled once halfway (RSS 1 GB -> 3 GB at t = 25 s): R² <= 0.75 by the hand computation above."""
    d = judge(rss_record(lambda t: GB if t < 25 else 3 * GB), CPU)
    assert leak(d) is None
    assert trends(d)["process_rss"]["r2"] < LEAK_MIN_R2


def test_reserved_growing_with_allocated_flat_is_left_to_fragmentation():
    def sample(i: int) -> Sample:
        alloc = AllocatorSample(allocated_bytes=int(10 * GiB + (i % 3) * 10 * MB),
                                reserved_bytes=int(12 * GiB + 0.25 * GiB * i))
        return Sample(t=float(i + 1), devices=(DeviceSample(index=0, util_pct=98.0, memory_total_bytes=80 * GiB),),
                      allocator=alloc)

    record = Record(samples=tuple(sample(i) for i in range(100)), steps=uniform_steps(100, 1.0), device_kind="cuda")
    ctx = Context(device="cuda", memory_total_bytes=80 * GiB)
    d = judge(record, ctx)
    assert leak(d) is None and "fragmentation" in [f.bottleneck for f in d.findings]
    verdict, checked = memory_leak(window(record, ctx), {})
    tr = checked["memory_trends"]
    assert verdict is None and tr["cuda_allocated"]["fires"] is False
    assert tr["cuda_reserved"]["fires"] is False and "fragmentation" in tr["cuda_reserved"]["why_not"]


def test_no_memory_readings_say_not_judged_in_a_healthy_evidence():
    d = judge(Record(steps=uniform_steps(30, 0.1)), CPU)
    assert d.bottleneck == "healthy" and d.evidence["memory_leak"].startswith("not judged")


# -- a real loop ---------------------------------------------------------------------------------------------------


def test_a_real_cpu_loop_that_keeps_8_mb_a_step_is_a_process_rss_leak():
    """60 steps of ~20 ms, each keeping torch.full((2_000_000,), i) (8,000,000 bytes, written, so resident) in a list;
    the monitor samples RSS every 50 ms. By construction: 8 MB a step."""
    torch = pytest.importorskip("torch")
    from gpuwise import Monitor

    kept = []
    x = torch.randn(256, 256)
    with Monitor(interval_s=0.05, gpus=False, device="cpu") as mon:
        for i in range(60):
            t = time.perf_counter()
            x @ x  # some work in the step
            kept.append(torch.full((2_000_000,), float(i)))  # one allocation, filled: 8,000,000 resident bytes
            time.sleep(max(0.0, 0.02 - (time.perf_counter() - t)))
            mon.step()
        d = mon.diagnose()
    kept.clear()
    v = leak(d)
    assert v is not None, d.evidence.get("memory_trends")
    assert v.evidence["what"] == "process RSS"
    assert v.evidence["rate_bytes_per_step"] == pytest.approx(8 * MB, rel=0.25)
    assert v.evidence["time_to_oom_s"] > 0


def test_a_real_cpu_loop_that_frees_its_8_mb_each_step_is_not_a_leak():
    """The control: the same loop, the 8 MB tensor dropped at the end of each step."""
    torch = pytest.importorskip("torch")
    from gpuwise import Monitor

    x = torch.randn(256, 256)
    with Monitor(interval_s=0.05, gpus=False, device="cpu") as mon:
        for i in range(60):
            t = time.perf_counter()
            x @ x  # some work in the step
            scratch = torch.full((2_000_000,), float(i))
            time.sleep(max(0.0, 0.02 - (time.perf_counter() - t)))
            del scratch
            mon.step()
        d = mon.diagnose()
    assert leak(d) is None
