"""AmdReader against a fake amdsmi: every field in its units, the shapes of ROCm 6.0-6.1, 6.2+ and 7.x, each sensor
failing alone, and ``open_nvml`` falling back to AMD where NVML finds no GPU.

``FakeAmdsmi`` stands in for the ``amdsmi`` package (ROCm's Python binding, not installable from PyPI): the function
names, dict keys and enums of its ``amdsmi_interface.py``, values in amdsmi's own units (VRAM in MiB, power in W, power
cap in uW, energy in counts of ``counter_resolution`` uJ, clocks in MHz, deg C), errors as
``AmdSmiLibraryException`` with amdsmi.h's status codes, any function made to raise or to be missing.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import Counter
from enum import IntEnum
from typing import ClassVar

import pytest

from fakes.nvml import LIBRARY_NOT_FOUND, FakeNvml, h100
from gpuwise.monitor import amd
from gpuwise.monitor.amd import AmdReader, open_amd
from gpuwise.monitor.nvml import NvmlReader, open_nvml
from gpuwise.monitor.samples import DeviceSample

GIB, MIB = 1024**3, 1024**2
NOT_SUPPORTED, NOT_YET_IMPLEMENTED, RETRY, NO_PERM, BUSY, INIT_ERROR = 2, 3, 9, 10, 30, 18  # amdsmi_status_t
UINT32_MAX = 0xFFFFFFFF


class AmdSmiLibraryException(Exception):
    """amdsmi_exception.AmdSmiLibraryException's shape: the status code in ``err_code`` and ``get_error_code()``."""

    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = abs(err_code)

    def get_error_code(self) -> int:
        return self.err_code

    def __str__(self) -> str:
        return f"An error occured with code: {self.err_code}"


class AmdSmiParameterException(Exception):
    """Raised by the binding for an argument of the wrong type (an int where it wants its enum): no error code."""


def _api(fn):
    @functools.wraps(fn)
    def call(self, *args):
        self.calls[fn.__name__] += 1
        failure = self.failing.get(fn.__name__)
        if isinstance(failure, int):
            raise AmdSmiLibraryException(failure)
        if failure is not None:
            raise failure
        return fn(self, *args)

    return call


def mi300x(**changes) -> dict:
    """An MI300X under load, in amdsmi's units."""
    state = dict(
        market_name="AMD Instinct MI300X", gfx=93, umc=41, vram_total=196_592, vram_used=150_000,
        processes=[(4242, 120 * GIB), (4243, 8 * GIB), (777, 9 * GIB)],
        power={"current_socket_power": 712, "average_socket_power": "N/A"},
        power_cap=750_000_000, default_power_cap=750_000_000,  # uW
        energy=123_456_789, resolution=15.259,  # counts, uJ per count
        gfx_clk=2_100, gfx_max=2_100, mem_clk=1_300, mem_max=1_300,
        temps={"HOTSPOT": 78, "EDGE": 55},
    )
    state.update(changes)
    return state


