"""Fake NVMLs. ``FakeNvml``, for the reader's tests: the ``pynvml`` functions and constants gpuwise calls (one call per
handle), per-device state in NVML's own units, any function made to raise ``NVMLError`` or to be missing, a stream of
states read by read, and pynvml's real ctypes structs where the reader reads a struct's fields. Two small ones beside
it: ``ProbeNvml``, the calls the environment probe makes, and ``two_gpu_nvml``, the functions ``watch`` reads (with
``BareNVMLError``)."""

from __future__ import annotations

import ctypes
import functools
from collections import Counter
from types import SimpleNamespace
from typing import ClassVar

import pynvml

from gpuwise.units import GiB

NOT_SUPPORTED, NO_PERMISSION, TIMEOUT, LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 4, 10, 12, 13, 15
UINT_MAX = 0xFFFFFFFF


class FakeNVMLError(Exception):
    """pynvml.NVMLError's shape: an error code in ``.value``."""

    _TEXT: ClassVar[dict[int, str]] = {
        NOT_SUPPORTED: "Not Supported", NO_PERMISSION: "Insufficient Permissions", TIMEOUT: "Timeout",
        LIBRARY_NOT_FOUND: "NVML Shared Library Not Found", FUNCTION_NOT_FOUND: "Function Not Found",
        GPU_IS_LOST: "GPU is lost", 2: "Invalid Argument"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._TEXT.get(self.value, f"NVML Error with code {self.value}")


def _api(fn):
    """Counts the call, then raises the error the test asked this function for, if any."""

    @functools.wraps(fn)
    def call(self, *args):
        self.calls[fn.__name__] += 1
        if fn.__name__ in self.failing:
            raise self.NVMLError(self.failing[fn.__name__])
        return fn(self, *args)

    return call


def h100(**changes) -> dict:
    """An H100 SXM under load, in NVML's raw units (mW, mJ, KB/s, KiB counters per link, MHz, C)."""
    state = dict(
        name="NVIDIA H100 80GB HBM3", util_gpu=97, util_mem=41,
        mem_total=85_520_809_984, mem_used=61_203_283_968,
        processes=[(4242, 40_000_000_000), (4243, 12_000_000_000), (777, 9_000_000_000)],
        power_mw=612_345, power_limit_mw=700_000, power_default_limit_mw=700_000, energy_mj=987_654_321,
        clock_sm=1_755, clock_mem=2_619, clock_sm_max=1_980, clock_mem_max=2_619,
        reasons=0x4 | 0x20, temp=71, temp_slowdown=87,
        pcie_tx_kb=1_536, pcie_rx_kb=262_144,
        nvlink_tx_kib=[1_000_000 * (link + 1) for link in range(18)],
        nvlink_rx_kib=[2_000_000 * (link + 1) for link in range(18)],
        nvlink_aggregate=True,  # the driver answers scopeId UINT_MAX with the sum over links
        gpm_supported=True, gpm={2: 83.5, 3: 41.25, 5: 62.0, 10: 55.5},
    )
    state.update(changes)
    return state


class FakeNvml:
    """A stand-in for the pynvml module over a list of device states."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NO_PERMISSION
    NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    NVML_NVLINK_MAX_LINKS = 18
    NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_SM_OCCUPANCY = 2, 3
    NVML_GPM_METRIC_ANY_TENSOR_UTIL, NVML_GPM_METRIC_DRAM_BW_UTIL = 5, 10
    NVML_GPM_METRICS_GET_VERSION = 1
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t  # the real ctypes struct: its field names are checked

    def __init__(self, devices: list[dict] | None = None, *, stream: list[list[dict]] | None = None,
                 missing: set[str] = frozenset(), init_error: int | None = None) -> None:
        self.devices = [dict(d) for d in (devices if devices is not None else [h100()])]
        self.stream = list(stream or [])  # per read: one dict of changes per device
        self.missing = set(missing)
        self.init_error = init_error
        self.failing: dict[str, int] = {}  # function name -> the NVML error code it raises
        self.calls: Counter[str] = Counter()
        self.inits = self.shutdowns = 0
        self.samples: dict[int, dict | None] = {}  # live GPM samples by address -> what they captured
        self.freed: list[int] = []
        self.gpm_history: list[tuple[int, int, dict]] = []  # (device, sequence number, its GPM state) per sample
        self._seq = 0

    def __getattribute__(self, name: str):
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)  # an older binding without this function
        return object.__getattribute__(self, name)

    # -- test controls --------------------------------------------------------------------------------------

    def fail(self, name: str, code: int = NOT_SUPPORTED) -> FakeNvml:
        self.failing[name] = code
        return self

    def step(self) -> None:
        """The next state of the stream: NVML's answers move on."""
        for device, changes in zip(self.devices, self.stream.pop(0), strict=True):
            device.update(changes)


    def _dev(self, handle) -> dict:
        assert isinstance(handle, SimpleNamespace), f"not a handle: {handle!r}"  # never a bare index
        return self.devices[handle.index]

    # -- pynvml's functions ---------------------------------------------------------------------------------

    @_api
    def nvmlInit(self):
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.inits += 1

    @_api
    def nvmlShutdown(self):
        self.shutdowns += 1

    @_api
    def nvmlDeviceGetCount(self):
        return len(self.devices)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.devices):
            raise self.NVMLError(2)
        if self.devices[index].get("lost"):
            raise self.NVMLError(GPU_IS_LOST)
        return SimpleNamespace(index=index)

    @_api
    def nvmlDeviceGetName(self, h):
        return self._dev(h)["name"]

    @_api
    def nvmlDeviceGetUtilizationRates(self, h):
        d = self._dev(h)
        return SimpleNamespace(gpu=d["util_gpu"], memory=d["util_mem"])

    @_api
    def nvmlDeviceGetMemoryInfo(self, h):
        d = self._dev(h)
        return SimpleNamespace(total=d["mem_total"], used=d["mem_used"], free=d["mem_total"] - d["mem_used"])

    @_api
    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self._dev(h)["processes"]]

    @_api
    def nvmlDeviceGetPowerUsage(self, h):
        return self._dev(h)["power_mw"]

    @_api
    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._dev(h)["power_limit_mw"]

    @_api
    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return self._dev(h)["power_default_limit_mw"]

    @_api
    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._dev(h)["energy_mj"]

    @_api
    def nvmlDeviceGetClockInfo(self, h, clock):
        return self._dev(h)[{self.NVML_CLOCK_SM: "clock_sm", self.NVML_CLOCK_MEM: "clock_mem"}[clock]]

    @_api
    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return self._dev(h)[{self.NVML_CLOCK_SM: "clock_sm_max", self.NVML_CLOCK_MEM: "clock_mem_max"}[clock]]

    @_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._dev(h)["reasons"]

    @_api
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._dev(h)["reasons"]

    @_api
    def nvmlDeviceGetTemperatureV(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._dev(h)["temp"]

    @_api
    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._dev(h)["temp"]

    @_api
    def nvmlDeviceGetTemperatureThreshold(self, h, threshold):
        assert threshold == self.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return self._dev(h)["temp_slowdown"]

    @_api
    def nvmlDeviceGetPcieThroughput(self, h, counter):
        return self._dev(h)[{self.NVML_PCIE_UTIL_TX_BYTES: "pcie_tx_kb", self.NVML_PCIE_UTIL_RX_BYTES: "pcie_rx_kb"}[
            counter]]

    @_api
    def nvmlDeviceGetFieldValues(self, h, field_ids):
        """As pynvml builds it: a ``(fieldId, scopeId)`` tuple sets the scope, a bare id leaves scope 0 (link 0).
        NVLink counters answer per link, or summed for scope UINT_MAX; an error goes in each value's nvmlReturn."""
        d = self._dev(h)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, field_id in zip(values, field_ids, strict=True):
            try:
                v.fieldId, v.scopeId = field_id
            except TypeError:
                v.fieldId = field_id
            links = {self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: d["nvlink_tx_kib"],
                     self.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: d["nvlink_rx_kib"]}.get(v.fieldId)
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if not links or (v.scopeId == UINT_MAX and not d["nvlink_aggregate"]) or (
                    v.scopeId != UINT_MAX and v.scopeId >= len(links)):
                v.nvmlReturn = NOT_SUPPORTED
            else:
                v.value.ullVal = sum(links) if v.scopeId == UINT_MAX else links[v.scopeId]
        return values

    @_api
    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(version=1, isSupportedDevice=int(self._dev(h)["gpm_supported"]))

    @_api
    def nvmlGpmSampleAlloc(self):
        sample = pynvml.c_nvmlGpmSample_t(pynvml.struct_c_nvmlGpmSample_t())
        self.samples[ctypes.cast(sample, ctypes.c_void_p).value] = None
        return sample

    @_api
    def nvmlGpmSampleGet(self, h, sample):
        address = ctypes.cast(sample, ctypes.c_void_p).value
        assert address in self.samples, "not a live sample"
        self._seq += 1
        self.samples[address] = {"device": h.index, "seq": self._seq}
        self.gpm_history.append((h.index, self._seq, dict(self._dev(h)["gpm"])))
        return sample

    @_api
    def nvmlGpmMetricsGet(self, request):
        """The metrics over the interval from sample1 to sample2 (of one device, sample1 older): the mean of the
        device's states at every sample taken in it after sample1, so a stale sample1 shows as a blurred value."""
        first, second = (self.samples.get(ctypes.cast(s, ctypes.c_void_p).value) for s in (request.sample1,
                                                                                               request.sample2))
        if request.version != self.NVML_GPM_METRICS_GET_VERSION or first is None or second is None or \
                first["device"] != second["device"] or first["seq"] >= second["seq"]:
            raise self.NVMLError(2)
        states = [gpm for device, seq, gpm in self.gpm_history
                  if device == first["device"] and first["seq"] < seq <= second["seq"]]
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if all(metric.metricId in gpm for gpm in states):
                metric.value = sum(gpm[metric.metricId] for gpm in states) / len(states)
                metric.nvmlReturn = 0
            else:
                metric.nvmlReturn = NOT_SUPPORTED
        return request

    @_api
    def nvmlGpmSampleFree(self, sample):
        address = ctypes.cast(sample, ctypes.c_void_p).value
        del self.samples[address]
        self.freed.append(address)


class ProbeNvml:
    """The pynvml calls the environment probe makes, for one H100 whose memory query is not supported."""

    NVMLError = Exception

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlSystemGetDriverVersion(self): return "580.82.07"
    def nvmlSystemGetCudaDriverVersion_v2(self): return 13000
    def nvmlDeviceGetCount(self): return 2
    def nvmlDeviceGetHandleByIndex(self, i):
        if i == 1:
            raise RuntimeError("NVMLError_GpuIsLost")
        return i
    def nvmlDeviceGetName(self, h): return b"NVIDIA H100 80GB HBM3"
    def nvmlDeviceGetUUID(self, h): return "GPU-0000-1111"
    def nvmlDeviceGetCudaComputeCapability(self, h): return (9, 0)
    def nvmlDeviceGetComputeRunningProcesses(self, h): return []
    def nvmlDeviceGetMemoryInfo(self, h): raise RuntimeError("NVMLError_NotSupported")


class BareNVMLError(Exception):
    """An NVMLError with only its code, 999 unless given."""

    def __init__(self, value: int = 999) -> None:
        super().__init__(value)
        self.value = value


def two_gpu_nvml(watched: set[int]) -> SimpleNamespace:
    """Two GPUs: 0 busy with the watched process (8 GiB of it), 1 idle and not the command's. Every function
    NvmlReader asks that is not here is a missing function to it: a None field."""
    state = {"inits": 0, "reads": 0}

    def util(h):
        state["reads"] += 1
        return SimpleNamespace(gpu=80 if h == 0 else 0, memory=40 if h == 0 else 0)

    def processes(h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=8 * GiB) for pid in watched] if h == 0 else []

    return SimpleNamespace(
        NVMLError=BareNVMLError, state=state,
        nvmlInit=lambda: state.__setitem__("inits", state["inits"] + 1),
        nvmlShutdown=lambda: state.__setitem__("inits", state["inits"] - 1),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=(10 if h == 0 else 1) * GiB, total=80 * GiB),
        nvmlDeviceGetPowerUsage=lambda h: 300_000 if h == 0 else 70_000,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetComputeRunningProcesses=processes,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980 if h == 0 else 345,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetTemperature=lambda h, sensor: 60 if h == 0 else 30,
    )
