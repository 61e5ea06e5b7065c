"""gpuwise.measure: no clock read without a synchronisation, the same figures as a context manager and as
a decorator, and rates from the median."""

from __future__ import annotations

import pytest

from fakes.timer import FakeClock, FakeGpu, launch
from gpuwise.bench import measure
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.device import device_for


def test_every_clock_read_follows_a_synchronisation():
    log: list[str] = []
    gpu = FakeGpu(log)
    with measure(device=gpu, warmup=2, repeats=3, clock=FakeClock(gpu)) as m:
        for _ in m:
            launch(gpu)
    assert m.result.repeats == 3 and m.result.warmup == 2
    for i, event in enumerate(log):
        if event == "clock":
            assert log[i - 1] == "sync"
    assert log.index("reset") < log.index("launch") and log[-1] == "peak"
    assert m.result.peak_memory_bytes == 1234


def test_context_manager_and_decorator_give_the_same_figures():
    gpu_a, gpu_b = FakeGpu([]), FakeGpu([])
    with measure(device=gpu_a, warmup=1, repeats=4, flops=2e9, clock=FakeClock(gpu_a)) as m:
        for _ in m:
            launch(gpu_a)

    @measure(device=gpu_b, warmup=1, repeats=4, flops=2e9, clock=FakeClock(gpu_b))
    def step():
        launch(gpu_b)
        return "out"

    assert step() == "out"
    a, b = m.result, step.measurement
    assert (a.times_s, a.median_s, a.p10_s, a.p90_s, a.tflops) == (b.times_s, b.median_s, b.p10_s, b.p90_s, b.tflops)
    assert a.median_s == pytest.approx(1e-3)  # one clock tick between the two synchronised reads of a repeat
    assert a.tflops == pytest.approx(2e9 / 1e-3 / 1e12)


def test_a_block_without_the_loop_is_one_run():
    gpu = FakeGpu([])
    with measure(device=gpu, warmup=5, repeats=9, bytes=4e6, clock=FakeClock(gpu)) as m:
        launch(gpu)
    assert m.result.repeats == 1 and m.result.warmup == 0
    assert m.result.gbps == pytest.approx(4e6 / 1e-3 / 1e9)


def test_median_and_spread_are_order_statistics():
    # reads: entry, then start and end of each repeat (3, 2, 1, 2 and 10 s), then exit
    times = iter([0.0, 1.0, 4.0, 4.0, 6.0, 6.0, 7.0, 7.0, 9.0, 9.0, 19.0, 20.0])

    with measure(warmup=0, repeats=5, clock=lambda: next(times)) as m:
        for _ in m:
            pass
    assert m.result.times_s == (3.0, 2.0, 1.0, 2.0, 10.0)
    assert m.result.median_s == 2.0  # the 10 s outlier moves the median nowhere
    assert m.result.p10_s == pytest.approx(1.4) and m.result.p90_s == pytest.approx(7.2)  # linear interpolation


def test_real_cpu_work_is_timed():
    import torch

    a = torch.randn(128, 128)
    with measure(device="cpu", warmup=1, repeats=3, flops=2 * 128**3) as m:
        for _ in m:
            a @ a
    assert m.result.device == "cpu" and m.result.median_s > 0 and m.result.peak_memory_bytes is None


def test_unknown_or_missing_devices_are_clear_errors():
    with pytest.raises(GpuwiseError, match="not a device gpuwise can time"):
        device_for("xla")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(GpuwiseError, match="torch sees no CUDA GPU"):
            device_for("cuda")
