"""NvmlReader against a fake NVML: every field, its units, each query failing alone, NVLink and GPM over intervals.

``FakeNvml`` stands in for the ``pynvml`` module (gpustat tests its NVML plumbing the same way, by stubbing each
call per handle): the same function names and constants, per-device state in NVML's own units, any function made to
raise the fake's ``NVMLError`` or to be missing, and a stream of states to step through read by read. It returns
pynvml's real ctypes structs where the reader touches a struct's fields (field values, GPM metrics), and answers
field values by scopeId the way nvml.h says real NVML does.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

import pynvml
import pytest

from fakes.nvml import (
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    NOT_SUPPORTED,
    TIMEOUT,
    UINT_MAX,
    FakeNvml,
    _api,
    h100,
)
from gpuwise.monitor.nvml import CLOCK_REASONS, THROTTLING, NvmlReader, decode_clock_reasons, mig_label, open_nvml
from gpuwise.monitor.samples import DeviceSample, Sample, from_line, to_line


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def two_reads(fake: FakeNvml, pids=None, clock: Clock | None = None) -> tuple[DeviceSample, DeviceSample]:
    """The first read and the second, 0.5 s later, after every NVLink link moved 2000 KiB out and 3000 KiB in."""
    clock = clock or Clock()
    reader = NvmlReader(nvml=fake, clock=clock)
    (first,) = reader.read(pids)
    clock.t += 0.5
    for d in fake.devices:
        d["nvlink_tx_kib"] = [x + 2_000 for x in d["nvlink_tx_kib"]]
        d["nvlink_rx_kib"] = [x + 3_000 for x in d["nvlink_rx_kib"]]
    (second,) = reader.read(pids)
    reader.close()
    return first, second


FIELDS = [f.name for f in dataclasses.fields(DeviceSample)]
OFF_MIG_NONE = {"mig", "note"}  # None on a whole GPU that reads every sensor
INTERVAL_FIELDS = {"nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "sm_active_pct", "sm_occupancy_pct",
                   "tensor_active_pct", "dram_active_pct"}


# -- every field, in the right units -----------------------------------------------------------------------------

def test_every_field_read_and_converted():
    first, second = two_reads(FakeNvml(), pids={4242, 4243})
    expected = dict(
        index=0, name="NVIDIA H100 80GB HBM3", util_pct=97.0, mem_util_pct=41.0,
        memory_used_bytes=61_203_283_968, memory_total_bytes=85_520_809_984,
        process_memory_bytes=40_000_000_000 + 12_000_000_000,  # pid 777 is not watched
        power_w=612.345, power_limit_w=700.0, power_default_limit_w=700.0, energy_j=987_654.321,  # mW, mJ
        sm_clock_mhz=1755.0, sm_clock_max_mhz=1980.0, mem_clock_mhz=2619.0, mem_clock_max_mhz=2619.0,
        clock_reasons=("power cap (software)", "thermal (software)"),  # 0x4 | 0x20
        temperature_c=71.0, temperature_slowdown_c=87.0,
        pcie_tx_bytes_per_s=1_536 * 1024.0, pcie_rx_bytes_per_s=262_144 * 1024.0,  # KB/s, NVML's KB = KiB
        # 18 links x 2000 KiB out, x 3000 KiB in, over 0.5 s
        nvlink_tx_bytes_per_s=18 * 2_000 * 1024 / 0.5, nvlink_rx_bytes_per_s=18 * 3_000 * 1024 / 0.5,
        sm_active_pct=83.5, sm_occupancy_pct=41.25, tensor_active_pct=62.0, dram_active_pct=55.5,
        vendor="nvidia", mig=None, note=None,  # a whole GPU, not in MIG mode: nothing missing by design
    )
    assert set(expected) == set(FIELDS)  # a new DeviceSample field must be read and tested here
    for name, value in expected.items():
        assert getattr(second, name) == pytest.approx(value), name
    for name in FIELDS:  # the first read has everything but what needs an interval
        assert getattr(first, name) == (None if name in INTERVAL_FIELDS else getattr(second, name)), name
    assert isinstance(second.memory_used_bytes, int) and isinstance(second.process_memory_bytes, int)


def test_name_as_bytes_from_an_old_binding_is_text():
    (sample,) = NvmlReader(nvml=FakeNvml([h100(name=b"Tesla V100-SXM2-16GB")])).read()
    assert sample.name == "Tesla V100-SXM2-16GB"


def test_indices_choose_devices_and_keep_their_nvml_index():
    fake = FakeNvml([h100(), h100(name="NVIDIA H100 PCIe", power_mw=300_000)])
    assert [s.name for s in NvmlReader(nvml=fake).read()] == ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"]
    (sample,) = NvmlReader([1], nvml=fake).read()
    assert (sample.index, sample.name, sample.power_w) == (1, "NVIDIA H100 PCIe", 300.0)


# -- one query failing: only its fields go None -------------------------------------------------------------------

GPM = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_active_pct")


def gpm_of(samples: tuple[DeviceSample, ...]) -> list[float | None]:
    (sample,) = samples
    return [getattr(sample, f) for f in GPM]
AFFECTS = {
    "nvmlDeviceGetName": ("name",),
    "nvmlDeviceGetUtilizationRates": ("util_pct", "mem_util_pct"),
    "nvmlDeviceGetMemoryInfo": ("memory_used_bytes", "memory_total_bytes"),
    "nvmlDeviceGetComputeRunningProcesses": ("process_memory_bytes",),
    "nvmlDeviceGetPowerUsage": ("power_w",),
    "nvmlDeviceGetEnforcedPowerLimit": ("power_limit_w",),
    "nvmlDeviceGetPowerManagementDefaultLimit": ("power_default_limit_w",),
    "nvmlDeviceGetTotalEnergyConsumption": ("energy_j",),
    "nvmlDeviceGetClockInfo": ("sm_clock_mhz", "mem_clock_mhz"),
    "nvmlDeviceGetMaxClockInfo": ("sm_clock_max_mhz", "mem_clock_max_mhz"),
    "nvmlDeviceGetCurrentClocksEventReasons": ("clock_reasons",),
    "nvmlDeviceGetCurrentClocksThrottleReasons": (),  # the older name, asked only where the new one is missing
    "nvmlDeviceGetTemperatureV": ("temperature_c",),
    "nvmlDeviceGetTemperature": (),  # likewise
    "nvmlDeviceGetTemperatureThreshold": ("temperature_slowdown_c",),
    "nvmlDeviceGetPcieThroughput": ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"),
    "nvmlDeviceGetFieldValues": ("nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s"),
    "nvmlGpmQueryDeviceSupport": GPM,
    "nvmlGpmSampleAlloc": GPM,
    "nvmlGpmSampleGet": GPM,
    "nvmlGpmMetricsGet": GPM,
    "nvmlGpmSampleFree": (),  # only on close
}


def test_a_read_and_close_call_exactly_the_functions_in_affects():
    """Every NVML function the reader calls is in AFFECTS (so the failure tests below cover it), and every one in
    AFFECTS is called, but the older names that stand in only where the newer ones are missing."""
    fake = FakeNvml()
    reader = NvmlReader(nvml=fake)
    reader.read({4242})
    reader.read({4242})
    reader.close()
    lifecycle = {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"}
    fallbacks = {"nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetTemperature"}
    assert set(fake.calls) == (set(AFFECTS) - fallbacks) | lifecycle


@pytest.mark.parametrize("code", [NOT_SUPPORTED, NO_PERMISSION, GPU_IS_LOST])
@pytest.mark.parametrize("function", sorted(AFFECTS))
def test_one_failing_query_gives_none_in_exactly_its_fields(function, code):
    _, baseline = two_reads(FakeNvml(), pids={4242})
    _, broken = two_reads(FakeNvml().fail(function, code), pids={4242})
    for name in FIELDS:
        if name in AFFECTS[function]:
            assert getattr(broken, name) is None, name
        else:
            assert getattr(broken, name) == getattr(baseline, name), name
            assert getattr(baseline, name) is not None or name in OFF_MIG_NONE, name


@pytest.mark.parametrize("function", sorted(AFFECTS))
def test_a_function_the_binding_lacks_is_a_none_not_a_crash(function):
    _, baseline = two_reads(FakeNvml(), pids={4242})
    _, broken = two_reads(FakeNvml(missing={function}), pids={4242})
    changed = {name for name in FIELDS if getattr(broken, name) != getattr(baseline, name)}
    fallbacks = {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperatureV"}
    assert changed == (set() if function in fallbacks else set(AFFECTS[function]))


def test_not_supported_is_not_asked_again_but_a_passing_error_is():
    fake = FakeNvml().fail("nvmlDeviceGetPowerUsage", NOT_SUPPORTED).fail("nvmlDeviceGetTotalEnergyConsumption",
                                                                          TIMEOUT)
    reader = NvmlReader(nvml=fake)
    for _ in range(3):
        (sample,) = reader.read()
        assert sample.power_w is None and sample.energy_j is None
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3
    del fake.failing["nvmlDeviceGetTotalEnergyConsumption"], fake.failing["nvmlDeviceGetPowerUsage"]
    (sample,) = reader.read()
    assert sample.energy_j == pytest.approx(987_654.321) and sample.power_w is None


def test_static_facts_are_read_once():
    fake = FakeNvml()
    reader = NvmlReader(nvml=fake)
    for _ in range(4):
        reader.read()
    assert fake.calls["nvmlDeviceGetName"] == 1
    assert fake.calls["nvmlDeviceGetMaxClockInfo"] == 2  # SM and memory
    assert fake.calls["nvmlDeviceGetTemperatureThreshold"] == 1
    assert fake.calls["nvmlDeviceGetClockInfo"] == 8  # current clocks: every read


@pytest.mark.parametrize("how", ["missing from the binding", "FunctionNotFound from the driver"])
def test_old_names_stand_in_for_new_ones(how):
    fake = FakeNvml([h100(reasons=0x40)])
    new = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTemperatureV")
    if how == "missing from the binding":
        fake.missing.update(new)
    else:
        for name in new:
            fake.fail(name, FUNCTION_NOT_FOUND)
    reader = NvmlReader(nvml=fake)
    for _ in range(2):
        (sample,) = reader.read()
        assert sample.clock_reasons == ("thermal (hardware)",) and sample.temperature_c == 71.0
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == fake.calls["nvmlDeviceGetTemperature"] == 2
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] <= 1  # found out once


def test_no_clock_reasons_at_all_is_none_and_none_active_is_empty():
    fake = FakeNvml([h100(reasons=0)], missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    fake.fail("nvmlDeviceGetCurrentClocksThrottleReasons", NOT_SUPPORTED)
    assert NvmlReader(nvml=fake).read()[0].clock_reasons is None
    assert NvmlReader(nvml=FakeNvml([h100(reasons=0)])).read()[0].clock_reasons == ()


def test_a_read_is_a_handful_of_calls():
    fake = FakeNvml()
    reader = NvmlReader(nvml=fake)
    reader.read({4242})  # static facts, GPM probe and first sample
    fake.calls.clear()
    reader.read({4242})
    # util, memory, processes, power, limit, energy, 2 clocks, reasons, temperature, 2 PCIe, field values (both
    # NVLink counters in one call), GPM sample + metrics
    assert sum(fake.calls.values()) == 15, fake.calls
    fake.calls.clear()
    reader.read()  # no pids: the process list is not asked for
    assert sum(fake.calls.values()) == 14 and "nvmlDeviceGetComputeRunningProcesses" not in fake.calls


# -- clock-event reasons -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("bit", "word"), [
    (0x1, "idle"), (0x2, "applications clocks setting"), (0x4, "power cap (software)"), (0x8, "hardware slowdown"),
    (0x10, "sync boost"), (0x20, "thermal (software)"), (0x40, "thermal (hardware)"),
    (0x80, "power brake (hardware)"), (0x100, "display clock setting"), (0x200, "board limit"),
    (0x400, "reliability"),
])
def test_decode_single_bits(bit, word):
    assert decode_clock_reasons(bit) == (word,)


def test_decode_combined_none_and_unknown_bits():
    assert decode_clock_reasons(0) == ()
    assert decode_clock_reasons(0x1 | 0x4 | 0x40) == ("idle", "power cap (software)", "thermal (hardware)")
    assert decode_clock_reasons(0x800) == ("reason 0x800",)
    assert decode_clock_reasons(0x4 | 0x1000 | 0x800 | 1 << 40) == (
        "power cap (software)", "reason 0x800", "reason 0x1000", "reason 0x10000000000")


def test_the_masks_are_pynvmls():
    for bit, word in CLOCK_REASONS:
        names = [n for n in dir(pynvml) if n.startswith(("nvmlClocksEventReason", "nvmlClocksThrottleReason"))
                 and getattr(pynvml, n) == bit and "UserDefined" not in n]
        assert names, word
    assert pynvml.nvmlClocksEventReasonSwPowerCap == 0x4 and pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown == 0x80
    every = pynvml.nvmlClocksThrottleReasonAll
    assert "reason" not in " ".join(decode_clock_reasons(every))  # every bit pynvml knows has a word


def test_throttling_is_power_heat_and_brakes_only():
    throttling = {"power cap (software)", "hardware slowdown", "thermal (software)", "thermal (hardware)",
                  "power brake (hardware)"}
    assert set(THROTTLING) == throttling
    for word in ("idle", "applications clocks setting", "sync boost", "display clock setting"):
        assert word not in THROTTLING
    assert set(THROTTLING).issubset(word for _, word in CLOCK_REASONS)
    assert set(decode_clock_reasons(0x1 | 0x2 | 0x10 | 0x100)).isdisjoint(THROTTLING)
    assert set(decode_clock_reasons(0x1 | 0x8)) & THROTTLING == {"hardware slowdown"}


# -- NVLink ----------------------------------------------------------------------------------------------------------

def test_nvlink_rate_from_two_reads_first_none():
    first, second = two_reads(FakeNvml())
    assert first.nvlink_tx_bytes_per_s is None and first.nvlink_rx_bytes_per_s is None
    assert second.nvlink_tx_bytes_per_s == pytest.approx(18 * 2_000 * 1024 / 0.5)  # 73.7 MB/s
    assert second.nvlink_rx_bytes_per_s == pytest.approx(18 * 3_000 * 1024 / 0.5)


def test_nvlink_summed_per_link_where_the_aggregate_scope_is_rejected():
    fake = FakeNvml([h100(nvlink_aggregate=False)])
    _, second = two_reads(fake)
    assert second.nvlink_tx_bytes_per_s == pytest.approx(18 * 2_000 * 1024 / 0.5)
    assert second.nvlink_rx_bytes_per_s == pytest.approx(18 * 3_000 * 1024 / 0.5)
    # first read: the aggregate, then the per-link request; second read: per link only
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3


def test_nvlink_is_asked_by_scope_never_by_a_bare_field_id():
    """A bare field id reads link 0 alone (nvml.h): the reader names the scope of every counter it asks for, all
    links at once (UINT_MAX) first, then each link where the driver rejects that."""
    asked: list[list] = []
    for aggregate in (True, False):
        fake = FakeNvml([h100(nvlink_aggregate=aggregate)])
        answer = fake.nvmlDeviceGetFieldValues
        fake.nvmlDeviceGetFieldValues = lambda h, ids, answer=answer: asked.append(list(ids)) or answer(h, ids)
        NvmlReader(nvml=fake).read()
    tx, rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    every_link = [(f, link) for link in range(18) for f in (tx, rx)]
    assert asked == [[(tx, UINT_MAX), (rx, UINT_MAX)], [(tx, UINT_MAX), (rx, UINT_MAX)], every_link]


def test_no_nvlink_is_none_and_not_asked_again():
    fake = FakeNvml([h100(nvlink_tx_kib=[], nvlink_rx_kib=[])])  # a PCIe card: every link answers NotSupported
    clock = Clock()
    reader = NvmlReader(nvml=fake, clock=clock)
    for _ in range(3):
        clock.t += 1
        (sample,) = reader.read()
        assert sample.nvlink_tx_bytes_per_s is None and sample.nvlink_rx_bytes_per_s is None
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2  # aggregate, then per link, once


def test_nvlink_counter_going_back_or_no_time_passing_gives_no_rate():
    fake = FakeNvml()
    clock = Clock()
    reader = NvmlReader(nvml=fake, clock=clock)
    reader.read()
    clock.t += 1
    fake.devices[0]["nvlink_tx_kib"] = [0] * 18  # reset
    fake.devices[0]["nvlink_rx_kib"] = [x + 1 for x in fake.devices[0]["nvlink_rx_kib"]]
    (sample,) = reader.read()
    assert sample.nvlink_tx_bytes_per_s is None and sample.nvlink_rx_bytes_per_s == pytest.approx(18 * 1024)
    (sample,) = reader.read()  # same instant
    assert sample.nvlink_tx_bytes_per_s is None and sample.nvlink_rx_bytes_per_s is None
    clock.t += 2
    fake.devices[0]["nvlink_tx_kib"] = [5] * 18
    (sample,) = reader.read()
    assert sample.nvlink_tx_bytes_per_s == pytest.approx(18 * 5 * 1024 / 2)


# -- GPM ---------------------------------------------------------------------------------------------------------------

def test_gpm_percentages_over_each_interval_from_a_stream():
    stream = [[{"gpm": {2: 20.0, 3: 10.0, 5: 0.0, 10: 80.0}}], [{"gpm": {2: 95.0, 3: 50.0, 5: 90.0, 10: 40.0}}]]
    fake = FakeNvml(stream=stream)
    reader = NvmlReader(nvml=fake)
    assert gpm_of(reader.read()) == [None] * 4  # one sample: no interval yet
    fake.step()
    assert gpm_of(reader.read()) == [20.0, 10.0, 0.0, 80.0]
    fake.step()
    assert gpm_of(reader.read()) == [95.0, 50.0, 90.0, 40.0]
    assert fake.calls["nvmlGpmSampleAlloc"] == 2 and fake.calls["nvmlGpmQueryDeviceSupport"] == 1
    reader.close()
    assert fake.samples == {} and len(fake.freed) == 2


def test_gpm_unsupported_device_is_none_without_samples():
    fake = FakeNvml([h100(gpm_supported=False)])
    _, second = two_reads(fake)
    assert gpm_of((second,)) == [None] * 4
    assert fake.calls["nvmlGpmSampleAlloc"] == 0 and fake.calls["nvmlGpmQueryDeviceSupport"] == 1


def test_gpm_failure_turns_gpm_off_for_good():
    fake = FakeNvml()
    reader = NvmlReader(nvml=fake)
    reader.read()
    fake.fail("nvmlGpmMetricsGet", GPU_IS_LOST)
    assert gpm_of(reader.read()) == [None] * 4
    del fake.failing["nvmlGpmMetricsGet"]
    for _ in range(3):
        assert gpm_of(reader.read()) == [None] * 4
    assert fake.calls["nvmlGpmMetricsGet"] == 1 and fake.calls["nvmlGpmSampleGet"] == 2
    assert fake.samples == {} and len(fake.freed) == 2  # freed when it failed
    reader.close()
    assert len(fake.freed) == 2


def test_gpm_metric_missing_alone_is_none_alone():
    fake = FakeNvml([h100(gpm={2: 70.0, 3: 30.0, 10: 20.0})])  # no tensor metric
    _, second = two_reads(fake)
    assert gpm_of((second,)) == [70.0, 30.0, None, 20.0]


def test_gpm_on_two_devices_keeps_their_samples_apart():
    fake = FakeNvml([h100(), h100(gpm={2: 1.0, 3: 2.0, 5: 3.0, 10: 4.0})])
    reader = NvmlReader(nvml=fake)
    reader.read()
    a, b = reader.read()
    assert (a.sm_active_pct, b.sm_active_pct, b.dram_active_pct) == (83.5, 1.0, 4.0)


# -- process memory ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("pids", "processes", "expected"), [
    (None, [(4242, 40_000_000_000)], None),  # not asked
    ({4242}, [(4242, 40_000_000_000), (777, 9_000_000_000)], 40_000_000_000),
    ({4242, 4243}, [(4242, 40_000_000_000), (4243, 12_000_000_000), (777, 9)], 52_000_000_000),
    ({4242}, [(4242, 1_000), (4242, 2_000)], 3_000),  # one process on two MIG instances
    ({5}, [(4242, 40_000_000_000)], None),  # not on this GPU, or another pid namespace
    ({4242}, [(4242, None)], None),  # WDDM: NVML has no per-process figure
    ({4242, 4243}, [(4242, None), (4243, 7)], 7),
    ({4242}, [], None),
])
def test_process_memory_of_the_watched_pids(pids, processes, expected):
    fake = FakeNvml([h100(processes=processes)])
    (sample,) = NvmlReader(nvml=fake).read(pids)
    assert sample.process_memory_bytes == expected
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == (0 if pids is None else 1)


# -- opening and closing -----------------------------------------------------------------------------------------------

def test_open_without_a_driver_gives_a_one_line_reason():
    fake = FakeNvml(init_error=LIBRARY_NOT_FOUND)
    reader, why = open_nvml(nvml=fake)
    assert reader is None and "\n" not in why
    assert "NVML Shared Library Not Found" in why and fake.shutdowns == 0


def test_open_with_the_real_pynvml_never_raises():
    reader, why = open_nvml()
    if reader is not None:  # a machine with a GPU and a driver
        assert why is None
        assert len(reader.read()) >= 1
        reader.close()
        return
    assert isinstance(why, str) and why and "\n" not in why


def test_open_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    reader, why = open_nvml()
    assert reader is None and "nvidia-ml-py" in why and "\n" not in why


def test_open_with_no_gpu_or_a_missing_index_shuts_nvml_down():
    fake = FakeNvml([])
    assert open_nvml(nvml=fake) == (None, "NVML sees no GPU")
    assert fake.inits == fake.shutdowns == 1
    fake = FakeNvml([h100()])
    reader, why = open_nvml([0, 3], nvml=fake)
    assert reader is None and why.startswith("NVML has no GPU 3") and "\n" not in why
    assert fake.inits == fake.shutdowns == 1


def test_a_gpu_that_fell_off_is_skipped_unless_asked_for():
    fake = FakeNvml([h100(lost=True), h100()])
    reader, why = open_nvml(nvml=fake)
    assert why is None and reader.indices == (1,) and reader.skipped == {0: "FakeNVMLError: GPU is lost"}
    assert open_nvml([0], nvml=fake) == (None, "NVML has no GPU 0 (FakeNVMLError: GPU is lost)")
    fake.devices = fake.devices[:1]
    assert open_nvml(nvml=fake) == (None, "NVML sees no GPU it can open (GPU 0: FakeNVMLError: GPU is lost)")


def test_open_and_close_idempotent():
    fake = FakeNvml()
    reader, why = open_nvml(nvml=fake)
    assert why is None and reader.indices == (0,)
    reader.read()
    reader.read()
    reader.close()
    reader.close()
    assert fake.shutdowns == 1 and fake.calls["nvmlGpmSampleFree"] == 2 and fake.samples == {}
    assert reader.read() == ()
    with NvmlReader(nvml=FakeNvml()) as other:
        assert len(other.read()) == 1
    assert other.nvml.shutdowns == 1


def test_one_session_shared_by_the_environment_and_the_reader():
    """doctor's snapshot and the monitor read through one NVML session: one init, one shutdown (by its holder),
    each device handle opened once."""
    from gpuwise.environment import _probe_nvml
    from gpuwise.nvml import NvmlSession

    fake = FakeNvml([h100(), h100(name="NVIDIA H100 PCIe")])
    fake.nvmlSystemGetDriverVersion = lambda: "580.82.07"
    fake.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13000
    fake.nvmlDeviceGetUUID = lambda h: f"GPU-{h.index}"
    fake.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    with NvmlSession.start(fake) as session:
        found = _probe_nvml(session)
        reader, why = open_nvml(session=session)
        assert why is None and [s.name for s in reader.read()] == [d.name for d in found["nvml_devices"]]
        reader.close()
        assert (fake.inits, fake.shutdowns) == (1, 0)  # the reader leaves the holder's session open
        reader.close()
    assert (fake.inits, fake.shutdowns) == (1, 1) and session.closed
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2


class Recording:
    """Passes every attribute through to a fake NVML module and notes its name."""

    def __init__(self, module) -> None:
        self._module, self.names = module, set()

    def __getattr__(self, name: str):
        self.names.add(name)
        return getattr(self._module, name)


def test_the_reader_asks_only_for_names_pynvml_has():
    """A misspelt function reads as "not supported" and a misspelt constant falls back to its default, both in
    silence: every name the reader looks up on the module (functions, constants, structs, the error) is pynvml's,
    and every constant it uses has pynvml's value."""
    module = Recording(FakeNvml([h100(nvlink_aggregate=False)]))
    reader = NvmlReader(nvml=module)
    for _ in range(2):
        reader.read({4242})
    reader.close()
    missing = {name for name in module.names if not hasattr(pynvml, name)}
    assert not missing and len(module.names) > 30, missing
    for name in module.names:
        if name.startswith("NVML_") and name != "NVML_NVLINK_MAX_LINKS":  # 36 in 13.x; 18 links on an H100
            assert getattr(module._module, name) == getattr(pynvml, name), name


