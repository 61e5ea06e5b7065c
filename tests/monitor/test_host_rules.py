"""monitor.host_rules.oversubscribed and host-bound on a CPU run (loop_rules._cpu_host_bound): synthetic records whose
expectations are computed by hand in each test, and the records that must not fire (a run alone at threads == cores,
one thread, a transient, a CPU run using its threads, a long step, a busy host). The real runs are in
benchmarks/host_rules_check.py (a shared 2-core machine cannot hold them steady enough for a test)."""

from __future__ import annotations

import pytest

from gpuwise.monitor.host_rules import cores_free, other_cores
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import DeviceSample, HostSample, Record, Sample, StepEvent
from gpuwise.monitor.thresholds import OVERSUB_LOAD_RATIO
from gpuwise.monitor.verdict import Context, Diagnosis


def steps(n: int = 30, *, seconds: float, wait: float = 0.0, items: int | None = None) -> tuple[StepEvent, ...]:
    return tuple(StepEvent(step=i + 1, t=(i + 1) * seconds, seconds=seconds, data_wait_s=wait, items=items)
                 for i in range(n))


def run(hosts: list[HostSample] | HostSample, *, seconds: float = 0.793, n: int = 30, gpu: bool = False,
        items: int | None = None) -> Record:
    """n steps of `seconds` and a host sample every 0.5 s over them (the same one, or the list in turn)."""
    events = steps(n, seconds=seconds, items=items)
    count = int(n * seconds / 0.5) + 1
    seq = hosts if isinstance(hosts, list) else [hosts] * count
    dev = (DeviceSample(index=0, util_pct=60.0),) if gpu else ()
    return Record(steps=events, samples=tuple(Sample(t=(i + 1) * 0.5, host=seq[i % len(seq)], devices=dev)
                                             for i in range(count)), device_kind="cuda" if gpu else "cpu")


def finding(d: Diagnosis, name: str):
    return next((f for f in d.findings if f.bottleneck == name), None)


# -- the cores other work leaves -----------------------------------------------------------------------------------


def test_cores_free_by_hand():
    # 4 cores at 100, 100, 50, 10 = 2.6 busy; this process 0.8 and its workers 0.6: other work 1.2, free 4 - 1.2
    h = HostSample(cpu_pct=(100.0, 100.0, 50.0, 10.0), process_cpu_pct=80.0, workers_cpu_pct=60.0)
    c = cores_free([h] * 3, usable=4)
    assert (c.host, c.busy, c.ours, c.other, c.free) == (4, pytest.approx(2.6), pytest.approx(1.4),
                                                         pytest.approx(1.2), pytest.approx(2.8))
    assert c.free_whole == 3  # floor(2.8 + 0.2)
    assert cores_free([h], usable=2).free == 2.0  # never more than the usable cores
    # 2 ranks alike: the sibling's 1.4 cores are this run's, not other work
    assert other_cores(h, 2) == 0.0 and cores_free([HostSample()], usable=4) is None


# -- oversubscribed ------------------------------------------------------------------------------------------------


def test_issue_case_default_threads_on_a_saturated_two_core_box():
    """Issue 29: torch's 2 threads on a 2-core box saturated by other work (793 ms a step, 31 ms with
    OMP_NUM_THREADS=1). Both cores 100% busy, the process 1.0 core, load 4.0 >= 1.25 x 2. By hand: other work
    2 - 1 = 1 core, free 1 -> OMP_NUM_THREADS = floor(1 + 0.2) // 1 = 1; a runnable thread waits 1 - 2/4 = 50% of the
    time (fair share), and the process gets 1.0 of the 2 cores its threads would run on (1 - 1/2 = 50%)."""
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0, load_1m=4.0, process_threads=3,
                      tree_threads=3, tree_processes=1, workers=0, workers_cpu_pct=0.0)
    d = judge(run(host), Context(device="cpu", usable_cores=2, threads=2))
    f = finding(d, "oversubscribed")
    assert f is not None and d.bottleneck == "oversubscribed"
    assert f.share == pytest.approx(0.5) and f.evidence["cause"] == "run-queue"
    assert f.evidence["busy_cores_other_work"] == pytest.approx(1.0) and f.evidence["free_cores"] == 1.0
    assert f.fix[0].startswith("OMP_NUM_THREADS=1 (or torch.set_num_threads(1)") and f.change == {"threads": 1}
    assert any("move or stop the other work" in x for x in f.fix)
    assert "793 ms to 31 ms" in f.expected and "runnable threads on 2 cores" in f.summary
    assert finding(d, "host-bound") is None  # the busy host explains the one core: not Python overhead


@pytest.mark.parametrize("runq, fires", [(1.4, True), (0.0, False)])
def test_the_runs_own_run_queue_wait_decides_on_a_loaded_box(runq, fires):
    """The same saturated box and load: where the kernel says the run's threads waited for a core (schedstat, ~1.4
    threads measured for a 2-thread matmul loop on this loaded 2-core box) it is oversubscribed; a loop whose threads
    never wait (it sleeps, or waits on a GPU or a disk) is not slowed by someone else's load."""
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0, load_1m=4.0, process_threads=3,
                      tree_threads=3, tree_processes=1, workers=0, workers_cpu_pct=0.0, runq_threads=runq)
    d = judge(run(host), Context(device="cpu", usable_cores=2, threads=2))
    assert (finding(d, "oversubscribed") is not None) is fires