class FakeAmdsmi:
    """The amdsmi package over a list of GPU states. ``rocm``: "6.2" (dict process list, ``clk``,
    ``default_power_cap``, ``energy_accumulator``; the default), "6.0" (process handles and
    ``amdsmi_get_gpu_process_info``, ``cur_clk``, ``power_cap_default``, energy in ``power``, no HOTSPOT sensor)."""

    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiParameterException = AmdSmiParameterException
    _FUNCTIONS: ClassVar[tuple[str, ...]] = ()

    class AmdSmiClkType(IntEnum):
        SYS = 0
        GFX = 0
        DF = 1
        MEM = 4

    class AmdSmiTemperatureMetric(IntEnum):
        CURRENT = 0
        MAX = 1
        CRITICAL = 5

    def __init__(self, gpus: list[dict] | None = None, *, rocm: str = "6.2", missing: set[str] = frozenset(),
                 init_error: int | None = None) -> None:
        self.gpus = [dict(g) for g in (gpus if gpus is not None else [mi300x()])]
        self.rocm = rocm
        self.missing = set(missing)
        self.init_error = init_error
        self.failing: dict[str, int | BaseException] = {}
        self.calls: Counter[str] = Counter()
        self.inits = self.shutdowns = 0
        names = {"EDGE": 0, "HOTSPOT": 1, "JUNCTION": 1, "VRAM": 2} if rocm != "6.0" else {"EDGE": 0, "JUNCTION": 1,
                                                                                             "VRAM": 2}
        self.AmdSmiTemperatureType = IntEnum("AmdSmiTemperatureType", names)

    def __getattribute__(self, name: str):
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def fail(self, name: str, error: int | BaseException = NOT_SUPPORTED) -> FakeAmdsmi:
        self.failing[name] = error
        return self

    def _gpu(self, h) -> dict:
        assert isinstance(h, Handle), f"not a processor handle: {h!r}"
        return self.gpus[h.index]

    @_api
    def amdsmi_init(self, *flags):
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        self.inits += 1

    @_api
    def amdsmi_shut_down(self):
        self.shutdowns += 1

    @_api
    def amdsmi_get_processor_handles(self):
        return [Handle(i) for i in range(len(self.gpus))]

    @_api
    def amdsmi_get_gpu_asic_info(self, h):
        return {"market_name": self._gpu(h)["market_name"], "vendor_id": 0x1002, "device_id": 0x74A1}

    @_api
    def amdsmi_get_gpu_activity(self, h):
        g = self._gpu(h)
        return {"gfx_activity": g["gfx"], "umc_activity": g["umc"], "mm_activity": "N/A"}

    @_api
    def amdsmi_get_gpu_vram_usage(self, h):
        g = self._gpu(h)
        return {"vram_total": g["vram_total"], "vram_used": g["vram_used"]}

    @_api
    def amdsmi_get_power_info(self, h):
        return {"gfx_voltage": 900, "soc_voltage": 800, "mem_voltage": 1100, "power_limit": 750,
                **self._gpu(h)["power"]}

    @_api
    def amdsmi_get_power_cap_info(self, h):
        g = self._gpu(h)
        default = "power_cap_default" if self.rocm == "6.0" else "default_power_cap"
        return {"power_cap": g["power_cap"], default: g["default_power_cap"], "dpm_cap": 2_100,
                "min_power_cap": 0, "max_power_cap": 750_000_000}

    @_api
    def amdsmi_get_energy_count(self, h):
        g = self._gpu(h)
        key = "power" if self.rocm == "6.0" else "energy_accumulator"
        return {key: g["energy"], "counter_resolution": g["resolution"], "timestamp": 1_700_000_000}

    @_api
    def amdsmi_get_clock_info(self, h, clock_type):
        if not isinstance(clock_type, self.AmdSmiClkType):
            raise AmdSmiParameterException(clock_type)
        g = self._gpu(h)
        kind = {self.AmdSmiClkType.GFX: "gfx", self.AmdSmiClkType.MEM: "mem"}[clock_type]
        current = "cur_clk" if self.rocm == "6.0" else "clk"
        return {current: g[f"{kind}_clk"], "min_clk": 500, "max_clk": g[f"{kind}_max"], "clk_locked": False,
                "clk_deep_sleep": "N/A"}

    @_api
    def amdsmi_get_temp_metric(self, h, sensor, metric):
        if not isinstance(sensor, self.AmdSmiTemperatureType) or not isinstance(metric,
                                                                               self.AmdSmiTemperatureMetric):
            raise AmdSmiParameterException(sensor)
        assert metric == self.AmdSmiTemperatureMetric.CURRENT
        temps = self._gpu(h)["temps"]
        name = "HOTSPOT" if sensor.name in ("HOTSPOT", "JUNCTION") else sensor.name  # the same sensor, renamed
        if name not in temps:
            raise AmdSmiLibraryException(NOT_SUPPORTED)
        return temps[name]

    def _info(self, pid: int, vram) -> dict:
        return {"name": "python", "pid": pid, "mem": vram if vram is not None else 0,
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 4096, "cpu_mem": 8192, "vram_mem": "N/A" if vram is None else vram}}

    @_api
    def amdsmi_get_gpu_process_list(self, h):
        processes = self._gpu(h)["processes"]
        if self.rocm == "6.0":  # process handles, read one by one
            return [ProcessHandle(h.index, i) for i in range(len(processes))]
        return [self._info(pid, vram) for pid, vram in processes]

    @_api
    def amdsmi_get_gpu_process_info(self, h, process):
        if self.rocm != "6.0" or not isinstance(process, ProcessHandle):
            raise AmdSmiParameterException(process)
        pid, vram = self._gpu(h)["processes"][process.slot]
        if pid in self._gpu(h).get("ended", ()):
            raise AmdSmiLibraryException(31)  # NOT_FOUND: it exited between the list and this call
        return self._info(pid, vram)


