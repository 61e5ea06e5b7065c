"""monitor.rules.judge: one synthetic record per class, the borderline records that must not fire, the input-bound
arithmetic against a hand computation, the primary ordering, the watch (no steps) and empty cases, and the JSON
output."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import (
    AllocatorSample,
    DeviceSample,
    HostSample,
    OomEvent,
    Record,
    Sample,
    StepEvent,
)
from gpuwise.monitor.thresholds import COMM_EXPOSED_SHARE, INPUT_WAIT_SHARE
from gpuwise.monitor.verdict import BOTTLENECKS, Context, Diagnosis, Loader
from gpuwise.render.diagnosis import diagnosis_json, render_lines
from gpuwise.units import GiB

H200 = {"memory_total_bytes": 141 * GiB, "sm_clock_max_mhz": 1980.0}
CUDA = Context(device="cuda", usable_cores=16, world_size=1, memory_total_bytes=141 * GiB)


def steps(n: int = 30, *, seconds: float = 1.0, wait: float = 0.0, **kw) -> tuple[StepEvent, ...]:
    """n steps of ``seconds`` each, back to back from t=0."""
    return tuple(StepEvent(step=i + 1, t=(i + 1) * seconds, seconds=seconds, data_wait_s=wait, **kw) for i in range(n))


def device(**kw) -> DeviceSample:
    """A healthy, busy H200 reading unless told otherwise."""
    base = {"index": 0, "name": "NVIDIA H200", "util_pct": 98.0, "memory_used_bytes": 60 * GiB,
            "sm_clock_mhz": 1980.0, "clock_reasons": (), "power_w": 500.0, "power_limit_w": 700.0,
            "temperature_c": 60.0, "temperature_slowdown_c": 90.0, **H200}
    return DeviceSample(**{**base, **kw})


def samples(n: int = 60, *, dt: float = 0.5, host: HostSample | None = None, allocator=None,
            **dev) -> tuple[Sample, ...]:
    """n samples every dt seconds from dt on, each with one device reading (and host / allocator if given)."""
    return tuple(Sample(t=(i + 1) * dt, devices=(device(**dev),), host=host,
                        allocator=allocator(i) if callable(allocator) else allocator) for i in range(n))


def gpu_record(step_events=None, sample_events=None, **kw) -> Record:
    return Record(steps=steps() if step_events is None else step_events,
                  samples=samples() if sample_events is None else sample_events, device_kind="cuda", **kw)


def names(d: Diagnosis) -> list[str]:
    return [f.bottleneck for f in d.findings]


# -- one fixture per class -----------------------------------------------------------------------------------------


def test_input_bound_cpu_sleeping_dataset():
    # §B6: a 5 ms/sample dataset with 0 workers measured 0.69-0.73 data-wait share
    d = judge(Record(steps=steps(40, seconds=0.1, wait=0.071)), Context(device="cpu", usable_cores=4))
    assert d.bottleneck == "input-bound"
    assert d.findings[0].share == pytest.approx(0.71)
    assert any("num_workers=" in f for f in d.fix)
    assert "pin_memory" not in d.fix[0]  # a CPU run has nothing to pin for
    assert d.note and "loop's own timings" in d.note


def test_input_bound_gpu_names_every_loader_setting():
    rec = gpu_record(steps(30, wait=0.6), samples(60, util_pct=40.0))
    d = judge(rec, CUDA)
    assert d.bottleneck == "input-bound"
    fix = d.fix[0]
    for setting in ("num_workers=", "pin_memory=True", "prefetch_factor=", "persistent_workers=True"):
        assert setting in fix
    assert "host-bound" not in names(d)  # the low duty cycle is explained by the data wait
    assert d.note is None


def test_input_bound_keeps_settings_already_on():
    loader = Loader(num_workers=1, pin_memory=True, persistent_workers=True, prefetch_factor=2)
    d = judge(gpu_record(steps(30, wait=0.6), samples(60, util_pct=40.0)),
                 Context(device="cuda", usable_cores=16, loader=loader))
    assert "pin_memory" not in d.fix[0] and "persistent_workers" not in d.fix[0]
    assert d.evidence["num_workers_now"] == 1 and d.evidence["num_workers_from"] == "the DataLoader"


def test_communication_bound():
    rec = gpu_record(steps(30, comm_s=0.5, exposed_comm_s=0.3))
    d = judge(rec, Context(device="cuda", usable_cores=16, world_size=8))
    assert d.bottleneck == "communication-bound"
    assert d.findings[0].share == pytest.approx(0.3)
    text = " ".join(d.fix)
    assert "no_sync" in text and "bucket_cap_mb" in text and "NVLink" in text
    assert "at most 30%" in d.expected and "1000 ms → 700 ms" in d.expected


def test_host_bound_low_duty_cycle():
    rec = gpu_record(steps(30, wait=0.02), samples(60, util_pct=30.0))
    d = judge(rec, Context(device="cuda", usable_cores=16, kernels_per_step=60000))
    assert d.bottleneck == "host-bound"
    assert d.findings[0].share == pytest.approx(0.7)
    assert any("torch.compile" in f for f in d.fix) and any("reduce-overhead" in f for f in d.fix)
    assert d.evidence["launch_s_per_step"] == pytest.approx(0.6)  # 60 000 launches x 10 us


def test_host_bound_busy_low_sm_use():
    # KempnerPulse class 10: NVML says 95 % busy, GPM says 15 % of the SMs
    rec = gpu_record(steps(30), samples(60, util_pct=95.0, sm_active_pct=15.0))
    d = judge(rec, CUDA)
    assert d.bottleneck == "host-bound"
    assert d.findings[0].share == pytest.approx(1 - 15 / 95, abs=1e-3)
    assert "busy, low SM use" in d.summary


def test_host_bound_on_a_cpu_needs_host_samples_and_threads():
    # a CPU loop has no duty cycle: host-bound there is judged from the process's cores (tests/monitor/
    # test_host_rules.py); without host samples it says it did not judge, and the run stays healthy
    d = judge(Record(steps=steps(30, wait=0.02)), Context(device="cpu", threads=2))
    assert d.bottleneck == "healthy"
    assert d.evidence["cpu_host"].startswith("not judged: no host samples")
    d = judge(Record(steps=steps(30, wait=0.02)), Context(device="cpu"))
    assert "thread count is not known" in d.evidence["cpu_host"]


def test_throttled_power_cap():
    # someone lowered the limit to 450 W on a 700 W board: the clocks fall, and restoring the default gives them back
    rec = gpu_record(sample_events=samples(60, clock_reasons=("sw_power_cap",), sm_clock_mhz=1500.0,
                                           power_w=449.0, power_limit_w=450.0, power_default_limit_w=700.0))
    d = judge(rec, CUDA)
    assert d.bottleneck == "throttled"
    assert d.findings[0].share == pytest.approx(1 - 1500 / 1980, abs=1e-3)
    assert "power cap" in d.summary and "nvidia-smi -pl 700" in d.fix[0]


def test_a_power_cap_at_the_boards_default_limit_is_its_design_point_not_throttling():
    # a GEMM-bound H200 at 699 of its default 700 W holds ~1.6 of 1.98 GHz: nothing to restore (review of issue 13)
    for default in (700.0, None):
        rec = gpu_record(sample_events=samples(60, clock_reasons=("sw_power_cap",), sm_clock_mhz=1600.0,
                                               power_w=699.0, power_limit_w=700.0, power_default_limit_w=default))
        assert "throttled" not in names(judge(rec, CUDA))


def test_throttled_thermal_nvml_names():
    rec = gpu_record(sample_events=samples(60, clock_reasons=("HwThermalSlowdown", "SwThermalSlowdown"),
                                           sm_clock_mhz=1200.0, temperature_c=92.0))
    d = judge(rec, CUDA)
    assert d.bottleneck == "throttled"
    assert d.evidence["reasons"] == {"thermal": d.evidence["busy_samples"]} == {"thermal": 54}  # after t=3 s
    assert "cooling" in d.fix[0]


def test_fragmentation_gap():
    alloc = AllocatorSample(allocated_bytes=20 * GiB, reserved_bytes=40 * GiB, peak_allocated_bytes=24 * GiB,
                            inactive_split_bytes=10 * GiB)
    d = judge(gpu_record(sample_events=samples(60, allocator=alloc)), CUDA)
    assert d.bottleneck == "fragmentation"
    assert d.findings[0].share is None
    assert d.fix[0].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert d.evidence["gap_bytes_median"] == 16 * GiB


def test_fragmentation_retries_rising():
    def alloc(i):
        return AllocatorSample(allocated_bytes=50 * GiB, reserved_bytes=52 * GiB, peak_allocated_bytes=51 * GiB,
                               alloc_retries=i // 10)
    d = judge(gpu_record(sample_events=samples(60, allocator=alloc)), CUDA)
    assert d.bottleneck == "fragmentation"
    assert d.evidence["alloc_retries_rise"] >= 1


def test_memory_full_oom_uses_the_plans_remedies():
    oom = OomEvent(step=12, t=12.0, message="CUDA out of memory. Tried to allocate 2.00 GiB",
                   allocator=AllocatorSample(allocated_bytes=130 * GiB, reserved_bytes=139 * GiB))
    ctx = Context(device="cuda", memory_total_bytes=141 * GiB,
                  remedies=("--checkpointing full", "--micro-batch 4 --accumulate 2"))
    d = judge(gpu_record(steps(11), ooms=(oom,)), ctx)
    assert d.bottleneck == "memory-full"
    assert d.fix == ("--checkpointing full", "--micro-batch 4 --accumulate 2")
    assert d.evidence["oom_step"] == 12 and "step 12" in d.summary


def test_oom_with_a_fragmented_pool_leads_with_expandable_segments():
    big = OomEvent(step=5, t=5.0, message="oom", allocator=AllocatorSample(allocated_bytes=90 * GiB,
                                                                          reserved_bytes=138 * GiB))
    small = OomEvent(step=5, t=5.0, message="oom", allocator=AllocatorSample(allocated_bytes=130 * GiB,
                                                                            reserved_bytes=138 * GiB))
    assert judge(gpu_record(steps(4), ooms=(big,)), CUDA).fix[0].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: at the OOM 48 GiB")
    assert judge(gpu_record(steps(4), ooms=(small,)), CUDA).fix[0].startswith("activation checkpointing")


def test_memory_full_near_the_limit_generic_fix():
    rec = gpu_record(steps(30, peak_memory_bytes=int(0.97 * 141 * GiB)))
    d = judge(rec, CUDA)
    assert d.bottleneck == "memory-full"
    assert any("checkpointing" in f for f in d.fix) and any("bf16" in f for f in d.fix)


def roofline_ctx(**kw) -> Context:
    # H200 bf16 dense 989 TFLOPS, 4800 GB/s: ridge ≈ 206 FLOP/byte
    return Context(device="cuda", usable_cores=16, peak_tflops=989.0, bandwidth_gbps=4800.0, **kw)


def test_memory_bound_roofline():
    rec = gpu_record(steps(30, seconds=0.01, flops=1e12), samples(60, dt=0.005))
    d = judge(rec, roofline_ctx(planned_bytes_per_step=2e10))  # 50 FLOP/byte < ridge
    assert d.bottleneck == "memory-bound"
    ev = d.evidence
    assert ev["achieved_gbps"] == pytest.approx(2000.0)
    assert ev["achieved_tflops"] == pytest.approx(100.0)
    assert ev["mfu"] == pytest.approx(100 / 989, abs=1e-4)
    assert d.findings[0].share == pytest.approx(2e10 / 4800e9 / 0.01)
    assert any("torch.compile" in f for f in d.fix)


def test_compute_bound_roofline():
    rec = gpu_record(steps(30, seconds=0.01, flops=5e12), samples(60, dt=0.005))
    d = judge(rec, roofline_ctx(planned_bytes_per_step=5e9))  # 1000 FLOP/byte > ridge
    assert d.bottleneck == "compute-bound"
    assert d.evidence["mfu"] == pytest.approx(500 / 989, abs=1e-4)
    assert d.fix[0].startswith("nothing wrong in the loop") and any("fp8" in f for f in d.fix)


def test_roofline_from_gpm():
    mem = judge(gpu_record(sample_events=samples(60, dram_active_pct=75.0, sm_active_pct=40.0)), CUDA)
    assert mem.bottleneck == "memory-bound"
    comp = judge(gpu_record(sample_events=samples(60, sm_active_pct=90.0, tensor_active_pct=70.0)), CUDA)
    assert comp.bottleneck == "compute-bound"


def test_healthy_cpu_loop_checks_are_evidence():
    d = judge(Record(steps=steps(30, seconds=0.1, wait=0.005)), Context(device="cpu"))
    assert d.bottleneck == "healthy" and d.findings == ()
    assert d.evidence["data_wait_threshold"] == INPUT_WAIT_SHARE
    assert d.evidence["steps_judged"] == d.steps == 27  # 30 less a 3-step (10 %) warm-up


# -- borderline records that must not fire -------------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.18, 0.20, 0.27])
def test_healthy_cpu_loop_data_wait_is_not_input_bound(share):
    # §B6: a no-sleep 0-worker CPU loop measured 0.18-0.27 data-wait share
    d = judge(Record(steps=steps(40, seconds=0.1, wait=0.1 * share)), Context(device="cpu", usable_cores=2))
    assert d.bottleneck == "healthy"


def test_one_slow_step_is_not_input_bound():
    events = list(steps(30, seconds=0.1, wait=0.01))
    events[15] = StepEvent(step=16, t=events[15].t, seconds=5.0, data_wait_s=4.9)
    d = judge(Record(steps=tuple(events)), Context(device="cpu"))
    assert d.bottleneck == "healthy"


def test_warmup_steps_are_skipped():
    events = (StepEvent(step=1, t=30.0, seconds=30.0, data_wait_s=29.0),
              StepEvent(step=2, t=32.0, seconds=2.0, data_wait_s=1.5),
              *(StepEvent(step=i, t=32.0 + 0.1 * (i - 2), seconds=0.1, data_wait_s=0.01) for i in range(3, 11)))
    d = judge(Record(steps=events), Context(device="cpu"))
    assert d.bottleneck == "healthy" and d.evidence["warmup_steps_skipped"] == 2 and d.steps == 8


def test_a_late_input_bound_phase_fires_by_windows():
    # 20 healthy steps then 40 waiting ones: 2 of 3 windows hold
    events = (*steps(22, seconds=0.1, wait=0.01),
              *(StepEvent(step=23 + i, t=2.2 + 0.1 * (i + 1), seconds=0.1, data_wait_s=0.07) for i in range(40)))
    d = judge(Record(steps=events), Context(device="cpu"))
    assert d.bottleneck == "input-bound" and d.evidence["windows_held"] == "2/3"


def test_idle_and_sync_boost_are_not_throttling():
    rec = gpu_record(sample_events=samples(60, clock_reasons=("gpu_idle", "sync_boost",
                                                              "applications_clocks_setting"), sm_clock_mhz=1000.0))
    assert judge(rec, CUDA).bottleneck == "healthy"


def test_power_cap_at_max_clock_is_not_throttled():
    rec = gpu_record(sample_events=samples(60, clock_reasons=("sw_power_cap",), sm_clock_mhz=1980.0))
    assert judge(rec, CUDA).bottleneck == "healthy"


def test_idle_samples_with_low_clocks_are_not_throttling():
    # between steps the GPU idles at low clocks with a power-cap bit left over: not busy, not judged
    rec = gpu_record(sample_events=samples(60, util_pct=0.0, clock_reasons=("sw_power_cap",), sm_clock_mhz=300.0))
    d = judge(rec, CUDA)
    assert "throttled" not in names(d)


def test_reserved_slightly_above_allocated_is_not_fragmentation():
    alloc = AllocatorSample(allocated_bytes=int(40 * GiB), reserved_bytes=int(42 * GiB),
                            peak_allocated_bytes=int(41 * GiB), alloc_retries=0)
    assert judge(gpu_record(sample_events=samples(60, allocator=alloc)), CUDA).bottleneck == "healthy"


def test_small_pool_gap_is_not_fragmentation():
    # half of a 200 MiB pool unused: large share, harmless size
    alloc = AllocatorSample(allocated_bytes=100 * 2**20, reserved_bytes=200 * 2**20)
    assert judge(gpu_record(sample_events=samples(60, allocator=alloc)), CUDA).bottleneck == "healthy"


def test_ninety_percent_memory_is_not_memory_full():
    rec = gpu_record(steps(30, peak_memory_bytes=int(0.90 * 141 * GiB)),
                     samples(60, memory_used_bytes=int(0.91 * 141 * GiB)))
    d = judge(rec, CUDA)
    assert d.bottleneck == "healthy"
    assert d.evidence["peak_memory_share"] == pytest.approx(0.90, abs=1e-3)  # the steps' own peak, not NVML's


def test_exposed_comm_below_threshold_is_not_communication_bound():
    rec = gpu_record(steps(30, comm_s=0.5, exposed_comm_s=0.05))
    d = judge(rec, CUDA)
    assert d.bottleneck == "healthy"
    assert d.evidence["exposed_comm_threshold"] == COMM_EXPOSED_SHARE


# -- input-bound arithmetic ----------------------------------------------------------------------------------------


def test_input_bound_expected_effect_by_hand():
    # load 70 ms/batch with 0 workers -> wait 70 ms, compute 30 ms, step 100 ms. 4 usable cores, 1 process:
    # cap = 4 - 1 = 3 workers; needed = ceil(70 / 30) = 3; a batch every 70/3 = 23.3 ms < 30 ms -> step 30 ms.
    d = judge(Record(steps=steps(30, seconds=0.1, wait=0.07)),
                 Context(device="cuda", usable_cores=4, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert ev["load_s_per_batch"] == pytest.approx(0.07)
    assert ev["compute_s_median"] == pytest.approx(0.03)
    assert ev["workers_cap"] == 3 and ev["num_workers_new"] == 3
    assert ev["step_s_new"] == pytest.approx(0.03)
    assert ev["speedup"] == pytest.approx(0.1 / 0.03, abs=1e-3)
    assert "num_workers=3" in d.fix[0] and "pin_memory=True" in d.fix[0]
    assert "100 ms → 30 ms (3.3× faster)" in d.expected and "70% → 0%" in d.expected


def test_input_bound_with_workers_already_on():
    # 2 workers, wait 40 ms, compute 30 ms: load = 2 x (40 + 30) = 140 ms; 16 cores -> cap 15; needed ceil(140/30)=5
    # -> a batch every 28 ms, step max(30, 28) = 30 ms
    d = judge(Record(steps=steps(30, seconds=0.07, wait=0.04)),
                 Context(device="cuda", usable_cores=16, loader=Loader(num_workers=2)))
    ev = d.evidence
    assert ev["load_s_per_batch"] == pytest.approx(0.14)
    assert ev["num_workers_new"] == 5 and ev["step_s_new"] == pytest.approx(0.03)


def test_input_bound_capped_by_cores_and_world_size():
    # 4 cores shared by 2 processes: 4 // 2 - 1 = 1 worker each; 1 worker loads a batch in 70 ms > 30 ms compute
    d = judge(Record(steps=steps(30, seconds=0.1, wait=0.07)),
                 Context(device="cuda", usable_cores=4, world_size=2))
    ev = d.evidence
    assert ev["workers_cap"] == 1 and ev["num_workers_new"] == 1
    assert ev["step_s_new"] == pytest.approx(0.07)
    assert any("cannot keep up" in f and "pre-tokenize" in f for f in d.fix)


def test_input_bound_at_the_cap_asks_for_a_faster_dataset():
    d = judge(Record(steps=steps(30, seconds=0.1, wait=0.07)),
                 Context(device="cpu", usable_cores=2, loader=Loader(num_workers=1)))
    assert d.bottleneck == "input-bound"
    assert "num_workers_new" not in d.evidence
    assert any(f.startswith("a faster dataset") for f in d.fix)


# -- input-bound: the loading's cause against the cores actually free, and the workers' cap -------------------------


def host_steps(n: int, *, seconds: float, wait: float, cpu_in_wait: float | None, host: HostSample,
               dt: float = 0.5) -> Record:
    """n steps with the data wait and the process's CPU time during it, and a host sample every dt seconds."""
    events = steps(n, seconds=seconds, wait=wait, data_wait_cpu_s=cpu_in_wait)
    return Record(steps=events, samples=tuple(Sample(t=(i + 1) * dt, host=host)
                                              for i in range(int(n * seconds / dt) + 1)))