# -- MIG -------------------------------------------------------------------------------------------------------------

NOT_FOUND = 6  # nvml.h NVML_ERROR_NOT_FOUND: no MIG device in that slot
GIB = 1024**3


def a100_mig(**changes) -> dict:
    """An A100 80GB in MIG mode with a 3g.40gb instance in slot 0 (the watched pid 4242 on it) and a 1g.10gb one in
    slot 3 (someone else's pid 777); the whole-GPU process list has no figures (no privileges, as for most users)."""
    state = h100(name="NVIDIA A100-SXM4-80GB", mem_total=80 * GIB, mem_used=47 * GIB, mig_mode=[1, 1],
                 processes=[(4242, None), (777, None)],
                 mig=[dict(slot=0, uuid="MIG-0c1e2a3b-aaaa", gi=1, ci=0, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                           mem_total=40 * GIB, mem_used=31 * GIB, processes=[(4242, 30 * GIB)]),
                      dict(slot=3, uuid="MIG-7f8e9d0c-bbbb", gi=5, ci=0, name="NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                           mem_total=10 * GIB, mem_used=6 * GIB, processes=[(777, 5 * GIB)])])
    state.update(changes)
    return state


class MigNvml(FakeNvml):
    """FakeNvml with pynvml's MIG calls: MIG device handles carry their slot, a GPU in MIG mode (and each of its MIG
    devices) answers utilisation NotSupported as NVML does, the per-instance queries need a MIG device handle."""

    NVML_DEVICE_MIG_ENABLE = 1
    MAX_MIG = 7  # an A100's nvmlDeviceGetMaxMigDeviceCount

    def _dev(self, handle) -> dict:
        device = super()._dev(handle)
        slot = getattr(handle, "mig", None)
        return device if slot is None else next(m for m in device["mig"] if m["slot"] == slot)

    def _mig(self, h) -> dict:
        if getattr(h, "mig", None) is None:
            raise self.NVMLError(2)  # Invalid Argument: not a MIG device handle
        return self._dev(h)

    @_api
    def nvmlDeviceGetUtilizationRates(self, h):
        if getattr(h, "mig", None) is not None or self.devices[h.index].get("mig_mode", [0])[0] == 1:
            raise self.NVMLError(NOT_SUPPORTED)
        return SimpleNamespace(gpu=self._dev(h)["util_gpu"], memory=self._dev(h)["util_mem"])

    @_api
    def nvmlDeviceGetMigMode(self, h):
        if "mig_mode" not in self._dev(h):
            raise self.NVMLError(NOT_SUPPORTED)  # a GPU without MIG
        return list(self._dev(h)["mig_mode"])

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return self.MAX_MIG if "mig_mode" in self._dev(h) else 0

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, slot):
        if not any(m["slot"] == slot for m in self._dev(h).get("mig", ())):
            raise self.NVMLError(NOT_FOUND)
        return SimpleNamespace(index=h.index, mig=slot)

    @_api
    def nvmlDeviceGetGpuInstanceId(self, h):
        return self._mig(h)["gi"]

    @_api
    def nvmlDeviceGetComputeInstanceId(self, h):
        return self._mig(h)["ci"]

    @_api
    def nvmlDeviceGetUUID(self, h):
        return self._mig(h)["uuid"]


MIG_CALLS = ("nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
             "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetUUID")


def test_mig_gpu_is_read_whole_then_each_instance():
    fake = MigNvml([a100_mig()])
    reader = NvmlReader(nvml=fake)
    gpu, big, small = reader.read({4242})
    # the whole GPU: the shared sensors, no utilisation (and a note saying why, not an error)
    assert (gpu.index, gpu.mig, gpu.vendor, gpu.name) == (0, None, "nvidia", "NVIDIA A100-SXM4-80GB")
    assert gpu.util_pct is None and gpu.mem_util_pct is None and gpu.note == "utilisation not available under MIG"
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (47 * GIB, 80 * GIB)
    assert gpu.power_w == pytest.approx(612.345) and gpu.sm_clock_mhz == 1755.0 and gpu.temperature_c == 71.0
    # the whole-GPU list has no figure for 4242 (no privileges): the sum over its instances
    assert gpu.process_memory_bytes == 30 * GIB
    # each instance: named by UUID and GI/CI ids, its own memory, the watched process's memory on it
    assert (big.index, big.mig, big.name) == (0, "MIG-0c1e2a3b-aaaa (GI 1, CI 0)", "NVIDIA A100-SXM4-80GB MIG 3g.40gb")
    assert (big.memory_used_bytes, big.memory_total_bytes, big.process_memory_bytes) == (31 * GIB, 40 * GIB, 30 * GIB)
    assert (small.mig, small.memory_total_bytes, small.process_memory_bytes) == ("MIG-7f8e9d0c-bbbb (GI 5, CI 0)",
                                                                                  10 * GIB, None)  # 777: not ours
    for inst in (big, small):
        assert inst.util_pct is None and inst.note == "utilisation not available under MIG"
        assert inst.vendor == "nvidia" and inst.power_w is None and inst.clock_reasons is None  # on the GPU's sample
    assert reader.note == "MIG mode on GPU 0 (2 MIG devices): utilisation not available under MIG"
    assert reader.indices == (0,)  # still one GPU to the callers that map CUDA devices to NVML indices


def test_mig_whole_gpu_process_list_with_privileges_is_used_as_is():
    fake = MigNvml([a100_mig(processes=[(4242, 31 * GIB), (777, 5 * GIB)])])
    gpu, big, _ = NvmlReader(nvml=fake).read({4242})
    assert gpu.process_memory_bytes == 31 * GIB and big.process_memory_bytes == 30 * GIB


def test_mig_devices_found_once_and_utilisation_asked_once():
    fake = MigNvml([a100_mig()])
    reader = NvmlReader(nvml=fake)
    for _ in range(3):
        assert len(reader.read({4242})) == 3
    assert fake.calls["nvmlDeviceGetMigMode"] == fake.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == MigNvml.MAX_MIG  # every slot, once
    assert fake.calls["nvmlDeviceGetUUID"] == fake.calls["nvmlDeviceGetGpuInstanceId"] == 2  # static, per instance
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 3  # GPU + 2 instances, NotSupported once each
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 3 * 3  # every read: the GPU and both instances
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 3 * 3


def test_mig_off_reads_the_gpu_as_before():
    fake = MigNvml([h100(mig_mode=[0, 0])])
    reader = NvmlReader(nvml=fake)
    _, baseline = two_reads(FakeNvml(), pids={4242})
    _, second = two_reads(fake, pids={4242})
    assert second == baseline and second.util_pct == 97.0 and second.note is None
    assert len(reader.read()) == 1 and reader.note is None
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == fake.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0


@pytest.mark.parametrize("how", ["missing from the binding", "FunctionNotFound", "NotSupported"])
def test_a_driver_without_the_mig_calls_reads_every_gpu_whole(how):
    fake = MigNvml([h100()])  # no MIG on this GPU (or driver): utilisation works
    if how == "missing from the binding":
        fake.missing.update(MIG_CALLS)
    else:
        fake.fail("nvmlDeviceGetMigMode", FUNCTION_NOT_FOUND if how == "FunctionNotFound" else NOT_SUPPORTED)
    reader = NvmlReader(nvml=fake)
    for _ in range(3):
        (sample,) = reader.read({4242})
        assert sample.util_pct == 97.0 and sample.mig is None and sample.note is None
    assert reader.note is None
    assert fake.calls["nvmlDeviceGetMigMode"] == (0 if how == "missing from the binding" else 1)  # not asked again
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 0


def test_mig_mode_that_times_out_is_asked_again():
    fake = MigNvml([a100_mig()]).fail("nvmlDeviceGetMigMode", TIMEOUT)
    reader = NvmlReader(nvml=fake)
    assert len(reader.read()) == 1  # not known yet: the GPU alone
    del fake.failing["nvmlDeviceGetMigMode"]
    assert [s.mig for s in reader.read()] == [None, "MIG-0c1e2a3b-aaaa (GI 1, CI 0)", "MIG-7f8e9d0c-bbbb (GI 5, CI 0)"]


def test_mig_in_mode_without_instances_is_the_gpu_with_its_note():
    fake = MigNvml([a100_mig(mig=[])])
    reader = NvmlReader(nvml=fake)
    (gpu,) = reader.read({4242})
    assert gpu.util_pct is None and gpu.note == "utilisation not available under MIG"
    assert gpu.process_memory_bytes is None  # no figure anywhere: not a zero
    assert reader.note == "MIG mode on GPU 0 (0 MIG devices): utilisation not available under MIG"


def test_one_mig_device_failing_leaves_the_others():
    fake = MigNvml([a100_mig()])
    reader = NvmlReader(nvml=fake)
    reader.read({4242})
    real = fake.nvmlDeviceGetMemoryInfo

    def memory(h):  # the 1g.10gb instance was destroyed meanwhile: NotFound, a passing error
        if getattr(h, "mig", None) == 3:
            raise fake.NVMLError(NOT_FOUND)
        return real(h)

    fake.nvmlDeviceGetMemoryInfo = memory
    gpu, big, small = reader.read({4242})
    assert small.memory_used_bytes is None and small.mig == "MIG-7f8e9d0c-bbbb (GI 5, CI 0)"
    assert big.memory_used_bytes == 31 * GIB and gpu.memory_used_bytes == 47 * GIB


def test_mig_label_without_uuid_or_ids():
    assert mig_label(b"MIG-1234", 2, 1) == "MIG-1234 (GI 2, CI 1)"  # bytes from an old binding
    assert mig_label(None, 2, 1) == "GI 2, CI 1"
    assert mig_label("MIG-1234", None, None) == "MIG-1234"
    assert mig_label(None, None, None, 4) == "MIG device 4"


def test_mig_sample_round_trips_a_log_line():
    gpu, big, _ = NvmlReader(nvml=MigNvml([a100_mig()])).read({4242})
    for device in (gpu, big):
        line = to_line(Sample(t=1.0, devices=(device,)))
        assert from_line(line) == Sample(t=1.0, devices=(device,))
    old = json.loads(to_line(Sample(t=1.0, devices=(big,))))
    for key in ("vendor", "mig", "note"):
        del old["devices"][0][key]  # a log written before these fields
    assert from_line(json.dumps(old)).devices[0].mig is None


def test_the_mig_reader_asks_only_for_names_pynvml_has():
    module = Recording(MigNvml([a100_mig()]))
    reader = NvmlReader(nvml=module)
    for _ in range(2):
        reader.read({4242})
    reader.close()
    assert set(MIG_CALLS) <= module.names
    missing = {name for name in module.names if not hasattr(pynvml, name)}
    assert not missing, missing
    assert module._module.NVML_DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE and NOT_FOUND == \
        pynvml.NVML_ERROR_NOT_FOUND