@dataclasses.dataclass(frozen=True)
class Handle:
    index: int


@dataclasses.dataclass(frozen=True)
class ProcessHandle:
    gpu: int
    slot: int


FIELDS = [f.name for f in dataclasses.fields(DeviceSample)]
EXPECTED = dict(
    index=0, vendor="amd", name="AMD Instinct MI300X", util_pct=93.0, mem_util_pct=41.0,
    memory_used_bytes=150_000 * MIB, memory_total_bytes=196_592 * MIB,  # amdsmi's "MB" are MiB
    process_memory_bytes=128 * GIB,  # 4242 + 4243; 777 is not watched
    power_w=712.0, power_limit_w=750.0, power_default_limit_w=750.0,  # W; caps in uW
    energy_j=123_456_789 * 15.259e-6,  # counts x uJ per count
    sm_clock_mhz=2100.0, sm_clock_max_mhz=2100.0, mem_clock_mhz=1300.0, mem_clock_max_mhz=1300.0,
    temperature_c=78.0,  # the hotspot, not the edge (55)
)
NOT_READ = set(FIELDS) - set(EXPECTED)  # what amdsmi does not give gpuwise: None always


def read_one(fake: FakeAmdsmi, pids=frozenset({4242, 4243})) -> DeviceSample:
    (sample,) = AmdReader(amdsmi=fake).read(pids)
    return sample


# -- every field, in the right units -----------------------------------------------------------------------------


@pytest.mark.parametrize("rocm", ["6.0", "6.2"])
def test_every_field_read_and_converted(rocm):
    sample = read_one(FakeAmdsmi(rocm=rocm))
    for name, value in EXPECTED.items():
        assert getattr(sample, name) == pytest.approx(value), name
    # a new DeviceSample field: read it, or list it here
    assert {"clock_reasons", "temperature_slowdown_c", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s",
            "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "sm_active_pct", "sm_occupancy_pct",
            "tensor_active_pct", "dram_active_pct", "mig", "note"} == NOT_READ
    for name in NOT_READ:
        assert getattr(sample, name) is None, name
    assert isinstance(sample.memory_used_bytes, int) and isinstance(sample.process_memory_bytes, int)


@pytest.mark.parametrize(("power", "watts"), [
    ({"current_socket_power": 712, "average_socket_power": "N/A"}, 712.0),  # MI300 and newer
    ({"current_socket_power": "N/A", "average_socket_power": 298}, 298.0),  # MI210, Navi
    ({"socket_power": 705, "current_socket_power": "N/A", "average_socket_power": "N/A"}, 705.0),  # ROCm 7
    ({"current_socket_power": 0xFFFF, "average_socket_power": 0xFFFF}, None),  # ROCm 6.0's unsupported filler
    ({"current_socket_power": UINT32_MAX, "average_socket_power": 0, "socket_power": 0}, None),
    ({}, None),
])
def test_socket_power_from_whichever_field_the_gpu_fills(power, watts):
    assert read_one(FakeAmdsmi([mi300x(power=power)])).power_w == watts


@pytest.mark.parametrize(("change", "field", "value"), [
    ({"gfx": "N/A"}, "util_pct", None),
    ({"gfx": 0xFFFF}, "util_pct", None),  # ROCm 6.0 returned the raw 0xFFFF
    ({"gfx": 0}, "util_pct", 0.0),  # idle is a reading, not a missing one
    ({"vram_used": UINT32_MAX}, "memory_used_bytes", None),
    ({"vram_used": 0xFFFF}, "memory_used_bytes", 0xFFFF * MIB),  # 64 GiB - 1 MiB is a real amount of VRAM
    ({"vram_total": 0}, "memory_total_bytes", None),
    ({"power_cap": 0}, "power_limit_w", None),
    ({"resolution": "N/A"}, "energy_j", None),
    ({"market_name": "N/A"}, "name", None),
    ({"market_name": b"AMD Instinct MI250X"}, "name", "AMD Instinct MI250X"),
])
def test_unfilled_values_are_none_and_real_ones_are_kept(change, field, value):
    assert getattr(read_one(FakeAmdsmi([mi300x(**change)])), field) == value


