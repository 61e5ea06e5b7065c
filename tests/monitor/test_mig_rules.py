"""The rules on a MIG instance: the memory the loop can fill is the instance's, not the whole GPU's."""

from __future__ import annotations

from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import DeviceSample, Record, Sample, StepEvent
from gpuwise.monitor.verdict import Context
from gpuwise.units import GiB


def _gpu_with_instance() -> tuple[DeviceSample, ...]:
    """An 80 GiB GPU in MIG mode (utilisation not available) and the 10 GiB instance the loop runs on."""
    note = "utilisation not available under MIG"
    return (DeviceSample(index=0, vendor="nvidia", memory_used_bytes=47 * GiB, memory_total_bytes=80 * GiB,
                         note=note),
            DeviceSample(index=0, vendor="nvidia", mig="MIG-x (GI 1, CI 0)", memory_used_bytes=9 * GiB,
                         memory_total_bytes=10 * GiB, note=note))


def _record(devices: tuple[DeviceSample, ...]) -> Record:
    steps = tuple(StepEvent(step=i, t=0.1 * (i + 1), seconds=0.1, data_wait_s=0.001,
                            peak_memory_bytes=int(9.6 * GiB)) for i in range(100))
    return Record(samples=tuple(Sample(t=0.5 * i, devices=devices) for i in range(20)), steps=steps,
                  device_kind="cuda")


def test_a_step_peak_near_the_mig_instances_size_is_memory_full_as_on_a_whole_gpu():
    whole = judge(_record((DeviceSample(index=0, util_pct=95.0, memory_used_bytes=int(9.7 * GiB),
                                        memory_total_bytes=10 * GiB),)), Context(device="cuda", usable_cores=8))
    mig = judge(_record(_gpu_with_instance()), Context(device="cuda", usable_cores=8))
    assert "memory-full" in [f.bottleneck for f in whole.findings]
    assert "memory-full" in [f.bottleneck for f in mig.findings]  # 9.6 of the instance's 10 GiB, not of 80