BUSY_2 = (100.0, 100.0)  # both cores of a 2-core host busy


def test_cpu_bound_loader_starved_on_a_busy_host_is_not_io_and_gets_no_workers():
    """Issue 29: a CPU-bound loader (0 workers) on a 2-core host saturated by other work got 40% of a core and was
    called "waits on I/O", with 3 workers proposed on 2 cores. By hand: busy 2.0 cores, this process 0.4, other work
    1.6, free 2 - 1.6 = 0.4; the loading used 0.4 of the 0.4 it could have had (100% >= 50%): CPU-starved; whole free
    cores floor(0.4 + 0.2) = 0 -> workers_cap 0: no worker, free the cores instead."""
    host = HostSample(cpu_pct=BUSY_2, process_cpu_pct=40.0, workers=0, workers_cpu_pct=0.0)
    rec = host_steps(30, seconds=0.1, wait=0.07, cpu_in_wait=0.028, host=host)
    d = judge(rec, Context(device="cpu", usable_cores=2, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert d.bottleneck == "input-bound"
    assert ev["busy_cores"] == 2.0 and ev["busy_cores_other_work"] == pytest.approx(1.6)
    assert ev["free_cores"] == pytest.approx(0.4) and ev["loading_cpu_offered"] == pytest.approx(0.4)
    assert ev["loading_cpu_share"] == pytest.approx(0.4) and ev["loading_cpu_of_offered"] == pytest.approx(1.0)
    assert ev["loading_cause"] == "cpu-starved" and not ev["loading_waits_on_io"]
    assert ev["workers_cap"] == 0 and "num_workers_new" not in ev
    assert d.fix[0].startswith("free the cores: other work keeps 1.6 of the 2 cores busy")
    assert not any("num_workers=" in f for f in d.fix)


def test_cpu_bound_loader_on_an_idle_host_keeps_a_core_for_training():
    # the same loader alone: busy 1.0 (0.95 ours), other 0.05, free 1.95 -> offered a whole core, used 0.95: CPU;
    # whole free cores floor(1.95 + 0.2) = 2 -> cap 2 - 1 = 1 (3 needed: ceil(70/30)); step max(30, 70/1) = 70 ms
    host = HostSample(cpu_pct=(95.0, 5.0), process_cpu_pct=95.0, workers=0, workers_cpu_pct=0.0)
    d = judge(host_steps(30, seconds=0.1, wait=0.07, cpu_in_wait=0.0665, host=host),
              Context(device="cpu", usable_cores=2, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert ev["loading_cause"] == "cpu" and ev["loading_cpu_offered"] == 1.0
    assert ev["workers_cap"] == 1 and ev["num_workers_new"] == 1 and ev["step_s_new"] == pytest.approx(0.07)
    assert "num_workers=1" in d.fix[0] and any("cannot keep up (3 needed)" in f for f in d.fix)


def test_io_bound_loader_may_exceed_the_cores():
    # a loader that sleeps on a host with 0.5 core of other work: busy 0.55, ours 0.05, other 0.5, free 1.5 ->
    # offered a whole core, used 0.01 (1% < 50%): I/O; I/O loading may take 4 workers a core (workers_cap(2,
    # waits_on_io=True) = 8): the 3 needed (ceil(70/30)) are proposed on 2 cores
    host = HostSample(cpu_pct=(50.0, 5.0), process_cpu_pct=5.0, workers=0, workers_cpu_pct=0.0)
    d = judge(host_steps(30, seconds=0.1, wait=0.07, cpu_in_wait=0.0007, host=host),
              Context(device="cpu", usable_cores=2, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert ev["loading_cause"] == "io" and ev["loading_waits_on_io"]
    assert ev["loading_cpu_offered"] == 1.0 and ev["loading_cpu_of_offered"] == pytest.approx(0.01)
    assert ev["workers_cap"] == 8 and ev["num_workers_new"] == 3


def test_waiting_loader_on_a_saturated_host_is_unclear_and_capped_by_the_free_cores():
    # the same loader with both cores busy: off the CPU with 0.05 core offered (other 1.95): waiting on I/O and
    # waiting for a core look alike in CPU time (benchmarks/host_rules_check.py: a trivial generator on the saturated
    # host measured 0.00 of 0.17 core); the safe side: floor(0.05 + 0.2) = 0 free cores -> no worker
    host = HostSample(cpu_pct=BUSY_2, process_cpu_pct=5.0, workers=0, workers_cpu_pct=0.0)
    d = judge(host_steps(30, seconds=0.1, wait=0.07, cpu_in_wait=0.0007, host=host),
              Context(device="cpu", usable_cores=2, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert ev["loading_cause"] == "unclear" and not ev["loading_waits_on_io"]
    assert ev["loading_cpu_offered"] == pytest.approx(0.05) and ev["workers_cap"] == 0
    assert any(f.startswith("if each batch waits on a disk or network read") and "up to 8" in f for f in d.fix)


def test_waiting_loader_on_a_saturated_host_whose_thread_never_waited_for_a_core_is_io():
    """The same saturated host, and the kernel's run-queue time of the wait says the loop's thread hardly waited
    for a core (2 ms of a 70 ms wait, under IO_RUNQ_SHARE): it waits on I/O, so workers may exceed the cores."""
    host = HostSample(cpu_pct=BUSY_2, process_cpu_pct=5.0, workers=0, workers_cpu_pct=0.0)
    rec = host_steps(30, seconds=0.1, wait=0.07, cpu_in_wait=0.0007, host=host)
    rec = Record(steps=tuple(replace(s, data_wait_runq_s=0.002) for s in rec.steps), samples=rec.samples)
    d = judge(rec, Context(device="cpu", usable_cores=2, loader=Loader(num_workers=0)))
    ev = d.evidence
    assert ev["loading_cause"] == "io" and ev["loading_waits_on_io"] and "schedstat" in ev["loading_cause_reading"]
    assert ev["workers_cap"] == 8 and ev["num_workers_new"] == 3


def test_cpu_bound_workers_capped_by_the_free_cores_of_a_16_core_host():
    """Issue 29's 16-core case got 10 workers for CPU-bound work. 2 workers at 0.95 core each, main 0.2; 8 cores at
    100% and 8 at 1.25%: busy 8.1, this run 2.1, other 6.0, free 10. Each worker offered min(1, (10 - 0.2) / 2) = 1,
    used 0.95: CPU. load = 2 x (120 + 30) = 300 ms -> 10 workers to cover 30 ms of compute; cap floor(10.2) - 1 = 9."""
    host = HostSample(cpu_pct=(100.0,) * 8 + (1.25,) * 8, process_cpu_pct=20.0, workers=2, workers_cpu_pct=190.0)
    d = judge(host_steps(30, seconds=0.15, wait=0.12, cpu_in_wait=None, host=host),
              Context(device="cuda", usable_cores=16, loader=Loader(num_workers=2)))
    ev = d.evidence
    assert ev["loading_cause"] == "cpu" and ev["free_cores"] == pytest.approx(10.0)
    assert ev["workers_to_cover_load"] == 10 and ev["workers_cap"] == 9 and ev["num_workers_new"] == 9
    assert ev["num_workers_new"] <= ev["free_cores"] - 1
    # without host samples the same record is capped by the usable cores alone (16 - 1 = 15 >= 10 needed)
    bare = judge(Record(steps=steps(30, seconds=0.15, wait=0.12)),
                 Context(device="cuda", usable_cores=16, loader=Loader(num_workers=2)))
    assert bare.evidence["loading_cause"] == "unknown" and bare.evidence["num_workers_new"] == 10


def test_starved_workers_on_a_busy_host_are_cpu_bound():
    # 1 worker at 0.3 core, main 0.2, both cores busy: other 1.5, free 0.5, offered (0.5 - 0.2) / 1 = 0.3 -> used all
    # of it: CPU-starved (the old rule: 0.3 < 0.5 of a core, "waits on I/O", 8 workers allowed)
    host = HostSample(cpu_pct=BUSY_2, process_cpu_pct=20.0, workers=1, workers_cpu_pct=30.0)
    d = judge(host_steps(30, seconds=0.1, wait=0.06, cpu_in_wait=None, host=host),
              Context(device="cpu", usable_cores=2, loader=Loader(num_workers=1)))
    ev = d.evidence
    assert ev["loading_cause"] == "cpu-starved" and ev["loading_cpu_offered"] == pytest.approx(0.3)
    assert ev["workers_cap"] == 0 and "num_workers_new" not in ev


def test_watch_starved_workers_on_a_busy_host_are_input_bound_within_the_cores():
    # no step timings: 2 workers at 35% each, main 20%, both cores busy: other 2 - 0.9 = 1.1, offered each
    # (0.9 - 0.2) / 2 = 0.35 -> 100% of what they could have (>= 90%): input-bound; whole free floor(0.9 + 0.2) = 1
    # -> cap 0: no more workers on this host
    host = HostSample(cpu_pct=BUSY_2, process_cpu_pct=20.0, workers=2, workers_cpu_pct=70.0)
    rec = Record(samples=tuple(Sample(t=float(i), host=host) for i in range(30)))
    d = judge(rec, Context(device="cpu", usable_cores=2))
    assert d.bottleneck == "input-bound"
    assert d.evidence["loading_cause"] == "cpu-starved" and d.evidence["workers_cpu_of_offered_median_pct"] == 100.0
    assert not any("num_workers=" in f for f in d.fix)
    assert "2 workers already use the 2 usable cores, 0.9 free of other work" in d.fix[0]


def test_watch_idle_workers_on_an_idle_host_are_not_input_bound():
    # the same workers with nothing else running: offered min(1, (2 - 0.2) / 2) = 0.9 each, used 0.35 (39% < 90%)
    host = HostSample(cpu_pct=(45.0, 45.0), process_cpu_pct=20.0, workers=2, workers_cpu_pct=70.0)
    rec = Record(samples=tuple(Sample(t=float(i), host=host) for i in range(30)))
    d = judge(rec, Context(device="cpu", usable_cores=2))
    assert d.bottleneck == "not-judged" and d.evidence["workers_cpu_of_offered_median_pct"] == pytest.approx(38.9)


def test_watch_busy_workers_double_within_the_free_cores():
    # 4 workers at 95% each and main 20% on 16 cores, 10 of them busy: busy 10.0, this run 4.0, other work 6.0,
    # free 16 - 6 = 10 -> cap floor(10.2) - 1 = 9; doubling the 4 workers gives 8 <= 9
    host = HostSample(cpu_pct=(100.0,) * 10 + (0.0,) * 6, process_cpu_pct=20.0, workers=4, workers_cpu_pct=380.0)
    d = judge(Record(samples=samples(60, util_pct=20.0, host=host), device_kind="cuda"), CUDA)
    assert d.bottleneck == "input-bound" and d.evidence["free_cores"] == pytest.approx(10.0)
    assert "num_workers=8" in d.fix[0] and "up to 9 workers" in d.fix[0]


# -- primary ordering ----------------------------------------------------------------------------------------------


def test_primary_is_the_largest_share():
    rec = gpu_record(steps(30, wait=0.5, comm_s=0.3, exposed_comm_s=0.2), samples(60, util_pct=30.0))
    d = judge(rec, CUDA)
    assert names(d) == ["input-bound", "communication-bound"]
    rec = gpu_record(steps(30, wait=0.35, comm_s=0.5, exposed_comm_s=0.45), samples(60, util_pct=20.0))
    assert names(judge(rec, CUDA)) == ["communication-bound", "input-bound"]


def test_oom_comes_first_and_risks_after_time():
    oom = OomEvent(step=40, t=40.0, message="CUDA out of memory")
    alloc = AllocatorSample(allocated_bytes=20 * GiB, reserved_bytes=40 * GiB, peak_allocated_bytes=24 * GiB)
    rec = gpu_record(steps(30, wait=0.6), samples(60, allocator=alloc, util_pct=40.0), ooms=(oom,))
    assert names(judge(rec, CUDA)) == ["memory-full", "input-bound", "fragmentation"]
    rec = gpu_record(steps(30, wait=0.6), samples(60, allocator=alloc, util_pct=40.0))
    d = judge(rec, CUDA)
    assert names(d) == ["input-bound", "fragmentation"]
    assert render_lines(d)[-1].startswith("also: fragmentation")


def test_throttled_ranks_by_share_with_input():
    rec = gpu_record(steps(30, wait=0.4), samples(60, util_pct=60.0, clock_reasons=("HwSlowdown",),
                                                  sm_clock_mhz=990.0))
    d = judge(rec, CUDA)
    assert names(d) == ["throttled", "input-bound"]  # 50 % clock loss > 40 % data wait


def test_roofline_is_not_said_when_a_loss_fires():
    rec = gpu_record(steps(30, seconds=0.01, wait=0.005, flops=1e12), samples(60, dt=0.005, util_pct=50.0))
    d = judge(rec, roofline_ctx(planned_bytes_per_step=2e10))
    assert names(d) == ["input-bound"]


# -- watch: no step timings, and the empty record ------------------------------------------------------------------


def test_watch_gpu_waits_on_the_python_process():
    host = HostSample(cpu_pct=(100.0, 5.0, 3.0, 2.0), process_cpu_pct=99.0, workers=0, workers_cpu_pct=0.0)
    rec = Record(samples=samples(60, util_pct=25.0, host=host), device_kind="cuda")
    d = judge(rec, CUDA)
    assert d.bottleneck == "host-bound" and d.steps == 0
    assert "input-bound or host-bound" in d.evidence["reading"]
    assert d.evidence["step_timings"] == "not available"
    assert "no step timings" in d.note


def test_watch_busy_workers_are_input_bound():
    host = HostSample(process_cpu_pct=30.0, workers=4, workers_cpu_pct=390.0)
    d = judge(Record(samples=samples(60, util_pct=20.0, host=host), device_kind="cuda"), CUDA)
    assert d.bottleneck == "input-bound" and "workers" in d.summary


def test_watch_io_wait_is_input_bound_on_cpu():
    host = HostSample(cpu_pct=(10.0, 10.0), process_cpu_pct=10.0, iowait_pct=70.0)
    rec = Record(samples=tuple(Sample(t=float(i), host=host) for i in range(30)))
    d = judge(rec, Context(device="cpu", usable_cores=2))
    assert d.bottleneck == "input-bound" and "I/O wait" in d.summary
    assert "host side only" in d.note


def test_watch_busy_gpu_without_step_timings_is_not_judged_and_says_what_to_add():
    """Issue 29: a device-only view that fires nothing cannot tell a healthy loop from one waiting on its data: not
    "healthy" but "not-judged", naming what was missing and how to supply it."""
    host = HostSample(process_cpu_pct=99.0)
    d = judge(Record(samples=samples(60, host=host), device_kind="cuda"), CUDA)
    assert d.bottleneck == "not-judged" and "gpuwise.Monitor" in d.fix[0]
    assert d.evidence["missing"] == ["step timings"] and d.summary.startswith("not judged: no step timings")


def test_watch_startup_idle_is_warmup():
    # 20 s of loading (GPU idle, one core busy) then 40 s of training: the idle start is not judged
    host = HostSample(process_cpu_pct=100.0)
    idle = tuple(Sample(t=float(i), devices=(device(util_pct=0.0),), host=host) for i in range(20))
    busy = tuple(Sample(t=20.0 + i, devices=(device(),), host=host) for i in range(40))
    d = judge(Record(samples=idle + busy, device_kind="cuda"), CUDA)
    assert d.bottleneck == "not-judged" and d.evidence["samples_judged"] == 40  # no step timings: not "healthy"


def test_watch_idle_gpu_idle_host_is_not_blamed_on_the_host():
    host = HostSample(process_cpu_pct=5.0)
    rec = Record(samples=samples(60, util_pct=15.0, host=host), device_kind="cuda")
    d = judge(rec, CUDA)
    assert d.bottleneck == "not-judged" and "neither the Python process" in d.evidence["reading"]


def test_empty_record():
    d = judge(Record())
    assert d.bottleneck == "not-judged" and d.note == "nothing recorded" and d.steps == 0
    assert render_lines(d)[0] == "bottleneck: not-judged (nothing recorded)"


def test_few_steps_are_not_judged():
    d = judge(Record(steps=steps(2, seconds=0.1, wait=0.09)), Context(device="cpu"))
    assert d.bottleneck == "not-judged" and "too few" in d.note and "too few steps" in d.summary


def test_record_note_is_kept():
    d = judge(Record(steps=steps(10, seconds=0.1), note="no NVIDIA GPU: watching the CPU side"))
    assert d.note.startswith("no NVIDIA GPU: watching the CPU side; ")


# -- observed vs planned, output -----------------------------------------------------------------------------------


def test_observed_vs_planned():
    rec = gpu_record(steps(30, seconds=1.2, peak_memory_bytes=60 * GiB))
    ctx = Context(device="cuda", usable_cores=16, planned_step_s=1.0, planned_peak_bytes=50 * GiB)
    ovp = judge(rec, ctx).observed_vs_planned
    assert ovp["step_s"] == {"observed": 1.2, "planned": 1.0, "ratio": 1.2}
    assert ovp["peak_bytes"]["observed"] == 60 * GiB and ovp["peak_bytes"]["ratio"] == 1.2
    lines = render_lines(judge(rec, ctx))
    assert any(line.startswith("step: 1200 ms observed vs 1000 ms planned (1.20×)") for line in lines)
    assert any(line.startswith("peak memory: 60 GiB observed vs 50 GiB planned") for line in lines)


def test_render_lines_input_bound():
    d = judge(Record(steps=steps(30, seconds=0.1, wait=0.071)), Context(device="cpu", usable_cores=4))
    lines = render_lines(d)
    assert lines[0] == "bottleneck: input-bound (data wait 71% of each step)"
    assert lines[1].startswith("fix: DataLoader(..., num_workers=3")
    assert any(line.startswith("expected: ") for line in lines)
    assert lines[-1].startswith("note: no GPU counters")


ALL_RECORDS = {
    "input": (Record(steps=steps(30, seconds=0.1, wait=0.07)), Context(usable_cores=4)),
    "comm": (gpu_record(steps(30, comm_s=0.5, exposed_comm_s=0.3)), CUDA),
    "oom": (gpu_record(ooms=(OomEvent(step=3, t=3.0, message="oom", allocator=AllocatorSample(
        allocated_bytes=10, reserved_bytes=100)),)), CUDA),
    "throttled": (gpu_record(sample_events=samples(60, clock_reasons=("sw_power_cap",), sm_clock_mhz=1500.0)), CUDA),
    "watch": (Record(samples=samples(60, util_pct=25.0, host=HostSample(process_cpu_pct=99.0))), CUDA),
    "empty": (Record(), None),
    "roofline": (gpu_record(steps(30, seconds=0.01, flops=1e12), samples(60, dt=0.005)),
                 roofline_ctx(planned_bytes_per_step=2e10, planned_step_s=0.008, planned_peak_bytes=1e9)),
}


@pytest.mark.parametrize("key", ALL_RECORDS)
def test_diagnosis_json_round_trips(key):
    rec, ctx = ALL_RECORDS[key]
    d = judge(rec, ctx)
    out = diagnosis_json(d)
    assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert out["bottleneck"] in BOTTLENECKS and isinstance(out["fix"], list)
    assert set(out) >= {"bottleneck", "evidence", "fix", "expected", "findings", "observed_vs_planned", "note",
                        "steps"}
    assert [f["bottleneck"] for f in out["findings"]] == names(d)
    assert all(isinstance(line, str) and line for line in render_lines(d))


def test_a_wait_the_gpu_ran_queued_work_through_is_not_input_bound():
    # a user's loop that never synchronises: next() is timed while the GPU still runs the previous step (review)
    rec = gpu_record(steps(30, wait=0.35), samples(60, util_pct=98.0))
    assert "input-bound" not in names(judge(rec, CUDA))
    rec = gpu_record(steps(30, wait=0.35), samples(60, util_pct=55.0))
    assert judge(rec, CUDA).bottleneck == "input-bound"


def test_the_steps_peak_keeps_a_pool_sized_for_them_from_looking_fragmented():
    # the trainer resets the allocator's peak each step: a sample in the data wait sees only weights and states
    alloc = AllocatorSample(allocated_bytes=11 * GiB, reserved_bytes=37 * GiB, peak_allocated_bytes=11 * GiB)
    rec = gpu_record(steps(30, peak_memory_bytes=36 * GiB), samples(60, allocator=alloc))
    assert "fragmentation" not in names(judge(rec, CUDA))


def test_memory_full_by_other_processes_is_not_ours_to_fix():
    rec = gpu_record(steps(30, peak_memory_bytes=10 * GiB),
                     samples(60, memory_used_bytes=138 * GiB, process_memory_bytes=11 * GiB))
    d = judge(rec, CUDA)
    assert "memory-full" not in names(d)