# -- one sensor failing: only its fields go None ------------------------------------------------------------------

AFFECTS = {
    "amdsmi_get_gpu_asic_info": ("name",),
    "amdsmi_get_gpu_activity": ("util_pct", "mem_util_pct"),
    "amdsmi_get_gpu_vram_usage": ("memory_used_bytes", "memory_total_bytes"),
    "amdsmi_get_gpu_process_list": ("process_memory_bytes",),
    "amdsmi_get_power_info": ("power_w",),
    "amdsmi_get_power_cap_info": ("power_limit_w", "power_default_limit_w"),
    "amdsmi_get_energy_count": ("energy_j",),
    "amdsmi_get_clock_info": ("sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz"),
    "amdsmi_get_temp_metric": ("temperature_c",),
}


def test_a_read_calls_exactly_the_functions_in_affects():
    fake = FakeAmdsmi()
    reader = AmdReader(amdsmi=fake)
    reader.read({4242})
    reader.close()
    assert set(fake.calls) == set(AFFECTS) | {"amdsmi_init", "amdsmi_shut_down", "amdsmi_get_processor_handles"}


@pytest.mark.parametrize("error", [NOT_SUPPORTED, NOT_YET_IMPLEMENTED, NO_PERM, RETRY, BUSY,
                                   AmdSmiParameterException("wrong type"), TypeError("a binding bug")])
@pytest.mark.parametrize("function", sorted(AFFECTS))
def test_one_failing_sensor_gives_none_in_exactly_its_fields(function, error):
    baseline = read_one(FakeAmdsmi())
    broken = read_one(FakeAmdsmi().fail(function, error))
    for name in FIELDS:
        if name in AFFECTS[function]:
            assert getattr(broken, name) is None, name
        else:
            assert getattr(broken, name) == getattr(baseline, name), name


@pytest.mark.parametrize("function", sorted(AFFECTS))
def test_a_function_the_binding_lacks_is_a_none_not_a_crash(function):
    baseline = read_one(FakeAmdsmi())
    broken = read_one(FakeAmdsmi(missing={function}))
    changed = {name for name in FIELDS if getattr(broken, name) != getattr(baseline, name)}
    assert changed == set(AFFECTS[function])


def test_not_supported_is_not_asked_again_but_a_passing_error_is():
    fake = FakeAmdsmi().fail("amdsmi_get_power_info", NOT_SUPPORTED).fail("amdsmi_get_energy_count", BUSY)
    reader = AmdReader(amdsmi=fake)
    for _ in range(3):
        (sample,) = reader.read()
        assert sample.power_w is None and sample.energy_j is None
    assert fake.calls["amdsmi_get_power_info"] == 1 and fake.calls["amdsmi_get_energy_count"] == 3
    del fake.failing["amdsmi_get_power_info"], fake.failing["amdsmi_get_energy_count"]
    (sample,) = reader.read()
    assert sample.power_w is None and sample.energy_j == pytest.approx(EXPECTED["energy_j"])


def test_static_name_read_once_and_a_read_is_a_handful_of_calls():
    fake = FakeAmdsmi()
    reader = AmdReader(amdsmi=fake)
    reader.read({4242})
    fake.calls.clear()
    reader.read({4242})
    # activity, VRAM, processes, power, cap, energy, 2 clocks, temperature: 9; the name is kept
    assert sum(fake.calls.values()) == 9 and "amdsmi_get_gpu_asic_info" not in fake.calls, fake.calls
    fake.calls.clear()
    reader.read()
    assert sum(fake.calls.values()) == 8 and "amdsmi_get_gpu_process_list" not in fake.calls


# -- temperature ---------------------------------------------------------------------------------------------------