def test_without_the_run_queue_the_process_starved_of_its_cores_fires():
    # no load_1m (another OS): the process gets 1.0 core < 0.75 x min(2 threads, 2 cores) = 1.5 on saturated cores
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0)
    f = finding(judge(run(host), Context(device="cpu", usable_cores=2, threads=2)), "oversubscribed")
    assert f is not None and f.evidence["cause"] == "starved" and f.share == pytest.approx(0.5)


def test_ranks_times_threads_past_the_cores_on_a_gpu_host():
    """4 ranks x 8 threads = 32 on 16 cores, every core busy, each rank at 4 cores, load 30. By hand: this run 4 x 4
    = 16 cores, other work 0, free 16 -> OMP_NUM_THREADS = 16 // 4 = 4; waits max(1 - 16/30, 1 - 16/32) = 50%."""
    host = HostSample(cpu_pct=(100.0,) * 16, process_cpu_pct=400.0, load_1m=30.0, workers=0, workers_cpu_pct=0.0)
    d = judge(run(host, seconds=0.2, gpu=True), Context(device="cuda", usable_cores=16, threads=8, world_size=4))
    f = finding(d, "oversubscribed")
    assert f is not None and f.evidence["cause"] == "threads" and f.evidence["threads_x_processes"] == 32
    assert f.share == pytest.approx(0.5) and f.change == {"threads": 4}
    assert "OMP_NUM_THREADS=4" in f.fix[0] and "torchrun sets OMP_NUM_THREADS=1" in f.fix[0]
    assert f.expected.startswith("the host side")


def test_workers_beside_the_threads_are_named():
    # 2 threads and 2 workers at 0.5 core each on 2 saturated cores: free 2 (no other work) less the workers' 1.0 ->
    # OMP_NUM_THREADS 1, and fewer workers
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0, workers=2, workers_cpu_pct=100.0, load_1m=3.0)
    f = finding(judge(run(host), Context(device="cpu", usable_cores=2, threads=2)), "oversubscribed")
    assert f is not None and f.change == {"threads": 1}
    assert any(x.startswith("fewer DataLoader workers: 2 workers hold 1.0 cores") for x in f.fix)


def test_a_run_alone_at_threads_equal_cores_is_not_oversubscribed():
    # the box is fully busy with the run itself: 2 threads on 2 cores, 1.95 cores to the process, load 2.1 < 2.5
    host = HostSample(cpu_pct=(98.0, 97.0), process_cpu_pct=195.0, load_1m=2.1)
    d = judge(run(host), Context(device="cpu", usable_cores=2, threads=2))
    assert d.bottleneck == "healthy"
    assert d.evidence["samples_oversubscribed"] == 0.0 and d.evidence["load_ratio_threshold"] == OVERSUB_LOAD_RATIO
    # and 16 threads on 16 cores with the monitor's own thread and a loader worker in the queue: load 17.5 < 20
    host = HostSample(cpu_pct=(99.0,) * 16, process_cpu_pct=1560.0, load_1m=17.5)
    assert judge(run(host), Context(device="cpu", usable_cores=16, threads=16)).bottleneck == "healthy"


def test_one_thread_on_a_busy_box_is_not_oversubscribed():
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=60.0, load_1m=5.0)
    d = judge(run(host), Context(device="cpu", usable_cores=2, threads=1))
    assert finding(d, "oversubscribed") is None
    assert d.evidence["oversubscription"] == "one compute thread: nothing to cut"


def test_a_transient_contention_is_not_oversubscribed():
    # 5 of the samples contended (another job's burst, past the warm-up): no window holds it
    calm = HostSample(cpu_pct=(98.0, 97.0), process_cpu_pct=195.0, load_1m=2.0)
    busy = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0, load_1m=4.0)
    seq = [busy if i in (10, 11, 12, 30, 31) else calm for i in range(48)]
    d = judge(run(seq), Context(device="cpu", usable_cores=2, threads=2))
    assert d.bottleneck == "healthy"
    assert d.evidence["samples_oversubscribed"] == pytest.approx(5 / d.evidence["samples_judged"], abs=1e-3)


def test_a_gpu_run_whose_threads_idle_is_not_oversubscribed():
    # the host is busy with other work, the process holds its Python core, 8 torch threads idle (the GPU computes):
    # the starved test is for CPU runs; the load 15 < 1.25 x 16 and 8 threads <= 16 cores
    host = HostSample(cpu_pct=(95.0,) * 16, process_cpu_pct=100.0, load_1m=15.0)
    d = judge(run(host, seconds=0.2, gpu=True), Context(device="cuda", usable_cores=16, threads=8))
    assert finding(d, "oversubscribed") is None