def test_temperature_falls_back_to_the_edge_sensor_and_keeps_to_it():
    fake = FakeAmdsmi([mi300x(temps={"EDGE": 55})])  # no hotspot sensor on this card
    reader = AmdReader(amdsmi=fake)
    assert [reader.read()[0].temperature_c for _ in range(3)] == [55.0] * 3
    assert fake.calls["amdsmi_get_temp_metric"] == 2 + 2  # hotspot (NotSupported, once), then edge every read
    fake.gpus[0]["temps"] = {"EDGE": 56, "HOTSPOT": 90}
    assert reader.read()[0].temperature_c == 56.0  # one sensor for the whole run: no jump between sensors


def test_temperature_through_junction_where_the_enum_has_no_hotspot():
    fake = FakeAmdsmi(rocm="6.0")
    assert not hasattr(fake.AmdSmiTemperatureType, "HOTSPOT")
    assert read_one(fake).temperature_c == 78.0


def test_the_chosen_sensor_failing_once_is_none_not_another_sensor():
    fake = FakeAmdsmi()
    reader = AmdReader(amdsmi=fake)
    reader.read()
    fake.fail("amdsmi_get_temp_metric", BUSY)
    assert reader.read()[0].temperature_c is None
    del fake.failing["amdsmi_get_temp_metric"]
    assert reader.read()[0].temperature_c == 78.0


# -- process memory ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rocm", ["6.0", "6.2"])
@pytest.mark.parametrize(("pids", "processes", "expected"), [
    (None, [(4242, 40 * GIB)], None),  # not asked
    ({4242}, [(4242, 40 * GIB), (777, 9 * GIB)], 40 * GIB),
    ({4242, 4243}, [(4242, 40 * GIB), (4243, 2 * GIB), (777, 9)], 42 * GIB),
    ({5}, [(4242, 40 * GIB)], None),  # not on this GPU, or another pid namespace
    ({4242}, [(4242, None)], 0),  # vram_mem "N/A": the process's "mem" (0 here)
    ({4242}, [], None),
])
def test_process_memory_of_the_watched_pids(rocm, pids, processes, expected):
    fake = FakeAmdsmi([mi300x(processes=processes)], rocm=rocm)
    (sample,) = AmdReader(amdsmi=fake).read(pids)
    assert sample.process_memory_bytes == expected
    assert fake.calls["amdsmi_get_gpu_process_list"] == (0 if pids is None else 1)


def test_a_process_that_ends_between_the_list_and_its_info_is_skipped():
    fake = FakeAmdsmi([mi300x(ended={4243})], rocm="6.0")
    assert read_one(fake).process_memory_bytes == 120 * GIB
    assert fake.calls["amdsmi_get_gpu_process_info"] == 3


# -- several GPUs, opening and closing -------------------------------------------------------------------------


def test_indices_choose_gpus_and_keep_their_amdsmi_index():
    fake = FakeAmdsmi([mi300x(), mi300x(market_name="AMD Instinct MI250X", power={"average_socket_power": 420})])
    assert [(s.index, s.name) for s in AmdReader(amdsmi=fake).read()] == [(0, "AMD Instinct MI300X"),
                                                                        (1, "AMD Instinct MI250X")]
    (sample,) = AmdReader([1], amdsmi=fake).read()
    assert (sample.index, sample.power_w) == (1, 420.0)


def test_open_and_close():
    fake = FakeAmdsmi()
    reader, why = open_amd(amdsmi=fake)
    assert why is None and reader.indices == (0,) and reader.vendor == "amd" and "\n" not in reader.note
    with reader:
        assert len(reader.read()) == 1
    reader.close()
    assert (fake.inits, fake.shutdowns) == (1, 1) and reader.read() == ()


@pytest.mark.parametrize(("fake", "indices", "expected"), [
    (FakeAmdsmi(init_error=INIT_ERROR), None, "amdsmi could not start (AmdSmiLibraryException: An error occured with "
                                              "code: 18): no AMD GPU driver here"),
    (FakeAmdsmi([]), None, "amdsmi sees no GPU"),
    (FakeAmdsmi(), [0, 3], "amdsmi has no GPU 3 (it sees 1)"),
    (FakeAmdsmi(missing={"amdsmi_get_processor_handles"}), None,  # ROCm 5.x: amdsmi_get_device_handles
     "amdsmi could not start (AttributeError: amdsmi_get_processor_handles): no AMD GPU driver here"),
])
def test_open_without_a_gpu_gives_a_one_line_reason_and_shuts_down(fake, indices, expected):
    assert open_amd(indices, amdsmi=fake) == (None, expected)
    assert fake.inits == fake.shutdowns  # every init undone


def test_open_where_amdsmi_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ImportError
    monkeypatch.setattr(amd, "rocm_present", lambda: False)
    assert open_amd() == (None, None)  # no sign of an AMD GPU: nothing to say
    monkeypatch.setattr(amd, "rocm_present", lambda: True)  # /dev/kfd: the driver is here, the binding is not
    reader, why = open_amd()
    assert reader is None and why.startswith("amdsmi is not importable (ModuleNotFoundError") and "\n" not in why
    assert "pip install /opt/rocm/share/amd_smi" in why


# -- open_nvml falls back to AMD ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("nvml", [FakeNvml(init_error=LIBRARY_NOT_FOUND), FakeNvml([])],
                         ids=["no NVIDIA driver", "no NVIDIA GPU"])
def test_open_nvml_reads_amd_where_nvml_finds_no_gpu(nvml):
    fake = FakeAmdsmi()
    reader, why = open_nvml(nvml=nvml, amdsmi=fake)
    assert why is None and isinstance(reader, AmdReader)
    (sample,) = reader.read({4242, 4243})
    assert sample.vendor == "amd" and sample.process_memory_bytes == 128 * GIB
    reader.close()
    assert fake.shutdowns == 1 and nvml.inits == nvml.shutdowns


def test_open_nvml_with_an_nvidia_gpu_never_starts_amdsmi():
    fake = FakeAmdsmi()
    reader, why = open_nvml(nvml=FakeNvml([h100()]), amdsmi=fake)
    assert why is None and isinstance(reader, NvmlReader) and fake.calls == Counter()
    reader.close()
    # a requested index NVML lacks: NVIDIA GPUs are here, the reason stays NVML's (the caller retries without it)
    assert open_nvml([3], nvml=FakeNvml([h100()]), amdsmi=fake) == (None, "NVML has no GPU 3 (FakeNVMLError: "
                                                                          "Invalid Argument)")
    assert fake.calls == Counter()


def test_open_nvml_with_neither_joins_both_reasons_on_one_line():
    reader, why = open_nvml(nvml=FakeNvml(init_error=LIBRARY_NOT_FOUND), amdsmi=FakeAmdsmi(init_error=INIT_ERROR))
    assert reader is None and "\n" not in why
    assert why == ("NVML could not start (FakeNVMLError: NVML Shared Library Not Found): no NVIDIA driver here; "
                   "amdsmi could not start (AmdSmiLibraryException: An error occured with code: 18): no AMD GPU "
                   "driver here")
    # an index on neither: "has no GPU" in the reason, as the sampler checks before retrying with every GPU
    reader, why = open_nvml([3], nvml=FakeNvml([]), amdsmi=FakeAmdsmi())
    assert reader is None
    assert why == "NVML has no GPU 3 (FakeNVMLError: Invalid Argument); amdsmi has no GPU 3 (it sees 1)"


def test_open_nvml_with_a_callers_own_nvml_does_not_import_amdsmi(monkeypatch):
    fake = FakeAmdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    assert open_nvml(nvml=FakeNvml([])) == (None, "NVML sees no GPU")  # a test's NVML: no real probe behind it
    assert fake.calls == Counter()


def test_open_nvml_default_path_imports_amdsmi(monkeypatch):
    """As the sampler and ``watch`` call it (no module given): pynvml missing, amdsmi importable."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", FakeAmdsmi())
    reader, why = open_nvml()
    assert why is None and isinstance(reader, AmdReader) and reader.indices == (0,)
    reader.close()


def test_open_nvml_default_path_without_amdsmi_keeps_nvmls_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setattr(amd, "rocm_present", lambda: False)
    reader, why = open_nvml()
    assert reader is None and why.startswith("nvidia-ml-py is not importable") and "amdsmi" not in why
    monkeypatch.setattr(amd, "rocm_present", lambda: True)
    reader, why = open_nvml()
    assert reader is None and why.startswith("nvidia-ml-py is not importable") and "\n" not in why
    assert "; amdsmi is not importable (ModuleNotFoundError" in why