def test_oversubscription_needs_the_thread_count_and_host_samples():
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=100.0, load_1m=4.0, process_threads=3)
    d = judge(run(host), Context(device="cpu", usable_cores=2))
    assert d.bottleneck == "healthy" and "not judged" in d.evidence["oversubscription"]
    assert d.evidence["os_threads_of_process"] == 3
    d = judge(Record(steps=steps(30, seconds=0.1)), Context(device="cpu", usable_cores=2, threads=2))
    assert d.evidence["oversubscription"].startswith("not judged: no host samples")


# -- host-bound on a CPU run ---------------------------------------------------------------------------------------


def test_tiny_model_on_one_core_with_free_cores_is_host_bound():
    """A 2 ms step of 32 samples, the process at 1.0 core, torch's 2 threads, the other core idle (3%): other work
    1.03 - 1.0 = 0.03, free 1.97 (2 whole) -> the pool could use 2 cores and uses 1: idle share 1 - 1/2 = 50%;
    16000 samples/s now, up to 8x with an 8x batch."""
    host = HostSample(cpu_pct=(100.0, 3.0), process_cpu_pct=100.0, load_1m=1.0)
    d = judge(run(host, seconds=0.002, n=3000, items=32), Context(device="cpu", usable_cores=2, threads=2))
    assert d.bottleneck == "host-bound"
    f = d.findings[0]
    assert f.share == pytest.approx(0.5) and f.evidence["cores_the_pool_could_use"] == 2
    assert f.evidence["samples_per_s"] == pytest.approx(16000.0)
    assert "a larger batch" in f.fix[0] and any("torch.compile" in x for x in f.fix)
    assert "16000 → up to ~128000 samples/s" in f.expected
    assert finding(d, "oversubscribed") is None  # the cores are not saturated


def test_a_cpu_run_using_its_threads_is_not_host_bound():
    host = HostSample(cpu_pct=(98.0, 97.0), process_cpu_pct=195.0, load_1m=2.0)
    d = judge(run(host, seconds=0.002, n=3000), Context(device="cpu", usable_cores=2, threads=2))
    assert d.bottleneck == "healthy" and d.evidence["process_cpu_median_pct"] == 195.0


def test_a_long_step_on_one_core_is_not_host_bound():
    # 100 ms on one core with a free one: maybe an op torch does not parallelise, not per-op overhead
    host = HostSample(cpu_pct=(100.0, 3.0), process_cpu_pct=100.0)
    d = judge(run(host, seconds=0.1), Context(device="cpu", usable_cores=2, threads=2))
    assert d.bottleneck == "healthy" and d.evidence["step_s_median"] == 0.1


def test_one_thread_or_no_free_core_is_not_host_bound():
    host = HostSample(cpu_pct=(100.0, 3.0), process_cpu_pct=100.0)
    d = judge(run(host, seconds=0.002, n=3000), Context(device="cpu", usable_cores=2, threads=1))
    assert d.bottleneck == "healthy" and "could not have run wider" in d.evidence["cpu_host"]
    # other work holds 0.9 of a core: free 1.1 (1 whole), so the pool had nowhere to run
    host = HostSample(cpu_pct=(100.0, 90.0), process_cpu_pct=100.0)
    d = judge(run(host, seconds=0.002, n=3000), Context(device="cpu", usable_cores=4, threads=4))
    assert finding(d, "host-bound") is None


def test_a_run_already_at_one_thread_a_process_is_told_to_move_the_other_work_not_to_cut_threads():
    """watch_truth f: two gloo ranks at OMP_NUM_THREADS=1 on a box other work keeps busy: the thread fix is already
    applied, so the fix is the other work (never OMP_NUM_THREADS=1 again)."""
    host = HostSample(cpu_pct=(100.0, 100.0), process_cpu_pct=60.0, load_1m=5.0, workers=0, workers_cpu_pct=0.0,
                      runq_threads=1.2)
    d = judge(run(host), Context(device="cpu", usable_cores=2, threads=1, world_size=2))
    f = finding(d, "oversubscribed")
    assert f is not None and f.change == {}
    assert not any(x.startswith("OMP_NUM_THREADS") for x in f.fix)
    assert f.fix[-1].startswith("move or stop the other work")


def test_a_wait_in_next_spent_waiting_for_a_core_is_not_input_bound():
    """watch_truth g: a loop reading a list beside a hog on every core waits in next() runnable, with no core: the
    run-queue share of the wait (schedstat) says it is contention, not the data."""
    events = tuple(StepEvent(step=i + 1, t=(i + 1) * 0.1, seconds=0.1, data_wait_s=0.06, data_wait_cpu_s=0.0,
                             data_wait_runq_s=runq) for i, runq in enumerate([0.05] * 30))
    d = judge(Record(steps=events), Context(device="cpu", usable_cores=2, threads=1))
    assert finding(d, "input-bound") is None
    assert d.bottleneck == "healthy" and "contention" in d.evidence["input_bound"]
    slept = tuple(StepEvent(step=i + 1, t=(i + 1) * 0.1, seconds=0.1, data_wait_s=0.06, data_wait_cpu_s=0.0,
                            data_wait_runq_s=0.001) for i in range(30))
    assert judge(Record(steps=slept), Context(device="cpu", usable_cores=2, threads=1)).bottleneck == "input-bound"
